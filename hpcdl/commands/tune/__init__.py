"""`hpcdl tune`: fit the alpha-beta-gamma model on this machine and write a tuning file for auto;
or, with `--predict`, plan a cluster-scale job from the same model.

    mpirun -n 4 hpcdl tune -o tuning.json          # measure, sweep every algorithm, write the file
    mpirun -n 4 hpcdl tune --model-only -o t.json  # only alpha, beta, gamma, overhead (seconds)
    export HPCDL_TUNING_FILE=$PWD/tuning.json      # then algorithm="auto" follows it
    hpcdl tune --predict --nodes 256 --link 100gbit --latency 2us --model-params 25e6 --compute-ms 120

Measuring (under mpirun, 2 ranks or more): point-to-point messages through the transport the
algorithms use give alpha and beta, the reduction's local combine gives gamma, a tiny call gives
the per-call overhead (`collectives.calibrate`). Then, unless `--model-only`, every hand-written
algorithm of every chosen collective is timed at this rank count over a size sweep (`-b/-e/-f` as
in nccl-tests; sizes as nccl-tests counts them). The file holds the model, the decision rows for
this rank count from the measurements (the fastest correct algorithm per size, switching only on
a >5% win so noise does not flip-flop the table; `mpi` never, as it cannot reduce bfloat16),
rows for other rank counts from the model, and the raw measurements. Rank 0 writes it atomically.

Predicting (one process, no MPI job needed): the model's gradients, in buckets of `--bucket-mb`,
each one allreduce, per algorithm, and the resulting scaling efficiency of synchronous SGD.
Formulas and assumptions: docs/cost_model.md.

command.py (the command line), predict.py (--predict), fit.py (measuring, the tuning file).
"""
from .command import main

__all__ = ["main"]
