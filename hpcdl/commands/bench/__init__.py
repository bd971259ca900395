"""`hpcdl bench`: the collective microbenchmark (command.py; its table and files: report.py)."""
from .command import main

__all__ = ["main"]
