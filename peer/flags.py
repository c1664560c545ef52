"""What a command's flags are refused for before anything starts (torch, the p2p daemon, the DHT):
each mistake one line naming the flag, exit 2 (peer/cli.py ``main``). The run spec's and this
peer's own fields are checked here as peer/config.py will check them, and an error about a field
names the flag that sets it."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from hivetrain.peer.config import flag_knobs
from hivetrain.peer.errors import ConfigError

DEFAULT_PORT = 31337  # where ``peer start`` listens, on all interfaces, unless told otherwise

SPEC_FLAGS = tuple(f.name for f in flag_knobs())  # the run-spec fields flags set (peer/config.py ``knob``)


# the flag of each config field a flag sets, by the name a ConfigError gives the field (peer/config.py)
FLAG_OF = {**{f"spec.{k}": "--" + k.replace("_", "-") for k in SPEC_FLAGS},
           **{f"peer.{k}": "--" + k.replace("_", "-") for k in ("threads", "max_rounds", "until_round",
                                                               "eval_batches", "dht_timeout", "wait_for_peers",
                                                               "micro_batch")},
           "peer.memory_limit_gib": "--memory-limit"}


def in_flags(e: ConfigError) -> ConfigError:
    """``e`` naming the command-line flags, not the config fields ("spec.sync_every" -> "--sync-every"),
    for an error in what the flags built; the other fields of its message too ("needs inner_total_steps")."""
    text = re.sub(r"\b(?:spec|peer)\.[a-z_]+", lambda m: FLAG_OF.get(m.group(0), m.group(0)), str(e))
    if text != str(e):
        text = re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: FLAG_OF.get(f"spec.{m.group(0)}", m.group(0)), text)
    return ConfigError(text)


def check_spec(name: str, preset: str | None, overrides: dict[str, Any], hf_model: bool) -> None:
    """The run-spec flags of a new run, checked as the spec will be (peer/app.py ``open_run``) before
    anything starts: one line naming the flag. A Hugging Face model's sizes are known only once it is
    read, so its seq_len is bounded then (the rest here, on a model that takes any)."""
    from hivetrain.peer.config import PRESET_NAMES, PRETRAINED, ModelConfig, RunSpec, outer_defaults

    if preset is not None and preset not in PRESET_NAMES:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESET_NAMES)}")
    try:
        if hf_model or preset in PRETRAINED:
            given = outer_defaults({k: v for k, v in overrides.items() if v is not None})
            RunSpec(name=name, model=ModelConfig(max_seq_len=1 << 17), **given)
        else:
            RunSpec.from_preset(name, preset or "tiny", **overrides)
    except ConfigError as e:
        raise in_flags(e) from None


def check_writable(flag: str, path: str, example: str, probe: str | None = None) -> None:
    """Refuses, in one line, a file the peer could not write once the run is open: ``path`` (or
    ``probe``, the file written first) is created here, or opened to append, and what was created is
    removed again. Writing is the only test that holds for root, read-only mounts and ACLs alike."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: that is a folder; pass a file, e.g. {os.path.join(path, example)}")
    target = probe or path
    existed = os.path.exists(target)
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        os.remove(target)


def run_key(text: str) -> str:
    """``--run``'s key, lower case (base32 is case-insensitive; run names are lower case), or one line
    saying what is wrong with it (before bootstrap: an unreachable peer must not hide a mistyped key)."""
    from hivetrain.dht.identity import parse_run_key

    key = text.strip().lower()
    try:
        parse_run_key(key)
    except ValueError as e:
        raise ConfigError(f"--run: {e}") from None
    return key


def joined(args: argparse.Namespace) -> None:
    """``--join``'s run key and addresses in ``args.run`` and (first) ``args.initial_peers``; the
    key of ``--run`` lower case. One line for a malformed string or key."""
    from hivetrain.peer import join

    if getattr(args, "join", None):
        args.run, addresses = join.parse(args.join)
        args.initial_peers = [*addresses, *getattr(args, "initial_peers", [])]
    elif args.run is not None:
        args.run = run_key(args.run)


def listen_on(args: argparse.Namespace) -> list[str]:
    """Where ``peer start`` listens: ``--host-maddrs``, or all interfaces at ``--port`` (default
    DEFAULT_PORT; an --ephemeral peer: any free port)."""
    if args.host_maddrs is not None:
        if args.port is not None:
            raise ConfigError("--port and --host-maddrs: pass one (--host-maddrs names its own ports)")
        if not args.host_maddrs:
            raise ConfigError(f"--host-maddrs needs an address, e.g. /ip4/0.0.0.0/tcp/{DEFAULT_PORT}")
        return list(args.host_maddrs)
    port = args.port if args.port is not None else 0 if args.ephemeral else DEFAULT_PORT
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be a TCP port, 0 to 65535, got {port}")
    return [f"/ip4/0.0.0.0/tcp/{port}"]


def seconds(flag: str, value: float) -> None:
    """A duration flag: a positive number of seconds, or one line."""
    if not value > 0:
        raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")


def own(**fields: Any) -> None:
    """This peer's own flags, checked as PeerOptions will check them when the command builds it; an
    error names the flag."""
    from hivetrain.peer.config import PeerOptions

    try:
        PeerOptions(**fields)
    except ConfigError as e:
        raise in_flags(e) from None


def check_start(args: argparse.Namespace) -> None:
    """What can be refused before anything starts (torch, the p2p daemon, the DHT), each in one line."""
    joined(args)
    if args.run is not None and not args.initial_peers:
        raise ConfigError("joining a run needs its join string (--join hivetrain://...: the 'join with:' line a peer "
                          "of the run printed), or --initial-peers MADDR, e.g. /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...")
    args.host_maddrs = listen_on(args)
    if args.dashboard:
        from hivetrain.peer.dashboard import parse_bind

        parse_bind(args.dashboard, args.dashboard_public, args.dashboard_private)
    seconds("--wait-timeout", args.wait_timeout)
    own(threads=args.threads, max_rounds=args.max_rounds, until_round=args.until_round, eval_batches=args.eval_batches,
        dht_timeout=args.dht_timeout, wait_for_peers=args.wait_for_peers, micro_batch=args.micro_batch,
        memory_limit_gib=args.memory_limit, device=args.device)
    if args.new_run is not None:
        check_spec(args.new_run, args.preset, {k: getattr(args, k) for k in SPEC_FLAGS}, bool(args.model))
    from hivetrain.dht.diagnose import check_ports

    check_ports(args.host_maddrs)  # (an explicit port in use or privileged: one line, before the daemon)
    if args.data:  # (what the files hold is read once the run is known: peer/train/data.py)
        from hivetrain.peer.train.datapath import expand

        expand(args.data)
    if args.metrics_file:
        check_writable("--metrics-file", args.metrics_file, "metrics.jsonl")
    if args.info_file:  # written as PATH.tmp, then renamed (peer/app.py ``announce``)
        check_writable("--info-file", args.info_file, "info.json", probe=args.info_file + ".tmp")


def check_demo(args: argparse.Namespace) -> None:
    """The demo's flags that its peers would refuse, refused before any peer is spawned."""
    seconds("--timeout", args.timeout)
    own(eval_batches=args.eval_batches)
    check_spec("demo", args.preset, {k: getattr(args, k) for k in (
        "sync_every", "batch_size", "aggregation", "overlap", "outer_lr", "outer_momentum", "inner_warmup")}, False)


def check_status(args: argparse.Namespace) -> None:
    """``peer status``'s flags, before torch and hivemind are imported."""
    joined(args)
    if not args.initial_peers:
        raise ConfigError("peer status needs the run's join string (--join hivetrain://...), or --initial-peers "
                          "MADDR: the address of any peer of the run, e.g. /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...")
    if args.count < 0:
        raise ConfigError(f"--count must be 0 or more, got {args.count}")
    seconds("--interval", args.interval)
    own(dht_timeout=args.dht_timeout)


def check_export(args: argparse.Namespace) -> None:
    """``peer export``'s run key (from ``--run`` or ``--join``), lower case, or one line."""
    joined(args)
