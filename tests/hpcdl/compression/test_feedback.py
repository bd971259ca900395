"""Error feedback, called directly: what is not sent is kept and added to the next step's
gradient; with momentum (DGC), the velocity too, masked where sent. test_compression.py runs it
inside the sparse schemes. No communication.
"""
from __future__ import annotations

import torch

from hpcdl.compression.feedback import ErrorFeedback


def test_what_was_not_sent_is_kept_for_the_next_step() -> None:
    feedback = ErrorFeedback()
    feedback.setup([("w", torch.zeros(2, 2))])
    v = feedback.accumulate("w", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert v.tolist() == [1.0, 2.0, 3.0, 4.0]
    feedback.sent("w", torch.tensor([3]), torch.tensor([4.0]))
    assert feedback.accumulate("w", torch.ones(2, 2)).tolist() == [2.0, 3.0, 4.0, 1.0]


def test_momentum_accumulates_a_velocity_masked_where_sent() -> None:
    feedback = ErrorFeedback(momentum=0.5)
    feedback.setup([("w", torch.zeros(3))])
    feedback.accumulate("w", torch.tensor([2.0, 2.0, 2.0]))  # u = 2, v = 2
    feedback.sent("w", torch.tensor([0]), torch.tensor([2.0]))  # v[0] = 0, u[0] = 0
    assert feedback.accumulate("w", torch.tensor([2.0, 2.0, 2.0])).tolist() == [2.0, 5.0, 5.0]  # u = 2, 3, 3
    saved = feedback.state_dict()
    again = ErrorFeedback(momentum=0.5)
    again.setup([("w", torch.zeros(3))])
    again.load_state_dict(saved)
    assert again.v["w"].tolist() == [2.0, 5.0, 5.0] and again.u["w"].tolist() == [2.0, 3.0, 3.0]
    again.setup([("w", torch.zeros(4))])  # another shape: fresh state
    assert again.v["w"].tolist() == [0.0] * 4
