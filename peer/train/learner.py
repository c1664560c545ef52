"""What a peer trains and how: the model, its inner optimizer and data, H inner steps, evaluation.

The round loop (peer/train/loop.py) asks a ``Learner`` for inner steps and a held-out loss and
reads and writes its ``model``'s parameters (the run's flat vector, peer/train/diloco.py); it knows
nothing else about the objective. ``LMLearner`` is a peer's: a language model on a token corpus,
AdamW with the run's schedule, on a CPU or a GPU. The simulator (peer/sim/objective.py) gives the
same loop a quadratic whose inner steps take virtual time.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.train import speed
from hivetrain.peer.train.data import Corpus, ShardSampler, eval_batches, evaluate
from hivetrain.peer.train.model import Llama, build_model
from hivetrain.peer.train.schedule import set_inner_lr

Progress = Callable[..., None]


class Learner(Protocol):
    """The objective of one peer (training thread only)."""

    model: nn.Module  # its parameters, in order, are the run's vector

    def inner_steps(self, first: int, progress: Progress) -> tuple[float, float]:
        """``spec.sync_every`` inner steps from the current parameters; ``first`` is the run's inner
        step of the first one (schedules continue across rounds and peers). Returns (mean training
        loss, which may be NaN or Inf, tokens per second)."""
        ...

    def evaluate(self) -> float | None:
        """The held-out loss at the current parameters (None: no held-out data)."""
        ...

    def reset(self) -> None:
        """Forgets the inner optimizer's state (its moments after a NaN loss are poisoned)."""
        ...

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization at that rate, where the device's peak is known."""
        ...


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Activation checkpointing: activations recomputed block by block in the backward pass (memory
    for compute), on the built-in model or a Hugging Face one (``inner``)."""
    inner = getattr(model, "inner", None)
    if inner is None:
        cast(Llama, model).checkpointing = True
        return
    enable = getattr(inner, "activation_checkpointing_enable", None)  # (transformers >= 5.2; the old name warns)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class LMLearner:
    """A language model (the spec's built-in one, or a Hugging Face ``model``) trained with AdamW on
    this peer's shard of ``corpus``."""

    def __init__(self, spec: RunSpec, peer_id: str, corpus: Corpus, model: nn.Module | None = None,
                 device: str = "cpu", eval_batch_count: int = 8, micro_batch: int = 0, checkpointing: bool = False,
                 compile: bool = False):
        if micro_batch and spec.batch_size % micro_batch:
            raise ConfigError(f"--micro-batch {micro_batch} does not divide the run's batch of {spec.batch_size}")
        self.spec, self.device = spec, torch.device(device)
        self.micro_batch = micro_batch or spec.batch_size  # gradient accumulation in pieces of this many sequences
        model = model if model is not None else build_model(spec.model, spec.init_seed)
        self.model = model.to(self.device)
        if checkpointing:
            checkpoint_blocks(self.model)
        # the module the inner steps call: compiled on request (same parameters; evaluation stays eager)
        self.step_model: Callable[..., Any] = torch.compile(self.model) if compile else self.model
        self.inner_opt = torch.optim.AdamW(  # fused into one kernel per step on a GPU
            self.model.parameters(), lr=spec.inner_lr, weight_decay=spec.inner_weight_decay, betas=(0.9, 0.95),
            fused=self.device.type == "cuda")
        self.peak = speed.peak_bf16(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        seed = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "little")
        self.sampler = ShardSampler(corpus.train, spec.seq_len, spec.batch_size, seed)
        self.eval_set = eval_batches(corpus.heldout, spec.seq_len, spec.batch_size, eval_batch_count)
        self.numel = sum(p.numel() for p in self.model.parameters())

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def inner_steps(self, first: int, progress: Progress) -> tuple[float, float]:
        self.model.train()
        total, t0 = 0.0, time.perf_counter()
        pieces = self.spec.batch_size // self.micro_batch
        for i in range(self.spec.sync_every):
            set_inner_lr(self.inner_opt, self.spec, first + i)
            x, y = self.sampler.next_batch()  # (B, T) each
            for xs, ys in zip(x.split(self.micro_batch), y.split(self.micro_batch), strict=True):
                with self._autocast():
                    _, piece_loss = self.step_model(xs.to(self.device, non_blocking=True),
                                                    ys.to(self.device, non_blocking=True))
                assert piece_loss is not None
                (piece_loss / pieces).backward()  # equal pieces: the gradient of the whole batch's mean loss
                total += float(piece_loss.detach()) / pieces
            if self.spec.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
            self.inner_opt.step()
            self.inner_opt.zero_grad(set_to_none=True)
            progress(phase="computing", step=i + 1, steps=self.spec.sync_every, loss=total / (i + 1))
        seconds = time.perf_counter() - t0  # a measurement of this machine, not protocol time
        tokens = self.spec.sync_every * self.spec.batch_size * self.spec.seq_len
        return total / self.spec.sync_every, tokens / max(seconds, 1e-9)

    def evaluate(self) -> float | None:
        return evaluate(self.model, self.eval_set, self.device) if self.eval_set else None

    def reset(self) -> None:
        self.inner_opt.state.clear()

    def mfu(self, tokens_per_s: float) -> float | None:
        return speed.mfu(self.numel, tokens_per_s, self.peak)
