"""The DiLoCo math, as pure functions on tensors: no sockets, no clock, no hivemind.

Round r of one peer::

    theta_local = H inner AdamW steps from theta_r         (on the device)
    delta       = theta_r - theta_local                    (pseudo-gradient, fp32, on the CPU master)
    avg         = all-reduce(delta) over the group         (or the round is void)
    theta_r+1   = NesterovSGD(theta_r, avg)                (outer step on the CPU master)

Parameters travel as one flat fp32 vector in ``model.parameters()`` order. Every state carries its
lineage (peer/state/snapshot.py): the hash of the state it came from (``parent``) and the digest of
what was applied to it (``link``), and its hash commits to both.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hivetrain.peer.state.snapshot import VOID_LINK, ZERO, Snapshot, is_hex64


def flat_numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


@torch.no_grad()
def copy_params_to_flat(params: Iterable[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Writes the parameters, in order, into ``out`` (n,) fp32 on the CPU; returns it. From a GPU the
    copies are queued without waiting (asynchronous into pinned memory, see ``pinned``) and waited
    for once, at the end."""
    offset, device = 0, False
    for p in params:
        n = p.numel()
        out[offset : offset + n].copy_(p.detach().reshape(-1), non_blocking=p.is_cuda)
        device |= p.is_cuda
        offset += n
    assert offset == out.numel(), "flat buffer does not match the parameters"
    if device:
        torch.cuda.synchronize()
    return out


@torch.no_grad()
def copy_flat_to_params(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
    """Writes ``flat`` (n,) back into the parameters (on whatever device they live); to a GPU the
    copies are queued and waited for once, so ``flat`` may change as soon as this returns."""
    offset, device = 0, False
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p), non_blocking=p.is_cuda)
        device |= p.is_cuda
        offset += n
    assert offset == flat.numel(), "flat buffer does not match the parameters"
    if device:
        torch.cuda.synchronize()


def pinned(n: int, on_gpu: bool) -> torch.Tensor:
    """An (n,) fp32 CPU buffer, page-locked when the model is on a GPU (asynchronous copies)."""
    buf = torch.empty(n, dtype=torch.float32)
    return buf.pin_memory() if on_gpu else buf


@torch.no_grad()
def pseudo_gradient(master: torch.Tensor, local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """delta = theta_r - theta_local, (n,) fp32. Positive delta means "the inner steps moved down"."""
    return torch.sub(master, local, out=out)


@torch.no_grad()
def nesterov_outer_step(
    master: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float, nesterov: bool = True
) -> None:
    """One outer Nesterov SGD step on the master copy, in place, with the averaged pseudo-gradient.

    Same update as ``torch.optim.SGD(nesterov=True, momentum=mu, lr=lr)`` with ``grad = delta``
    (dampening 0, no weight decay), written out so every peer runs exactly the same elementwise ops:
        m  <- mu * m + delta
        theta <- theta - lr * (delta + mu * m)
    ``nesterov=False``: heavy-ball momentum (``SGD(momentum=mu)``), theta <- theta - lr * m.
    """
    # Separate multiply and add kernels, never a fused multiply-add: torch's AVX2/AVX-512 paths fuse
    # ``add(alpha=...)`` and the plain path does not, and peers on different CPUs must agree bitwise.
    momentum.mul_(mu).add_(delta)
    update = momentum.mul(mu).add_(delta) if nesterov else momentum.clone()  # delta + mu * m, or m
    master.sub_(update.mul_(lr))


def state_hash(round_: int, master: torch.Tensor, momentum: torch.Tensor, parent: str = ZERO,
               link: str = ZERO, population: int = 0) -> str:
    """The hash that members attest: commits to the round, the exact bytes of the outer state and
    its lineage (``parent``, ``link``: 64 hex characters each) and population."""
    return Snapshot.of(round_, master.detach().to("cpu", torch.float32).contiguous(),
                       momentum.detach().to("cpu", torch.float32).contiguous(), parent=parent, link=link,
                       population=population).hash


@torch.no_grad()
def applied_digest(averaged: torch.Tensor, keep: Sequence[tuple[int, int]] = ()) -> str:
    """SHA-256 (hex) of an outer step's input: the averaged delta's fp32 bytes and the kept ranges.

    The link ``OuterState.apply`` uses when the averager hands none. Every member that applies the
    same bytes with the same ``keep`` computes the same digest."""
    h = hashlib.sha256(b"hivetrain-applied-v1\0")
    h.update(averaged.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    for start, end in keep:
        h.update(struct.pack("<QQ", start, end))
    return h.hexdigest()


class OuterState:
    """The outer (shared) state of a peer: the fp32 master copy, the outer momentum and the round.

    Every member of a group must hold bit-identical ``OuterState`` after a completed round.
    Owned and mutated only by the training thread.
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float, nesterov: bool = True):
        params = list(model.parameters())
        n = flat_numel(params)
        gpu = any(p.is_cuda for p in params)
        self.lr, self.mu, self.nesterov = lr, momentum, nesterov
        self.round = 0
        self.master = copy_params_to_flat(params, pinned(n, gpu))  # (n,) fp32, CPU
        self.momentum = torch.zeros(n, dtype=torch.float32)  # (n,) fp32, CPU
        self._local = pinned(n, gpu)  # (n,) scratch for theta_local
        self._delta = torch.empty(n, dtype=torch.float32)  # (n,) scratch for the pseudo-gradient
        self.parent = ZERO  # lineage of the current state: the state it came from ...
        self.link = ZERO  # ... and what was applied to it (the initial state has neither)
        self.population = 0  # how many peers' parts made it (peer/state/snapshot.py; 0: not known)
        self._snapshot: Snapshot | None = None

    @property
    def numel(self) -> int:
        return self.master.numel()

    def snapshot(self) -> Snapshot:
        """The state at the current round boundary (cached until the state changes)."""
        if self._snapshot is None or self._snapshot.round != self.round:
            self._snapshot = Snapshot.of(self.round, self.master, self.momentum, parent=self.parent, link=self.link,
                                         population=self.population)
        return self._snapshot

    def hash(self) -> str:
        return self.snapshot().hash

    def load(self, snapshot: Snapshot, model: nn.Module) -> None:
        """Adopts a verified state (from peers or a checkpoint): master, momentum, round, lineage, params."""
        if snapshot.numel != self.numel:
            raise ValueError(f"state has {snapshot.numel} values, this model {self.numel}")
        master, momentum = snapshot.tensors()
        self.master.copy_(master)
        self.momentum.copy_(momentum)
        self.round = snapshot.round
        self.parent, self.link, self.population = snapshot.parent, snapshot.link, snapshot.population
        self._snapshot = snapshot
        copy_flat_to_params(self.master, model.parameters())

    def pseudo_gradient(self, model: nn.Module, out: torch.Tensor | None = None,
                        start: torch.Tensor | None = None) -> torch.Tensor:
        """Returns delta = start - params (``start``: the parameters the inner steps started from,
        the master by default), in ``out`` or else in an internal buffer (valid until the next call)."""
        copy_params_to_flat(model.parameters(), self._local)
        return pseudo_gradient(self.master if start is None else start, self._local,
                               out=self._delta if out is None else out)

    @torch.no_grad()
    def lookahead(self, delta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The outer step the master would take with ``delta``, into ``out``; the state is unchanged.
        Eager overlap starts the next inner steps here, our own delta standing in for the group's
        average still in flight."""
        momentum = self.momentum.clone()
        out.copy_(self.master)
        nesterov_outer_step(out, momentum, delta, self.lr, self.mu, self.nesterov)
        return out

    def apply(self, averaged: torch.Tensor, model: nn.Module, keep: Sequence[tuple[int, int]] = (),
              link: str | None = None, population: int = 0) -> None:
        """Completes the round: outer step with the group's averaged delta, then params <- master.

        ``keep``: [start, end) ranges the round voided (shards that failed their audit): their master
        values and momentum stay as they were. ``link``: the digest of what was applied, identical on
        every member of the group (the averager's ``AverageResult.applied``, 64 lowercase hex
        characters); None: ``applied_digest(averaged, keep)``. The new state's parent is the current
        state. ``population``: how many peers' parts the averaged delta came from, when the whole run
        agrees on it (the cross-group stage's means); 0 otherwise. Raises ValueError for a malformed
        ``link``."""
        link = applied_digest(averaged, keep) if link is None else link
        if not is_hex64(link):
            raise ValueError("link must be 64 lowercase hex characters")
        parent = self.hash()
        kept = [(s, e, self.master[s:e].clone(), self.momentum[s:e].clone()) for s, e in keep]
        nesterov_outer_step(self.master, self.momentum, averaged, self.lr, self.mu, self.nesterov)
        for s, e, master, momentum in kept:
            self.master[s:e] = master
            self.momentum[s:e] = momentum
        self.round += 1
        self.parent, self.link, self.population = parent, link, population
        self._snapshot = None
        copy_flat_to_params(self.master, model.parameters())

    def void(self, model: nn.Module) -> None:
        """Voids the round: nothing is applied, params are restored to the master, the round advances.

        The new state's link is ``VOID_LINK``: every peer that voids the same state lands on the
        same hash (the population stays the parent's)."""
        self.parent, self.link = self.hash(), VOID_LINK
        self.round += 1
        self._snapshot = None
        copy_flat_to_params(self.master, model.parameters())
