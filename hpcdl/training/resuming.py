"""What a run that ends early tells the user about going on (`resume_advice`): the newest
checkpoint in its --checkpoint-dir and the option that resumes from it, or that there is none.

Every early end says it the same way: a lost rank the job cannot go on without, a full disk, a
stop on a signal, an interruption (docs/training.md#bad-options-failures-and-exit-statuses).
"""
from __future__ import annotations

from pathlib import Path


def newest_step(directory: str | Path) -> int | None:
    """The step of the newest file named like a checkpoint in `directory`, or None (one listing,
    nothing read: cheap enough for a signal handler)."""
    from ..runtime.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    return found[-1][0] if found else None


def resume_advice(directory: str | Path | None) -> str:
    """One sentence on how to go on: resume from the newest checkpoint of `directory` (the run's
    --checkpoint-dir), or start again where there is none."""
    if directory is None:
        return "There is no checkpoint to resume from (no --checkpoint-dir): run it again to start over."
    step = newest_step(directory)
    if step is None:
        return f"No checkpoint was written to {directory} yet: run it again without --resume to start over."
    return f"Resume from the checkpoint of step {step} in {directory} with --resume."
