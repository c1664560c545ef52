"""Error feedback lowers the error accumulated over rounds, and void rounds leave it untouched."""

from __future__ import annotations

import torch

from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.int8 import get_codec


def _accumulated_error(rounds: int, feedback: bool) -> float:
    codec, n = get_codec("int8", 4096), 50_000
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(n)
    true_sum, sent_sum = torch.zeros(n), torch.zeros(n)
    for _ in range(rounds):
        delta = torch.distributions.StudentT(3.0).sample((n,)) * 0.01 + 1e-3 * torch.randn(n, generator=g)
        to_send = ef.compensate(delta) if feedback else delta
        decoded = codec.decode(codec.encode(to_send), n)
        if feedback:
            ef.sent(to_send, decoded)
            ef.commit()
        true_sum += delta
        sent_sum += decoded
    return float((sent_sum - true_sum).norm() / true_sum.norm())


def test_error_feedback_lowers_accumulated_error() -> None:
    torch.manual_seed(0)
    without = _accumulated_error(30, feedback=False)
    with_ef = _accumulated_error(30, feedback=True)
    assert with_ef < 0.5 * without, (with_ef, without)


def test_void_round_keeps_the_residual() -> None:
    ef = ErrorFeedback(3)
    ef.sent(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 2.0, 2.0]))
    ef.commit()
    assert torch.equal(ef.residual, torch.tensor([0.5, 0.0, 1.0]))
    ef.sent(torch.tensor([9.0, 9.0, 9.0]), torch.zeros(3))
    ef.discard()
    assert torch.equal(ef.residual, torch.tensor([0.5, 0.0, 1.0]))
    assert torch.equal(ef.compensate(torch.ones(3)), torch.tensor([1.5, 1.0, 2.0]))
