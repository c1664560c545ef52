"""Error feedback for a lossy codec: what quantization dropped this round is sent next round.

    to_send  = delta + residual            (the compensated pseudo-gradient)
    sent     = decode(encode(to_send))     (what the group actually receives from us)
    residual = to_send - sent              (kept only if the round completed)

Over R rounds the sum of what was sent differs from the sum of the true deltas by one residual
(bounded by one round's quantization error) instead of a sum of R independent errors. Pure tensor
code: the caller decides when a round committed.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self, numel: int):
        self.residual = torch.zeros(numel, dtype=torch.float32)  # (n,) fp32
        self._pending: torch.Tensor | None = None

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """delta + residual, (n,) fp32: encode this instead of ``delta``."""
        return delta + self.residual

    def sent(self, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Remembers what this round's residual would be; applied by ``commit``."""
        self._pending = compensated - decoded

    def commit(self) -> None:
        """The round completed: keep the new residual."""
        if self._pending is not None:
            self.residual, self._pending = self._pending, None

    def discard(self) -> None:
        """The round was void: nothing was applied, keep the old residual."""
        self._pending = None
