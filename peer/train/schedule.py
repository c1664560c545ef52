"""The inner learning rate at one of the run's inner steps (the run spec's ``inner_*`` fields).

A step is counted in the run, not in this process: inner step ``i`` of round ``r`` is
``r * sync_every + i``, so a peer that joins at round 40 continues the schedule where the others are.
(With overlapped rounds the inner steps of round r run while round r - 1 is averaged; they are counted
from the round the peer holds, one round early at most.)

    warmup:   lr * (s + 1) / inner_warmup                       for s < inner_warmup
    constant: lr
    cosine:   lr * (m + (1 - m) * (1 + cos(pi * p)) / 2),  p = (s - warmup) / (total - warmup), clamped
              to [0, 1]; m = MIN_RATIO (the floor it decays to at inner_total_steps and stays at after)
"""

from __future__ import annotations

import math

import torch

from hivetrain.peer.config import RunSpec

MIN_RATIO = 0.1  # cosine ends at a tenth of the peak (the usual floor; Chinchilla, nanoGPT)


def inner_lr_at(spec: RunSpec, step: int) -> float:
    """The inner AdamW learning rate at the run's inner step ``step`` (0-based, >= 0)."""
    step = max(0, step)
    if step < spec.inner_warmup:
        return spec.inner_lr * (step + 1) / spec.inner_warmup
    if spec.inner_schedule == "constant":
        return spec.inner_lr
    span = spec.inner_total_steps - spec.inner_warmup  # > 0: the spec refuses a cosine without room to decay
    progress = min(1.0, (step - spec.inner_warmup) / span)
    return spec.inner_lr * (MIN_RATIO + (1.0 - MIN_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_inner_lr(optimizer: torch.optim.Optimizer, spec: RunSpec, step: int) -> None:
    """Sets every parameter group of ``optimizer`` to the rate of the run's inner step ``step``."""
    lr = inner_lr_at(spec, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
