"""One module per algorithm, named after its registry entry; `fold.py` is their shared fold.

Each module holds the run functions, their cost formulas and an `ALGORITHMS` tuple describing
them; `registry.py` gathers the tuples. Algorithms do only point-to-point messages and local
reductions through a `transport.Link`, and know nothing of threads, tuning or the caller's arrays.
"""
