"""Configuration: one tree of frozen dataclasses, validated on construction.

``RunSpec`` is what the run owner publishes (signed) and every peer of the run must share;
``PeerOptions`` is what one volunteer chooses for their own machine. Both are built only at the
CLI edge and passed down; library code never reads the environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from hivetrain.peer.errors import ConfigError

if TYPE_CHECKING:
    from hivetrain.kernels.int8 import Codec

HF_ARCHS = ("llama", "mistral", "qwen2")  # transformers model types a run may train (Llama family, no remote code)
MAX_HF_CONFIG = 16384  # characters of a run spec's architecture JSON
PRETRAINED = ("smollm2-135m",)  # packaged pretrained starts a run may name (peer/train/hf.py)
RUN_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
COMPRESSIONS = ("int8", "fp32", "sparse")
OVERLAPS = ("none", "delayed", "eager")
SCHEDULES = ("constant", "cosine")
AGGREGATIONS = ("robust", "mean")
SPEC_VERSION = 12  # 12: robust aggregation across groups and within pairs (averaging protocol 12); 11: ready buckets the same every round (a hash of the peer id), the two-tier cross stage (averaging protocol 11); 10: heartbeats in buckets when expected_peers > 64 (peer/state/heartbeats.py); 9: expected_peers (round 0's ready buckets); 8: cross_groups (one state per round across groups), protocol v5 (uplink claims); 7: compression "sparse" (sparse_k), outer_nesterov; 6: inner learning-rate schedule (inner_warmup, inner_schedule, inner_total_steps); 5: Hugging Face models (hf_config, init_hash, tokenizer, pretrained); 4: piece_values (pipelined all-reduce); 3: overlap, eval_every, ready records with an ETA; 2: min_round_s, lineage, protocol v3


def _short(value: object) -> str:
    """A bounded description of a possibly hostile value (never a deep repr)."""
    if isinstance(value, (int, float, bool)) or value is None:
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    return f"a {type(value).__name__}"


def _check_range(owner: str, name: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
        raise ConfigError(f"{owner}.{name} must be a number in [{lo}, {hi}], got {_short(value)}")


def _check_int(owner: str, name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (lo <= value <= hi):
        raise ConfigError(f"{owner}.{name} must be an integer in [{lo}, {hi}], got {_short(value)}")


def knob(default: Any, text: str | None = None, *, lo: float | None = None, hi: float | str | None = None,
         choices: tuple[str, ...] | None = None, shown: str | None = None) -> Any:
    """A run-spec field declared once: its default, its range [lo, hi] (``hi`` may name another field,
    e.g. "target_group_size") or its ``choices``, and, for a field a flag of ``peer start`` sets, the
    flag's help ``text`` (peer/cli.py adds "(default ``shown``)", the default itself unless given)."""
    meta = {"help": text, "lo": lo, "hi": hi, "choices": choices, "shown": shown}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


def flag_knobs() -> list[dataclasses.Field[Any]]:
    """The run-spec fields that flags of ``peer start --new-run`` set, in declaration order."""
    return [f for f in dataclasses.fields(RunSpec) if "help" in f.metadata]


def knob_default(f: dataclasses.Field[Any]) -> str:
    """What a flag's help says its default is."""
    if "shown" in f.metadata:
        return str(f.metadata["shown"])
    return ("on" if f.default else "off") if f.type == "bool" else str(f.default)


def _check_knob(spec: Any, f: dataclasses.Field[Any]) -> None:
    value, meta = getattr(spec, f.name), f.metadata
    if f.type == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"spec.{f.name} must be true or false, got {_short(value)}")
    elif "choices" in meta:
        if not isinstance(value, str) or value not in meta["choices"]:
            raise ConfigError(f"spec.{f.name} must be one of {', '.join(meta['choices'])}, got {_short(value)}")
    else:
        hi = meta["hi"]
        if isinstance(hi, str):
            hi = operator.attrgetter(hi)(spec)
        (_check_int if f.type == "int" else _check_range)("spec", f.name, value, meta["lo"], hi)


@dataclass(frozen=True)
class ModelConfig:
    """A small Llama-style decoder (RMSNorm, RoPE, SwiGLU)."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_int("model", "vocab_size", self.vocab_size, 2, 1 << 20)
        _check_int("model", "d_model", self.d_model, 8, 1 << 15)
        _check_int("model", "n_layers", self.n_layers, 1, 256)
        _check_int("model", "n_heads", self.n_heads, 1, 256)
        _check_int("model", "ffn_hidden", self.ffn_hidden, 8, 1 << 17)
        _check_int("model", "max_seq_len", self.max_seq_len, 8, 1 << 17)
        _check_range("model", "rope_theta", self.rope_theta, 1.0, 1e9)
        _check_range("model", "norm_eps", self.norm_eps, 1e-12, 1e-1)
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "into an even head dimension"
            )


def _float(value: Any) -> Any:
    """A JSON number as a float (ModelConfig checks the rest): one encoding whatever the JSON wrote."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def hf_summary(config_json: str) -> ModelConfig:
    """The sizes of a Hugging Face architecture (canonical JSON, untrusted) as a ModelConfig, which
    bounds them and which the memory plan reads. ConfigError for anything we cannot train."""
    if not isinstance(config_json, str) or len(config_json) > MAX_HF_CONFIG:
        raise ConfigError(f"spec.hf_config must be JSON of at most {MAX_HF_CONFIG} characters")
    try:
        raw = json.loads(config_json)
    except ValueError as e:
        raise ConfigError(f"spec.hf_config is not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("model_type") not in HF_ARCHS:
        got = raw.get("model_type") if isinstance(raw, dict) else None
        raise ConfigError(f"model type {_short(got)} is not supported: a run trains one of {', '.join(HF_ARCHS)}")
    rope: dict[str, Any] = raw["rope_parameters"] if isinstance(raw.get("rope_parameters"), dict) else {}
    try:
        return ModelConfig(
            vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_layers=raw["num_hidden_layers"],
            n_heads=raw["num_attention_heads"], ffn_hidden=raw["intermediate_size"],
            max_seq_len=raw["max_position_embeddings"],
            rope_theta=_float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            norm_eps=_float(raw.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise ConfigError(f"spec.hf_config lacks {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"spec.hf_config is malformed: {e}") from None


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    seq_len: int
    batch_size: int
    inner_lr: float
    sync_every: int
    # the outer step and warmup measured best for the preset (docs/BENCHMARKS.md); else the run spec's
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_warmup: int = 0


# The outer step of a sparse run when its owner names none: its averages arrive late (error feedback
# sends what top-k left out rounds later), and a larger outer lr without momentum measured best
# (tiny preset, 16 rounds; docs/BENCHMARKS.md, "The sparse mode").
SPARSE_OUTER_LR = 2.0
SPARSE_OUTER_MOMENTUM = 0.0


def outer_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (run spec fields) with a sparse run's outer lr and momentum filled in where they are
    absent or None; any other run's are left to the preset or the spec's defaults."""
    if settings.get("compression") != "sparse":
        return settings
    out = dict(settings)
    for name, value in (("outer_lr", SPARSE_OUTER_LR), ("outer_momentum", SPARSE_OUTER_MOMENTUM)):
        if out.get(name) is None:
            out[name] = value
    return out


PRESETS: dict[str, Preset] = {
    # ~0.8M parameters: trains visibly on 2 CPU cores in about a minute.
    # outer momentum 0.5: 0.9 cost 0.068 +- 0.015 held-out loss over 16 rounds (3 seeds) and 0.026 over 100
    # rounds (docs/BENCHMARKS.md, "A tuned baseline, the outer step and a longer horizon")
    "tiny": Preset(ModelConfig(256, 128, 4, 4, 352, 128), seq_len=128, batch_size=16, inner_lr=2e-3, sync_every=20,
                   outer_momentum=0.5),
    # ~3.3M parameters: a CPU benchmark size.
    "small": Preset(ModelConfig(256, 256, 4, 8, 704, 256), seq_len=256, batch_size=16, inner_lr=1e-3, sync_every=50),
    # ~26M parameters: for a GPU.
    "medium": Preset(ModelConfig(256, 512, 8, 8, 1408, 512), seq_len=512, batch_size=32, inner_lr=6e-4, sync_every=100),
    # ~150M parameters: for a real GPU.
    "large": Preset(ModelConfig(256, 1024, 12, 16, 2816, 1024), seq_len=1024, batch_size=32, inner_lr=3e-4,
                    sync_every=100),
}


PRESET_NAMES = (*PRESETS, *PRETRAINED)  # what --preset takes: the built-in models, then the pretrained starts


@dataclass(frozen=True)
class RunSpec:
    """Everything every peer of a run must agree on. Published by the owner, signed."""

    name: str
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: str = "sotu"  # "sotu" or "files:<sha256 of the corpus>"
    # the knobs (``knob``): each declared once, with its range and, if a flag sets it, its help; peer/cli.py
    # makes the flags from these, and __post_init__ checks the ranges
    seq_len: int = knob(128, "tokens per sequence", lo=8, hi="model.max_seq_len", shown="the preset's")
    batch_size: int = knob(16, "sequences per inner step and peer", lo=1, hi=4096, shown="the preset's")
    inner_lr: float = knob(2e-3, "AdamW learning rate of the inner steps", lo=1e-7, hi=1.0, shown="the preset's")
    # the inner learning rate at the run's inner step s (round * sync_every + i; peer/train/schedule.py):
    # linear warmup over ``inner_warmup`` steps, then constant or cosine down to a tenth of ``inner_lr``
    # at ``inner_total_steps`` (cosine needs it: an open-ended run has no end to decay to)
    inner_warmup: int = knob(0, "inner steps of linear learning-rate warmup, counted in the run", lo=0, hi=10**9,
                             shown="the preset's; 0: none")
    inner_schedule: str = knob("constant", "inner learning rate after warmup: constant, or cosine down to a tenth "
                               "at --inner-total-steps", choices=SCHEDULES)
    inner_total_steps: int = knob(0, "the run's inner step where a cosine schedule ends: rounds x H", lo=0, hi=10**12,
                                  shown="0: none")
    inner_weight_decay: float = knob(0.1, lo=0.0, hi=1.0)
    grad_clip: float = knob(1.0, lo=0.0, hi=1e6)
    sync_every: int = knob(20, "H: inner steps per round", lo=1, hi=100_000, shown="the preset's")
    outer_lr: float = knob(0.7, "learning rate of the outer Nesterov step", lo=0.0, hi=10.0,
                           shown="0.7; 2.0 with --compression sparse")
    outer_momentum: float = knob(0.9, "momentum of the outer Nesterov step", lo=0.0, hi=0.999,
                                 shown="the preset's, 0.5 for tiny, else 0.9; 0 with --compression sparse")
    outer_nesterov: bool = knob(True, "Nesterov momentum in the outer step (DiLoCo's; --no-outer-nesterov: heavy-ball)")
    compression: str = knob("int8", "how pseudo-gradients travel: int8 (4x fewer bytes than fp32), fp32, or sparse "
                            "(the largest --sparse-k of every 4096 values as int8, the rest carried to later rounds)",
                            choices=COMPRESSIONS)
    chunk_size: int = knob(65536, lo=256, hi=1 << 24)  # int8's values per scale and offset
    sparse_k: int = knob(64, "with --compression sparse: values sent of every 4096 (kernels/sparse.py)", lo=1, hi=1024,
                         shown="64: 1.6 %, a part of 196 bytes per 4096 values against int8's 4,104")
    target_group_size: int = knob(8, "peers per averaging group at most; a group forms sooner once this many are "
                                  "ready", lo=1, hi=64)
    min_group_size: int = knob(1, "a smaller group voids its round", lo=1, hi="target_group_size",
                               shown="1: a peer alone still trains")
    # (the grace a straggler gets; a peer nobody waits for closes its window at once)
    matchmaking_timeout: float = knob(5.0, "seconds a ready peer waits at most for announced peers still computing",
                                      lo=0.5, hi=600.0)
    allreduce_timeout: float = knob(60.0, "seconds: the deadline of one all-reduce; past it the round is void",
                                    lo=1.0, hi=3600.0)
    # each member's shard is cut into pieces of about this size that are sent, reduced, audited and returned
    # one after another, so the reduce hides behind the transfer
    piece_values: int = knob(1 << 21, "values per piece of the pipelined all-reduce", lo=1024, hi=1 << 30)
    init_seed: int = knob(0, lo=0, hi=2**31 - 1)
    aggregation: str = knob("robust", "how reducers combine contributions: robust (norm clip and CenteredClip, for "
                            "public runs) or mean", choices=AGGREGATIONS)
    error_feedback: bool = knob(False, "carry each round's int8 quantization residual into the next round (sparse: "
                                "always)")
    max_per_prefix: int = knob(2, "Sybil brake: at most N members per IPv4 /24 or IPv6 /48 in a group", lo=0, hi=64,
                               shown="2; 0: off")
    audit: bool = knob(True, "have a second member recompute every shard; a wrong aggregate is void (off saves a "
                       "third of the bytes)")
    # groups' results are averaged across groups sub-piece by sub-piece, by designees derived from the ready
    # board (peer/averaging/cross.py)
    cross_groups: bool = knob(True, "average the groups' results across groups, so every peer of a round ends on one "
                              "state (off: each group applies its own and fork choice keeps the heaviest)")
    # round 0's ready records are spread over buckets for that many (peer/averaging/ready.py); later rounds
    # follow their base state's population
    expected_peers: int = knob(0, "peers you expect in the run's first round: above 8x the target group size, their "
                               "ready records are spread over several DHT keys from round 0 on", lo=0, hi=1 << 20,
                               shown="0: a few; later rounds size this by themselves")
    # no round is faster; bounds the round a heartbeat may claim (fork choice)
    min_round_s: float = knob(0.2, lo=0.01, hi=3600.0)
    overlap: str = knob("none", "delayed / eager: each round's all-reduce runs during the next round's inner steps "
                        "and is applied one round late; eager starts them from our own outer step "
                        "(peer/train/loop.py)", choices=OVERLAPS, shown="none: synchronous")
    eval_every: int = knob(10, "rounds between held-out evaluations (also the first, the last and after a sync)",
                           lo=1, hi=1_000_000)
    # a Hugging Face model (peer/train/hf.py): its architecture (canonical JSON; ``model`` is then its
    # sizes), the hash of the round-0 state (its initial weights), its tokenizer's hash, and the packaged
    # pretrained start it came from ("" for a model folder); all empty for the built-in model
    hf_config: str = ""
    init_hash: str = ""
    tokenizer: str = "bytes"  # "bytes" (token = UTF-8 byte) or "sha256:<hex>" of the tokenizer's JSON
    pretrained: str = ""
    version: int = SPEC_VERSION

    def codec(self) -> Codec:
        """The wire codec of the members' parts (kernels/int8.py; reducers encode with ``for_results``)."""
        from hivetrain.kernels.int8 import get_codec

        if self.compression == "sparse":  # its own chunk of 4096; chunk_size is int8's
            return get_codec("sparse", k=self.sparse_k)
        return get_codec(self.compression, self.chunk_size)

    @property
    def carries_residual(self) -> bool:
        """Whether peers keep error feedback (kernels/error_feedback.py): sparse always (what top-k
        leaves out is sent in later rounds), int8 when ``error_feedback`` asks for it."""
        return self.compression == "sparse" or (self.error_feedback and self.compression == "int8")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not RUN_NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"run name {_short(self.name)} is invalid: use 1-48 characters of a-z, 0-9, '-' and '_', "
                "starting with a letter or digit"
            )
        if not isinstance(self.model, ModelConfig):
            raise ConfigError("spec.model must be a ModelConfig")
        if not (self.dataset == "sotu" or (isinstance(self.dataset, str) and re.fullmatch(r"files:[0-9a-f]{64}", self.dataset))):
            raise ConfigError(f"spec.dataset must be 'sotu' or 'files:<sha256>', got {_short(self.dataset)}")
        for f in dataclasses.fields(self):
            if f.metadata:
                _check_knob(self, f)
        if self.inner_schedule == "cosine" and self.inner_total_steps <= self.inner_warmup:
            raise ConfigError(f"spec.inner_schedule 'cosine' needs inner_total_steps above inner_warmup "
                              f"({self.inner_warmup}), got {self.inner_total_steps}: the step it decays to")
        if self.hf_config:
            if self.model != hf_summary(self.hf_config):
                raise ConfigError("spec.model does not match the sizes of spec.hf_config")
            if not (isinstance(self.init_hash, str) and re.fullmatch(r"[0-9a-f]{64}", self.init_hash)):
                raise ConfigError(f"spec.init_hash must be 64 hex characters, got {_short(self.init_hash)}")
            if not (isinstance(self.tokenizer, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", self.tokenizer)):
                raise ConfigError(f"spec.tokenizer must be 'sha256:<hex>' for a Hugging Face model, got {_short(self.tokenizer)}")
            if self.pretrained not in ("", *PRETRAINED):
                raise ConfigError(f"spec.pretrained must be one of {PRETRAINED} or empty, got {_short(self.pretrained)}")
        elif (self.init_hash, self.tokenizer, self.pretrained) != ("", "bytes", ""):
            raise ConfigError("spec.init_hash, tokenizer and pretrained belong to a Hugging Face model (hf_config)")
        if self.version != SPEC_VERSION:
            raise ConfigError(f"run spec version {self.version} is not supported (this client speaks {SPEC_VERSION})")

    @classmethod
    def from_preset(cls, name: str, preset: str, **overrides: Any) -> RunSpec:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")
        p = PRESETS[preset]
        base: dict[str, Any] = dict(
            name=name, model=p.model, seq_len=p.seq_len, batch_size=p.batch_size,
            inner_lr=p.inner_lr, sync_every=p.sync_every, outer_lr=p.outer_lr, outer_momentum=p.outer_momentum,
            inner_warmup=p.inner_warmup,
        )
        base.update(outer_defaults({k: v for k, v in overrides.items() if v is not None}))
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> RunSpec:
        """Builds a spec from untrusted decoded data; raises ConfigError on any deviation."""
        if not isinstance(raw, dict):
            raise ConfigError("run spec must be a map")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(raw) - names:
            raise ConfigError(f"run spec has unknown fields: {sorted(set(raw) - names)}")
        model_raw = raw.get("model")
        if not isinstance(model_raw, dict):
            raise ConfigError("run spec field 'model' must be a map")
        model_names = {f.name for f in dataclasses.fields(ModelConfig)}
        if set(model_raw) != model_names:
            raise ConfigError(f"run spec model fields must be exactly {sorted(model_names)}")
        try:
            return cls(**{**raw, "model": ModelConfig(**model_raw)})
        except TypeError as e:
            raise ConfigError(f"run spec is malformed: {e}") from None

    def encode(self) -> bytes:
        """Canonical bytes (msgpack, fixed field order) that are signed and hashed."""
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    def spec_hash(self) -> bytes:
        return hashlib.sha256(self.encode()).digest()


@dataclass(frozen=True)
class PeerOptions:
    """What one volunteer chooses for their own peer; never shared with the run."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    state_dir: str = ""
    identity_path: str | None = None  # default: <state_dir>/identity.key
    ephemeral: bool = False  # a fresh identity and port for this session: nothing about it is kept
    data_path: str | None = None
    model_path: str | None = None  # a Hugging Face model folder: a new run's model, or a joined run's tokenizer
    device: str = "cpu"  # or "cuda[:N]", or "auto": CUDA when present, else the CPU (the command line's default)
    threads: int = 0  # 0: leave torch's default
    metrics_file: str | None = None
    max_rounds: int = 0  # rounds this process trains (from where it starts); 0: until stopped
    until_round: int = 0  # the run's round to stop at; 0: none
    eval_batches: int = 8
    dht_timeout: float = 15.0  # seconds for one DHT call / bootstrap
    fault: str | None = None  # test hook: "ACTION@POINT:ROUND", see peer/faults.py
    fault_log: str | None = None  # test hook: where a fault logs that it fired
    wait_for_peers: int = 1  # peers (this one included) to wait for before the first round
    micro_batch: int = 0  # 0: the run's whole batch at once; else gradient accumulation in pieces of this size
    memory_limit_gib: float = 0.0  # 0: the device's memory; else plan within this many GiB
    checkpointing: bool = False  # activation checkpointing: recompute each block in the backward pass
    compile: bool = False  # torch.compile the inner steps' model
    dashboard: str | None = None  # HOST:PORT of the dashboard (peer/dashboard.py); None: no dashboard
    dashboard_public: bool = False  # a non-loopback dashboard address is allowed (public run data only)
    dashboard_private: bool = False  # ... or allowed with our own data, to requests naming a loopback host

    def __post_init__(self) -> None:
        _check_int("peer", "threads", self.threads, 0, 1024)
        _check_int("peer", "max_rounds", self.max_rounds, 0, 10_000_000)
        _check_int("peer", "until_round", self.until_round, 0, 10_000_000)
        _check_int("peer", "eval_batches", self.eval_batches, 0, 10_000)
        _check_range("peer", "dht_timeout", self.dht_timeout, 0.1, 600.0)
        _check_int("peer", "wait_for_peers", self.wait_for_peers, 1, 64)
        _check_int("peer", "micro_batch", self.micro_batch, 0, 4096)
        _check_range("peer", "memory_limit_gib", self.memory_limit_gib, 0.0, 1e6)
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError(f"--device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
