"""The cost model put to work on a machine or a cluster: what `hpcdl tune` and the benchmarks call.

    fit.py        measuring (under mpirun): the model fitted here, every algorithm timed over a
                  size sweep (hpcdl/benchmarking/), the tuning file `auto` follows (`run_tune`)
    predict.py    planning (one process, no MPI): a training step's buckets, each one allreduce
                  per algorithm, and the scaling efficiency that follows (`run_predict`)
    overlap.py    a step's buckets as a timeline recorded them, replayed with overlap on and off
    readable.py   sizes and times as the reports print them

Each takes a typed configuration (`FitConfig`, `PredictConfig`) whose defaults `hpcdl tune`'s
parser takes. Importing this package starts no MPI and imports no torch; `run_tune` starts MPI.
"""
from __future__ import annotations

from .fit import FitConfig, run_tune
from .overlap import BucketSchedule
from .predict import PredictConfig, PredictionInputError, run_predict

__all__ = ["BucketSchedule", "FitConfig", "PredictConfig", "PredictionInputError", "run_predict", "run_tune"]
