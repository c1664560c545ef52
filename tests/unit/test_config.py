"""Configuration (peer/config.py): presets, validation naming the field, spec encoding; fault plans
(peer/faults.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from hivetrain.peer.config import PRESETS, ModelConfig, PeerOptions, RunSpec, outer_defaults
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.faults import ACTIONS, POINTS, FaultPlan
from hivetrain.peer.train.model import build_model, count_parameters

SMALL_MODEL = ModelConfig(256, 32, 1, 2, 64, 32)


def _spec_dict(**over: Any) -> dict[str, Any]:
    raw = RunSpec.from_preset("r1", "tiny").to_dict()
    raw.update(over)
    return raw


def _model_dict(**over: Any) -> dict[str, Any]:
    raw = dataclasses.asdict(SMALL_MODEL)
    raw.update(over)
    return raw


# ---- presets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_a_spec(preset: str) -> None:
    spec = RunSpec.from_preset("run-1", preset)
    p = PRESETS[preset]
    assert spec.model == p.model and spec.seq_len == p.seq_len and spec.sync_every == p.sync_every
    assert RunSpec.from_dict(msgpack.unpackb(spec.encode(), raw=False)) == spec


def test_tiny_preset_builds_a_model() -> None:
    model = build_model(PRESETS["tiny"].model, seed=0)
    assert 500_000 < count_parameters(model) < 1_500_000


def test_from_preset_overrides_and_unknown_preset() -> None:
    spec = RunSpec.from_preset("r1", "tiny", sync_every=5, compression="fp32", outer_lr=None)
    assert spec.sync_every == 5 and spec.compression == "fp32" and spec.outer_lr == 0.7
    sparse = RunSpec.from_preset("r1", "tiny", compression="sparse", outer_lr=None)  # its own outer step
    assert (sparse.outer_lr, sparse.outer_momentum) == (2.0, 0.0)
    assert RunSpec.from_preset("r1", "tiny", compression="sparse", outer_momentum=0.5).outer_momentum == 0.5
    # outer_defaults is also what a Hugging Face run's owner gets (peer/app.py)
    assert outer_defaults({"compression": "sparse", "outer_lr": None, "sync_every": 5}) == {
        "compression": "sparse", "outer_lr": 2.0, "outer_momentum": 0.0, "sync_every": 5}
    assert outer_defaults({"compression": "int8"}) == {"compression": "int8"}
    with pytest.raises(ConfigError, match="huge"):
        RunSpec.from_preset("r1", "huge")
    with pytest.raises(ConfigError, match="sync_every"):
        RunSpec.from_preset("r1", "tiny", sync_every=0)


# ---- validation names the field -------------------------------------------------------------------


@pytest.mark.parametrize("field, kwargs", [
    ("name", dict(name="Bad Name!")),
    ("name", dict(name="")),
    ("name", dict(name="a" * 49)),
    ("name", dict(name="-r1")),
    ("name", dict(name="r1\n")),
    ("sync_every", dict(sync_every=0)),
    ("sync_every", dict(sync_every=1.5)),
    ("compression", dict(compression="int4")),
    ("min_group_size", dict(min_group_size=9, target_group_size=8)),
    ("target_group_size", dict(target_group_size=0)),
    ("seq_len", dict(seq_len=64, model=SMALL_MODEL)),
    ("batch_size", dict(batch_size=0)),
    ("outer_momentum", dict(outer_momentum=1.0)),
    ("outer_lr", dict(outer_lr=float("nan"))),
    ("outer_nesterov", dict(outer_nesterov=1)),
    ("inner_lr", dict(inner_lr=True)),
    ("matchmaking_timeout", dict(matchmaking_timeout=float("inf"))),
    ("chunk_size", dict(chunk_size=100)),
    ("sparse_k", dict(sparse_k=0)),
    ("sparse_k", dict(sparse_k=4096)),
    ("dataset", dict(dataset="files:xyz")),
    ("version", dict(version=1)),  # an older client's spec
    ("init_seed", dict(init_seed=-1)),
    ("expected_peers", dict(expected_peers=-1)),
    ("expected_peers", dict(expected_peers=True)),
])
def test_run_spec_errors_name_the_field(field: str, kwargs: dict[str, Any]) -> None:
    kwargs.setdefault("name", "r1")
    with pytest.raises(ConfigError) as info:
        RunSpec(**kwargs)
    assert field in str(info.value)


@pytest.mark.parametrize("field, kwargs", [
    ("d_model", dict(d_model=30, n_heads=4)),  # not divisible
    ("d_model", dict(d_model=36, n_heads=4)),  # odd head dimension
    ("n_heads", dict(n_heads=0)),
    ("vocab_size", dict(vocab_size=1)),
    ("max_seq_len", dict(max_seq_len="128")),
    ("norm_eps", dict(norm_eps=0.5)),
])
def test_model_config_errors_name_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    assert field in str(info.value)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        RunSpec(name="r1", sync_every=0)


# ---- encoding -------------------------------------------------------------------------------------


def test_encode_from_dict_round_trip() -> None:
    spec = RunSpec(name="r1", model=SMALL_MODEL, seq_len=32, compression="fp32", min_group_size=2,
                   dataset="files:" + "ab" * 32, outer_lr=0.5, init_seed=7)
    decoded = RunSpec.from_dict(msgpack.unpackb(spec.encode(), raw=False))
    assert decoded == spec
    assert decoded.encode() == spec.encode()
    assert RunSpec.from_dict(spec.to_dict()) == spec


def test_spec_hash_stable_and_sensitive() -> None:
    a, b = RunSpec.from_preset("r1", "tiny"), RunSpec.from_preset("r1", "tiny")
    assert a is not b and a.spec_hash() == b.spec_hash()
    assert len(a.spec_hash()) == 32
    assert RunSpec.from_preset("r1", "tiny", sync_every=21).spec_hash() != a.spec_hash()
    assert RunSpec.from_preset("r2", "tiny").spec_hash() != a.spec_hash()


@pytest.mark.parametrize("raw", [
    _spec_dict(extra=1),  # unknown field
    _spec_dict(model=_model_dict(extra=1)),  # unknown model field
    _spec_dict(model={k: v for k, v in _model_dict().items() if k != "n_heads"}),  # missing model field
    _spec_dict(model="tiny"),
    _spec_dict(model=None),
    {k: v for k, v in _spec_dict().items() if k != "model"},
    {k: v for k, v in _spec_dict().items() if k != "name"},  # missing required field
    _spec_dict(sync_every="20"),  # string where int expected
    _spec_dict(seq_len="128"),
    _spec_dict(batch_size=16.0),
    _spec_dict(outer_lr="0.7"),
    _spec_dict(name=5),
    _spec_dict(name=None),
    _spec_dict(dataset=5),
    _spec_dict(dataset=["sotu"]),
    _spec_dict(compression=["int8"]),
    _spec_dict(compression={"int8": 1}),
    _spec_dict(version="1"),
    _spec_dict(model=_model_dict(d_model="32")),
    _spec_dict(model=_model_dict(rope_theta="1e4")),
    _spec_dict(model=_model_dict(n_layers=None)),
    [],
    "spec",
    None,
])
def test_from_dict_rejects_with_config_error(raw: Any) -> None:
    with pytest.raises(ConfigError):
        RunSpec.from_dict(raw)


def test_from_dict_deeply_nested_value_is_a_config_error() -> None:
    """strict_unpack can hand from_dict a ~1000-deep list; the error must still be a ConfigError."""
    deep: Any = 0
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(ConfigError):
        RunSpec.from_dict(_spec_dict(seq_len=deep))


# ---- peer options ---------------------------------------------------------------------------------


def test_peer_options() -> None:
    assert PeerOptions().device == "cpu"
    assert PeerOptions(device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="device"):
        PeerOptions(device="tpu")
    with pytest.raises(ConfigError, match="threads"):
        PeerOptions(threads=-1)
    with pytest.raises(ConfigError, match="dht_timeout"):
        PeerOptions(dht_timeout=0.0)


# ---- fault plans ----------------------------------------------------------------------------------


def test_fault_plan_parse_good() -> None:
    plan = FaultPlan.parse("kill@after_parts:2", log_path="/tmp/x.log")
    assert (plan.action, plan.point, plan.round, plan.log_path, plan.fired) == (
        "kill", "after_parts", 2, "/tmp/x.log", False)
    for action in ACTIONS:
        for point in POINTS:
            p = FaultPlan.parse(f"{action}@{point}:0")
            assert (p.action, p.point, p.round) == (action, point, 0)


@pytest.mark.parametrize("text", [None, ""])
def test_fault_plan_parse_empty(text: str | None) -> None:
    plan = FaultPlan.parse(text)
    assert plan.action is None
    plan.at("after_parts", 0)  # an empty plan never fires
    assert not plan.fired


@pytest.mark.parametrize("text", [
    "kill", "kill@after_parts", "kill@after_parts:", "kill@after_parts:x", "kill@after_parts:-1",
    "boom@after_parts:1", "kill@nowhere:1", "@after_parts:1", "kill@:1", "kill:1@after_parts",
    "kill@after_parts:1.5",
])
def test_fault_plan_parse_bad(text: str) -> None:
    with pytest.raises(ConfigError):
        FaultPlan.parse(text)


def test_fault_plan_fires_only_at_its_point_and_round() -> None:
    plan = FaultPlan.parse("exit@after_round:3")
    plan.at("after_round", 2)
    plan.at("before_parts", 3)
    assert not plan.fired
    with pytest.raises(SystemExit):
        plan.at("after_round", 3)
    assert plan.fired
    plan.at("after_round", 3)  # at most once: no second exit


def test_device_auto_takes_cuda_when_torch_sees_it_else_the_cpu_and_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from hivetrain.peer.app import auto_device
    from hivetrain.peer.config import PeerOptions

    assert PeerOptions(device="auto").device == "auto"  # resolved when the peer starts (peer/app.py run_peer)
    with pytest.raises(ConfigError, match="'auto', 'cpu' or 'cuda"):
        PeerOptions(device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_device() == ("cpu", "--device auto: no CUDA device here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert auto_device() == ("cuda", "--device auto: NVIDIA H100 80GB HBM3")
