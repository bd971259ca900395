"""Transparent huge pages for torch's CPU tensors (hpcdl.runtime.memory): reading the kernel's answers, and
`import hpcdl` giving torch huge pages (checked in fresh interpreters, at N=1 only)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcdl.runtime import memory
from tests.run import own_job_environment


def test_kernel_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert memory.kernel_mode(str(setting)) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert memory.kernel_mode(str(setting)) == "always"
    assert memory.kernel_mode(str(tmp_path / "missing")) is None


SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:         0 kB
THPeligible:           1

7f0000400000-7f0000800000 rw-p 00000000 00:00 0
Size:               4096 kB
THPeligible:           0
VmFlags: rd wr mr mw me ac
7f0000800000-7f0000801000 r--p 00000000 08:01 1234                       /usr/lib/libfoo.so
Size:                  4 kB
55d000457000-55d000478000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
AnonHugePages:         0 kB
THPeligible:           0
VmFlags: rd wr mr mw me ac hg
55d000478000-55d000857000 rw-p 00000000 00:00 0                          [heap]
Size:               3964 kB
THPeligible:           1
VmFlags: rd wr mr mw me ac hg
"""


def test_huge_pages_advised_reads_the_mapping_of_the_address(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    # a 4 MiB block torch advised, from the heap: its first pages are a mapping too small for a
    # huge page (seen under benchmarks/train_throughput.py after gloo's mode), still advised
    assert memory.huge_pages_advised(0x55D000457000, str(smaps)) is True
    assert memory.huge_pages_advised(0x7F0000000010, str(smaps)) is True
    assert memory.huge_pages_advised(0x7F0000400000, str(smaps)) is False
    assert memory.huge_pages_advised(0x7F0000800000, str(smaps)) is None  # no THPeligible or VmFlags line
    assert memory.huge_pages_advised(0x1000, str(smaps)) is None  # in no mapping
    assert memory.huge_pages_advised(0x1000, str(tmp_path / "missing")) is None


def _fresh_python(code: str, **env: str) -> str:
    """stdout of `code` in a new interpreter, outside this job's MPI launcher (a singleton)."""
    clean = {k: v for k, v in own_job_environment().items() if k != memory.ENV}
    clean.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


needs_madvise = pytest.mark.skipif(memory.kernel_mode() != "madvise",
                                   reason="transparent huge pages are not in madvise mode here")


@needs_madvise
@pytest.mark.timeout(300)
def test_importing_hpcdl_first_gives_torch_tensors_huge_pages() -> None:
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("one interpreter check is enough: runs at N=1")
    probe = ("from hpcdl.runtime.memory import PROBE_BYTES, huge_pages_advised, small_pages_warning; "
             "t = torch.empty(PROBE_BYTES, dtype=torch.uint8); "
             "print(huge_pages_advised(t.data_ptr()), small_pages_warning() is None)")
    assert _fresh_python("import hpcdl, torch; " + probe) == "True True"
    # torch allocating before hpcdl is imported: too late, and the warning says so
    assert _fresh_python("import torch; torch.ones(1); import hpcdl; " + probe) == "False False"
    # the user's own choice wins: 0 keeps 4 KiB pages and silences the warning
    assert _fresh_python("import hpcdl, torch; " + probe, **{memory.ENV: "0"}) == "False True"
