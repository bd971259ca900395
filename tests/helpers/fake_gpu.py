"""Run a Python module or script as if this host had one GPU: the fake device of `arrays.py`.

    python tests/helpers/fake_gpu.py -m hpcdl.cli bench --device gpu -b 8 -e 64K
    mpirun -n 2 python tests/helpers/fake_gpu.py benchmarks/staging.py --device gpu --sizes-mib 2 4

`cupy` is `arrays.fake_cupy_module()` (one GPU whose memory is host memory) and the collectives'
device runtime a `FakeDeviceRuntime`, MPI treated as not CUDA-aware (the staged path, as with the
PyPI Open MPI) unless HPCDL_CUDA_AWARE says otherwise; HPCDL_FAKE_COPY_GBPS gives its copies a
cost in wall time; HPCDL_FAKE_IPC=1 makes it a `FakeIpcRuntime`, whose ranks of one host reach
each other's memory by (fake) CUDA IPC, the `cupy` arrays allocated where it can map them.
`scripts/gpu_check.sh --fake` runs its device steps through this, so CI runs
every step of the GPU check without a GPU.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.helpers`

from tests.helpers.arrays import FakeDeviceRuntime, FakeIpcRuntime, fake_cupy_module  # noqa: E402

import collectives  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(__doc__)
    os.environ.setdefault("HPCDL_CUDA_AWARE", "0")
    gbps = os.environ.get("HPCDL_FAKE_COPY_GBPS")
    bandwidth = float(gbps) * 1e9 if gbps else None
    if os.environ.get("HPCDL_FAKE_IPC") == "1":
        runtime = FakeIpcRuntime(copy_bandwidth=bandwidth)
        sys.modules["cupy"] = fake_cupy_module(runtime.arena.empty)
    else:
        runtime = FakeDeviceRuntime(copy_bandwidth=bandwidth)
        sys.modules["cupy"] = fake_cupy_module()
    collectives.set_device_runtime(runtime)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
