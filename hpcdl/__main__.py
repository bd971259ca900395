"""`python -m hpcdl <command>`: the same as the `hpcdl` command (hpcdl/commands/cli.py)."""
import sys

from .commands.cli import main

sys.exit(main())
