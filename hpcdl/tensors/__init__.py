"""Collectives on torch tensors, over `collectives`: the layer every torch-side part talks through.

    arrays.py      tensors as zero-copy arrays for the collectives (CPU, CUDA via CuPy,
                   bfloat16 through its bits), and refusals every rank raises together
    streams.py     a device's streams and events as DDP orders a step by them: ready
                   events, the side stream, the results handed back by an event
    calls.py       `hpcdl.allreduce(t)` & co. and their i* twins: tensors in, tensors out
    handle.py      TensorHandle: a non-blocking call on tensors, the one handle type the
                   front doors (hpcdl.*, Horovod's API, the torch.distributed backend) share
    fusion.py      many small tensors reduced or broadcast as one flat buffer
    alltoall.py    a pairwise alltoall with uneven splits

Importing this package imports neither torch nor MPI; each module does when used.
"""
