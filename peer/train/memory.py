"""The memory plan a peer states at start, chosen to fit its device, and the refusal when nothing fits.

On the training device: parameters, gradients and AdamW's two moments (fp32, 4 bytes each), and the
activations kept for the backward pass of one micro-batch. On the CPU, always: the outer state
(master parameters and outer momentum, fp32), two scratch vectors of the same size (the parameters
the pseudo-gradient is computed against, and the pseudo-gradient), and the snapshots served to
joiners (the last two rounds' master and momentum). On a CPU run both share one memory and are
checked together. Activations are estimated per layer as in Korthikanti et al.
2022 (``34 * B * T * C`` bytes at 16 bits, doubled for fp32), on the CPU plus ``5 * B * heads *
T^2`` 16-bit values for attention (none on CUDA, whose fused attention keeps a log-sum-exp per
query), plus the logits (``B * T * vocab``, fp32, twice: logits and their gradient). Measured on
the CPU, one AdamW step of the small preset (batch 16 x 256) grew the process by 553 MiB against
651 MiB planned, of the medium one (batch 8 x 512) by 1704 MiB against 2772 MiB planned: on the
safe side. A 2-peer SmolLM2-135M run at batch 4 x 128 planned 7.5 GiB per peer (3.5 for the
model, 4.0 for the outer state and snapshots) and each process peaked at 7.9-8.2 GiB resident,
the libraries and the corpus included. An estimate, not a guarantee: the refusal also keeps a margin (MARGIN of the device's
memory) for the allocator, the kernels and the framework.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from hivetrain.peer.config import ModelConfig
from hivetrain.peer.errors import ConfigError

MARGIN = 0.85  # share of the device's memory a plan may use
GIB = 1024**3
MIN_GPU_TOKENS = 2048  # tokens in a micro-batch below which a GPU is underused (prefer checkpointing; see choose)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    parameters: int  # bytes, each of the following
    gradients: int
    optimizer: int
    activations: int
    micro_batch: int
    batch: int
    seq_len: int
    host: int  # bytes on the CPU besides the model: outer state, scratch, served snapshots
    checkpointing: bool = False
    why: str = ""  # what ``choose`` chose for the user and why ("": the whole batch, or the user's flags)

    @property
    def on_device(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def needed(self) -> int:
        """What must fit the budget: on the CPU the outer state shares the memory with the model."""
        return self.on_device + (0 if self.device.startswith("cuda") else self.host)

    def describe(self, budget: int) -> str:
        """One line: what is planned where, against ``budget`` bytes, and what was chosen and why."""
        accumulate = f" ({self.batch // self.micro_batch} micro-batches of {self.micro_batch})" \
            if self.micro_batch < self.batch else ""
        how = accumulate + (" (activation checkpointing)" if self.checkpointing else "")
        return (f"memory plan on {self.device}: parameters {_gib(self.parameters)}, gradients {_gib(self.gradients)}, "
                f"AdamW {_gib(self.optimizer)}, activations ~{_gib(self.activations)} at batch {self.batch} x "
                f"{self.seq_len} tokens{how}, "
                f"outer state and served snapshots {_gib(self.host)} on the CPU: {_gib(self.needed)} of "
                f"{_gib(budget)}" + ("" if self.device.startswith("cuda") else " (one memory)")
                + (f"; {self.why}" if self.why else ""))


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 1024**2:.1f} MiB"


def parameter_count(model: ModelConfig) -> int:
    c, layers = model.d_model, model.n_layers
    per_layer = 4 * c * c + 3 * c * model.ffn_hidden + 2 * c  # attention (q, k, v, o), SwiGLU, two norms
    return 2 * model.vocab_size * c + layers * per_layer + c  # embeddings, head (untied), final norm


def activation_bytes(model: ModelConfig, micro_batch: int, seq_len: int, device: str = "cpu",
                     checkpointing: bool = False) -> int:
    """With activation checkpointing only each block's input is kept (fp32), and one block's
    activations at a time are recomputed in the backward pass."""
    b, t, c = micro_batch, seq_len, model.d_model
    per_layer = 34 * b * t * c * 2  # fp32: twice the 16-bit estimate
    if not device.startswith("cuda"):
        per_layer += 5 * b * model.n_heads * t * t * 2
    logits = 2 * 4 * b * t * model.vocab_size
    if checkpointing:
        return model.n_layers * 4 * b * t * c + per_layer + logits
    return model.n_layers * per_layer + logits


def plan(model: ModelConfig, batch: int, seq_len: int, device: str, micro_batch: int = 0,
         checkpointing: bool = False) -> MemoryPlan:
    micro = micro_batch or batch
    n = parameter_count(model)
    # master, outer momentum, two scratch vectors (theta_local, delta), and the snapshots served to
    # joiners (the last two rounds, master and momentum each); all fp32 on the CPU whatever the device
    host = 4 * 4 * n + 2 * 2 * 4 * n
    return MemoryPlan(device, 4 * n, 4 * n, 8 * n, activation_bytes(model, micro, seq_len, device, checkpointing),
                      micro, batch, seq_len, host, checkpointing)


def device_budget(device: str, limit_gib: float = 0.0) -> int:
    """Bytes of memory on ``device`` (its total for CUDA, what is available for the CPU), or the
    user's ``--memory-limit`` if smaller."""
    if device.startswith("cuda"):
        import torch

        total = int(torch.cuda.mem_get_info(torch.device(device))[1])
    else:
        total = _available_ram()
    if limit_gib > 0:
        total = min(total, int(limit_gib * GIB))
    return total


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def choose(model: ModelConfig, batch: int, seq_len: int, device: str, budget: int, micro_batch: int = 0,
           checkpointing: bool = False) -> MemoryPlan:
    """The plan to train with within ``budget`` bytes (pure: ``device`` is only a name). With the user's
    ``micro_batch`` or ``checkpointing``, that plan (ConfigError, with what would fit, if it does not);
    else the first that fits, in the order of the module's docstring, its ``why`` saying what was chosen.
    Raises ConfigError, in one line, when nothing fits."""
    if micro_batch or checkpointing:
        p = plan(model, batch, seq_len, device, micro_batch, checkpointing)
        flags = " ".join(([f"--micro-batch {micro_batch}"] if micro_batch else [])
                         + (["--activation-checkpointing"] if checkpointing else []))
        check(p, budget, model, flags)
        return p
    whole, allowed = plan(model, batch, seq_len, device), int(MARGIN * budget)
    if whole.needed <= allowed:
        return whole
    plain = _largest(model, batch, seq_len, device, allowed, False)
    ckpt = _largest(model, batch, seq_len, device, allowed, True)
    floor = min(batch, math.ceil(MIN_GPU_TOKENS / seq_len)) if device.startswith("cuda") else 1
    if plain is not None and (plain.micro_batch >= floor or ckpt is None or ckpt.micro_batch <= plain.micro_batch):
        chosen = plain
    elif ckpt is not None:
        chosen = ckpt
    else:
        raise ConfigError(_nothing_fits(plan(model, batch, seq_len, device, 1, True), allowed))
    small = (f"without it only micro-batches of {plain.micro_batch} fit ({plain.micro_batch * seq_len} tokens: too "
             "few to keep a GPU busy); " if chosen is ckpt and plain is not None else "")
    return replace(chosen, why=f"chose {_what(chosen)}: the run's batch of {batch} at once needs "
                               f"{_gib(whole.needed)}, over the {_gib(allowed)} ({MARGIN:.0%}) a plan may use; "
                               f"{small}--micro-batch and --activation-checkpointing choose otherwise")


def _largest(model: ModelConfig, batch: int, seq_len: int, device: str, allowed: int,
             checkpointing: bool) -> MemoryPlan | None:
    """The plan with the largest micro-batch (a divisor of ``batch``) that fits ``allowed`` bytes, or None."""
    for m in range(batch, 0, -1):
        if batch % m == 0 and (p := plan(model, batch, seq_len, device, m, checkpointing)).needed <= allowed:
            return p
    return None


def _what(p: MemoryPlan) -> str:
    pieces = f"{p.batch // p.micro_batch} micro-batches of {p.micro_batch} (the same mean gradient)" \
        if p.micro_batch < p.batch else ""
    if not p.checkpointing:
        return pieces
    return "activation checkpointing (about a third more compute)" + (f" and {pieces}" if pieces else "")


def _nothing_fits(least: MemoryPlan, allowed: int) -> str:
    """The refusal when not even checkpointing with micro-batches of one fits (``least`` is that plan)."""
    fixed = least.needed - least.activations
    alone = "parameters, gradients, AdamW" + ("" if least.needed == least.on_device else ", outer state and snapshots")
    return (f"this model will not fit {least.device}: even with activation checkpointing and micro-batches of 1 it "
            f"needs about {_gib(least.needed)} ({alone}: {_gib(fixed)}) and {MARGIN:.0%} of the device is "
            f"{_gib(allowed)}; use a device with more memory or join a run of a smaller model")


def check(p: MemoryPlan, budget: int, model: ModelConfig, flags: str = "") -> None:
    """Raises ConfigError, in one line with what would fit, if ``p`` does not fit ``budget``; ``flags``:
    the user's own choice that made ``p`` (named in the message)."""
    allowed = int(MARGIN * budget)
    if p.needed <= allowed:
        return
    fixed = p.parameters + p.gradients + p.optimizer + (p.needed - p.on_device)  # (+ the outer state on a CPU)

    def need(m: int, ckpt: bool) -> int:
        return fixed + activation_bytes(model, m, p.seq_len, p.device, ckpt)

    fits = [m for m in range(p.micro_batch - 1, 0, -1) if p.batch % m == 0 and need(m, p.checkpointing) <= allowed]
    with_ckpt = [m for m in range(p.micro_batch, 0, -1) if p.batch % m == 0 and need(m, True) <= allowed] \
        if not p.checkpointing else []
    ckpt_advice = ""
    if with_ckpt:
        offer = "--activation-checkpointing" + (f" --micro-batch {with_ckpt[0]}" if with_ckpt[0] < p.batch else "")
        ckpt_advice = f"pass {offer} (recomputes activations in the backward pass: about {_gib(need(with_ckpt[0], True))})"
    if fixed > allowed:
        alone = "the parameters, gradients and AdamW" + ("" if p.needed == p.on_device else ", outer state and snapshots")
        advice = (f"{alone} alone need {_gib(fixed)}: use a device with more memory, "
                  "or join a run of a smaller model")
    elif fits:
        advice = (f"pass --micro-batch {fits[0]} (gradient accumulation to the run's batch of {p.batch}: "
                  f"about {_gib(need(fits[0], p.checkpointing))})" + (f", or {ckpt_advice[5:]}" if ckpt_advice else ""))
    elif ckpt_advice:
        advice = ckpt_advice
    else:
        advice = "not even a micro-batch of 1 fits: use a device with more memory"
    if flags and fixed <= allowed and advice.startswith("pass"):
        advice += f"; or drop {flags} and the plan chooses"
    given = f" with {flags}" if flags else ""
    raise ConfigError(f"this model will not fit {p.device}{given}: it needs about {_gib(p.needed)} (parameters, "
                      f"gradients, AdamW, activations at micro-batch {p.micro_batch}"
                      f"{'' if p.needed == p.on_device else ', outer state'}) and {int(MARGIN * 100)}% of "
                      f"the device is {_gib(allowed)}; {advice}")
