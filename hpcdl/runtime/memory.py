"""Transparent huge pages for torch's CPU tensors: what makes gradients cheap to move between ranks.

On Linux with transparent huge pages in "madvise" mode (a common default), NumPy asks for huge pages
for its large arrays, but torch's CPU allocator does so only when `THP_MEM_ALLOC_ENABLE=1` is in the
environment before its first allocation. Over shared memory Open MPI moves a large message with
one copy straight from the peer's pages (CMA, `process_vm_readv`), which costs per page, and every
fold and copy walks the pages too: averaging 100 MiB took 2.7x longer on torch tensors in 4 KiB
pages than in huge pages (measurements: docs/training.md, "Huge pages").

So `import hpcdl` sets `THP_MEM_ALLOC_ENABLE=1` unless the variable is already set (`0` keeps it
off), and `DistributedDataParallel` warns, with what to do, when ranks share a host and torch's
tensors still cannot get huge pages because torch allocated before hpcdl was imported. What the
setting also does: child processes inherit it (it is in `os.environ`); a tensor of 2 MiB or more
that is touched sparsely can take more memory, in 2 MiB steps; and where the kernel's THP
`defrag` setting is `madvise` (its default), a page fault in such a tensor may compact memory
first, which can stall on a fragmented host. Programs that use only `collectives` with torch
tensors get neither the setting nor the warning.
"""
from __future__ import annotations

import os
import sys
from typing import Any

#: The variable torch's CPU allocator reads, once, at its first allocation.
ENV = "THP_MEM_ALLOC_ENABLE"
#: Where Linux says which transparent-huge-page mode is in force: "[always] madvise never".
KERNEL_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
#: Torch asks for huge pages for tensors of at least 2 MiB; probe with one of this size.
PROBE_BYTES = 4 << 20


def request_huge_pages() -> None:
    """Set THP_MEM_ALLOC_ENABLE=1 for torch unless the user chose a value."""
    os.environ.setdefault(ENV, "1")


def kernel_mode(setting: str = KERNEL_SETTING) -> str | None:
    """"always", "madvise" or "never" (the bracketed word of `setting`); None where unknown."""
    try:
        with open(setting) as f:
            words = f.read().split()
    except OSError:
        return None
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def huge_pages_advised(address: int, smaps: str = "/proc/self/smaps") -> bool | None:
    """Whether the mapping holding `address` may be backed by huge pages: advised so (`hg` among
    smaps' VmFlags: torch's allocator calls madvise(MADV_HUGEPAGE) on each large block when
    THP_MEM_ALLOC_ENABLE=1) or eligible (THPeligible 1); None where the kernel says neither.

    Why the advice and not THPeligible alone: a block that glibc carves out of the heap can start
    in a mapping of a few pages (madvise splits the heap's mapping at the blocks' edges), which
    can hold no huge page and so reads "THPeligible 0" although torch advised the whole block."""
    eligible: bool | None = None
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                if not line.strip():
                    continue
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi ...
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "THPeligible:":
                    eligible = line.split()[1] == "1"
                elif inside and head == "VmFlags:":
                    eligible = bool(eligible) or "hg" in line.split()[1:]
    except (OSError, ValueError):
        return None
    return eligible


def small_pages_warning() -> str | None:
    """A message saying how to give torch's CPU tensors huge pages, or None where they have them
    (or where nothing in this process can change it: not Linux, THP off or always on)."""
    if not sys.platform.startswith("linux") or kernel_mode() != "madvise" or os.environ.get(ENV) == "0":
        return None
    import torch

    probe = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    if huge_pages_advised(probe.data_ptr()) is not False:
        return None
    return (f"torch allocated its CPU tensors before {ENV}=1 was set, so they use 4 KiB pages "
            "and averaging gradients over shared memory runs about 2.5x slower (hpcdl.runtime.memory); "
            f"import hpcdl before creating any tensor, or `export {ENV}=1` before starting "
            f"Python ({ENV}=0 silences this)")


def available_bytes() -> int | None:
    """Memory this process could still allocate: Linux's MemAvailable, lowered to what is left
    under the container's cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) if there is
    one. None where /proc/meminfo cannot be read (not Linux).

    For checks up front ("this needs 40 GiB, 12 GiB are available"), not for planning to the
    byte: other processes allocate and free meanwhile.
    """
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            available = min(available, max(0, int(limit) - usage))
    return available


def host_available_bytes(comm: Any = None) -> int | None:
    """Collective over `comm` (default MPI.COMM_WORLD): the least `available_bytes()` that the
    ranks of this host read, the same on each of them, so a refusal quoting it reads alike on
    every rank (each rank's own reading differs by what was allocated meanwhile). None where
    unknown."""
    from mpi4py import MPI

    mine = available_bytes()
    node = (comm or MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        least = node.allreduce(-1 if mine is None else mine, op=MPI.MIN)
    finally:
        node.Free()
    return None if least < 0 else least


def shortfall(need: int, ranks_on_host: int, available: int | None) -> str | None:
    """None if `need` bytes per rank fit in `available` bytes (`host_available_bytes`) shared by
    the host's `ranks_on_host` ranks, or if `available` is None (unknown); else the words for a
    refusal, "N GiB per rank, and this host has ... available for its k rank(s) (... each)".
    """
    if available is None:
        return None
    share = available // max(1, ranks_on_host)
    if need <= share:
        return None
    gib = 2 ** 30
    return (f"{need / gib:,.2f} GiB per rank, and this host has {available / gib:,.2f} GiB available "
            f"for its {ranks_on_host} rank(s) ({share / gib:,.2f} GiB each)")
