"""The simulator's objective: a noisy quadratic whose inner steps take virtual time.

Each peer pulls the shared vector towards its own target (the run's optimum plus a fixed offset
per peer: non-identical data) with AdamW on noisy gradients, for ``spec.sync_every`` steps per
round; the held-out loss is the distance to the run's optimum. The steps are real torch on a small
vector, so pseudo-gradients, the int8 codec, the outer step, snapshots and state hashes are the
real ones; what the steps cost is virtual: ``compute()`` seconds per round (the peer's speed and
its jitter), spent by ``pause`` on the simulator's clock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hivetrain.peer.config import RunSpec
from hivetrain.peer.train.learner import Progress
from hivetrain.peer.train.schedule import set_inner_lr

TOKENS_PER_STEP = 1024  # what one inner step stands for in the metrics (tokens per second)


class Vector(nn.Module):
    def __init__(self, numel: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.x = nn.Parameter(torch.randn(numel, generator=g))  # every peer starts from the run's x0


class QuadraticLearner:
    """A ``Learner`` (peer/train/learner.py) for one simulated peer."""

    def __init__(self, spec: RunSpec, numel: int, peer_seed: int, compute: Callable[[], float],
                 pause: Callable[[float], None], spread: float = 0.5, noise: float = 0.5):
        self.spec, self.compute, self.pause = spec, compute, pause
        self.vector = Vector(numel, spec.init_seed)
        self.model: nn.Module = self.vector  # a Learner's model is read and written as any module
        g = torch.Generator().manual_seed(spec.init_seed + 1)
        self.optimum = torch.randn(numel, generator=g) * 0.5  # (numel,) the run's held-out optimum
        mine = torch.Generator().manual_seed(peer_seed)
        self.target = self.optimum + spread * torch.randn(numel, generator=mine)  # this peer's data
        self.noise, self.generator = noise, mine
        self.inner_opt = torch.optim.AdamW(self.model.parameters(), lr=spec.inner_lr,
                                           weight_decay=0.0, betas=(0.9, 0.95))

    def inner_steps(self, first: int, progress: Progress) -> tuple[float, float]:
        x, total = self.vector.x, 0.0
        for i in range(self.spec.sync_every):
            set_inner_lr(self.inner_opt, self.spec, first + i)
            with torch.no_grad():
                diff = x - self.target
                total += 0.5 * float(diff.square().mean())
                x.grad = diff + self.noise * torch.randn(x.shape, generator=self.generator)
            self.inner_opt.step()
            self.inner_opt.zero_grad(set_to_none=True)
        seconds = self.compute()
        self.pause(seconds)
        progress(phase="computing", step=self.spec.sync_every, steps=self.spec.sync_every)
        return total / self.spec.sync_every, self.spec.sync_every * TOKENS_PER_STEP / max(seconds, 1e-9)

    def evaluate(self) -> float | None:
        with torch.no_grad():
            return 0.5 * float((self.vector.x - self.optimum).square().mean())

    def reset(self) -> None:
        self.inner_opt.state.clear()

    def mfu(self, tokens_per_s: float) -> float | None:
        return None
