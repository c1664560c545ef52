"""One running peer, composed: what ``peer start`` does between parsing its flags and printing.

``run_peer`` joins the DHT with the peer's identity, opens the run (publishes a new spec, or
fetches and checks the owner's), builds the averager, state sync and training loop around one
trust ledger, and trains until told to stop. Everything it has to say goes through ``say``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.dht.diagnose import check_ports
from hivetrain.dht.errors import DHTError
from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.peer import join, reach
from hivetrain.peer.assembly import Peer, Seams, serve_dialback
from hivetrain.peer.config import PeerOptions, RunSpec, outer_defaults
from hivetrain.peer.dashboard import Dashboard, RunWatcher, parse_bind
from hivetrain.peer.errors import ConfigError, StateMismatch
from hivetrain.peer.export import load_spec, save_spec, save_tokenizer, spec_path
from hivetrain.peer.faults import FaultPlan
from hivetrain.peer.net.libp2p import LibP2PLink
from hivetrain.peer.runspec import fetch_spec, new_run, republish
from hivetrain.peer.state import checkpoint
from hivetrain.peer.status import read_status
from hivetrain.peer.totals import Totals, TotalsWriter
from hivetrain.peer.train import hf, memory
from hivetrain.peer.train.data import Corpus, describe_skipped, load_corpus
from hivetrain.peer.train.learner import LMLearner
from hivetrain.peer.trust import LedgerFile

Say = Callable[[str], None]


@dataclass(frozen=True)
class RunChoice:
    """Which run to take part in: a new one (``new_run`` with its preset and spec overrides) or an
    existing one by key."""

    new_run: str | None = None
    run_key: str | None = None
    preset: str | None = None  # None: not given (a new run's default is tiny)
    overrides: dict[str, Any] = field(default_factory=dict)  # spec fields given on the command line (None: not)

    @property
    def model_preset(self) -> str:
        return self.preset or "tiny"

    def refuse_for_joiner(self, spec: RunSpec) -> None:
        """A joiner's run-spec flags must agree with the run (its owner chose them): else one line."""
        if self.preset is not None:
            raise ConfigError(f"--preset {self.preset}: the run's model is its owner's choice; drop --preset "
                              "when joining")
        differ = [f"--{k.replace('_', '-')} {v} (the run's: {getattr(spec, k)})"
                  for k, v in sorted(self.overrides.items()) if v is not None and getattr(spec, k) != v]
        if differ:
            raise ConfigError(f"{'; '.join(differ)}: a run's settings are its owner's; drop "
                              f"{'this flag' if len(differ) == 1 else 'these flags'} when joining")


@dataclass(frozen=True)
class Opened:
    """A run opened: its key and spec, the corpus in the model's tokens, and, for a Hugging Face
    model, the module to train (with the run's initial weights or not: the trainer checks) and its
    tokenizer."""

    run_key: str
    spec: RunSpec
    corpus: Corpus
    model: torch.nn.Module | None = None
    tokenizer: Any = None  # a Hugging Face model's, checked against the spec
    plan: memory.MemoryPlan | None = None  # a Hugging Face model's memory plan (made, and said, on opening)


# defaults of a run on a Hugging Face model (the flags override them): continued pretraining. On sotu,
# SmolLM2 at inner lr 1e-4 drifted up after its first round, at 2e-5 it went down every round (docs/BENCHMARKS.md)
HF_DEFAULTS: dict[str, Any] = dict(seq_len=512, batch_size=8, inner_lr=2e-5, sync_every=50)


def open_run(dht: DHT, options: PeerOptions, choice: RunChoice, say: Say) -> Opened:
    """Publishes a new run's spec as its owner, or fetches and checks an existing one. Raises
    ConfigError for data or a model that does not match the run."""
    if choice.new_run is not None:
        corpus = _load_data(options.data_path, say)
        dataset = "sotu" if options.data_path is None else f"files:{corpus.digest}"
        source = hf.load_source(m, say) if (m := new_run_model(choice, options)) else None
        if source is None:
            spec = RunSpec.from_preset(choice.new_run, choice.model_preset, dataset=dataset, **choice.overrides)
        else:
            settings = outer_defaults({**HF_DEFAULTS, **{k: v for k, v in choice.overrides.items() if v is not None}})
            settings["seq_len"] = min(settings["seq_len"], source.summary.max_seq_len)
            spec = RunSpec(name=choice.new_run, model=source.summary, dataset=dataset, hf_config=source.config_json,
                           init_hash=hf.initial_hash(source.model), tokenizer=source.tokenizer_hash,
                           pretrained=source.origin if source.origin == hf.SMOLLM2 else "", **settings)
            if not source.has_weights:
                say("the run starts from freshly initialised weights (the architecture's own initialisation)")
            plan = fits(spec, options, say)  # (before the run is published: a refusal publishes nothing)
            corpus = hf.tokenize_corpus(corpus, source, say, _token_cache(options))
        owner = _load_identity(os.path.join(options.state_dir, "owners", f"{spec.name}.key"))
        _same_run(os.path.join(options.state_dir, "checkpoints"), make_run_key(spec.name, owner.public_key), spec)
        run_key, _ = new_run(dht, owner, spec)
        if source is None:
            return Opened(run_key, spec, corpus)
        return Opened(run_key, spec, corpus, source.model, source.tokenizer, plan)
    assert choice.run_key is not None
    spec, record = fetch_spec(dht, choice.run_key, options.dht_timeout)
    choice.refuse_for_joiner(spec)
    if spec.dataset == "sotu" and options.data_path is not None:  # (before the files are read: drop them, not fix them)
        raise ConfigError(f"run {choice.run_key} trains on the bundled sotu corpus; drop --data")
    say(f"joined run {choice.run_key}: {spec.sync_every} inner steps a round, groups of {spec.target_group_size}, "
        f"data {spec.dataset}")
    corpus = _load_data(options.data_path, say)
    if spec.dataset != "sotu" and spec.dataset != f"files:{corpus.digest}":
        raise ConfigError(f"run {choice.run_key} trains on {spec.dataset}; pass --data with exactly that corpus")
    opened = Opened(choice.run_key, spec, corpus)
    if spec.hf_config:
        opened = _join_hf(opened, options, say)
    elif options.model_path:
        raise ConfigError(f"run {choice.run_key} trains the built-in model ({spec.model.d_model} wide); drop --model")
    try:  # helps the spec outlive its owner; not needed to train
        republish(dht, record)
    except DHTError as e:
        say(f"warning: could not re-store the run spec ({e})")
    return opened


def new_run_model(choice: RunChoice, options: PeerOptions) -> str | None:
    """The Hugging Face model a new run trains (a folder, or the packaged pretrained preset), or None."""
    if options.model_path and choice.preset is not None:
        raise ConfigError(f"--model and --preset {choice.preset} both name the model: pass one")
    return options.model_path or (hf.SMOLLM2 if choice.preset == hf.SMOLLM2 else None)


def _join_hf(opened: Opened, options: PeerOptions, say: Say) -> Opened:
    """A run on a Hugging Face model: our copy of its architecture and tokenizer (the packaged
    pretrained start, or ``--model``), checked against the spec; its weights if they are the run's."""
    spec, key = opened.spec, opened.run_key
    if spec.pretrained:
        if options.model_path:
            raise ConfigError(f"run {key} starts from the packaged {spec.pretrained}; drop --model")
        source = hf.load_source(spec.pretrained, say)
    elif options.model_path:
        source = hf.load_source(options.model_path, say)
    else:
        raise ConfigError(f"run {key} trains a Hugging Face model: pass --model DIR, a folder with its config.json and "
                          "tokenizer (the weights are optional: without them they come from the run's peers)")
    if source.config_json != spec.hf_config:
        raise ConfigError(f"the model at {source.origin} is not the architecture run {key} trains (its config.json "
                          "differs)")
    if source.tokenizer_hash != spec.tokenizer:
        raise ConfigError(f"the tokenizer at {source.origin} is not the one run {key} uses ({source.tokenizer_hash[:19]} "
                          f"against {spec.tokenizer[:19]})")
    plan = fits(spec, options, say)
    # (whether our weights are the run's start, the trainer finds out from the state they make)
    return Opened(key, spec, hf.tokenize_corpus(opened.corpus, source, say, _token_cache(options)), source.model,
                  source.tokenizer, plan)


def _same_run(ckpt_dir: str, run_key: str, spec: RunSpec) -> None:
    """A run started again with ``--new-run`` (the same name and owner key: the same run key) must
    have the spec it was started with: publishing another under the key would change the run under
    its peers' feet (and resume a checkpoint of the old spec). ConfigError naming the flags to pass."""
    if not os.path.exists(spec_path(ckpt_dir, run_key)):
        return
    before = load_spec(ckpt_dir, run_key)
    if before.spec_hash() == spec.spec_hash():
        return
    old, new = before.to_dict(), spec.to_dict()
    flags = {"model": "--preset/--model", "dataset": "--data", "hf_config": "--model", "init_hash": "--model",
             "tokenizer": "--model", "pretrained": "--preset"}
    changed = [f"{flags[k]} as before (its {k} differs)" if k in flags else
               f"--{k.replace('_', '-')} {old[k]} (now {new.get(k)})" for k in old if old[k] != new.get(k)]
    raise ConfigError(f"run {spec.name} ({run_key[:len(spec.name) + 9]}...) was started here with other settings: "
                      f"{'; '.join(changed[:4])}{'; ...' if len(changed) > 4 else ''}. Start it again with the same "
                      "flags, or start a new run under another name")


def _load_identity(path: str) -> Identity:
    """A key file (created if absent); ConfigError, in one line, for one that is not an Ed25519 PEM key,
    or a link to a file that is gone (a new key written through it would be a new identity unasked)."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"the key file {path} is a link to {os.readlink(path)}, which does not exist: restore "
                          "it, or remove the link to get a new identity")
    try:
        return Identity.load_or_create(path)
    except ValueError as e:
        raise ConfigError(f"{e}: pass another --identity, or move the file away to get a new identity") from None
    except OSError as e:
        raise ConfigError(f"cannot read or create the key file {path}: {e.strerror or e}") from None


def _token_cache(options: PeerOptions) -> str | None:
    """Where tokenized corpora are kept (none for a peer that keeps nothing)."""
    return None if options.ephemeral else os.path.join(options.state_dir, "tokens")


def _load_data(path: str | None, say: Say) -> Corpus:
    """The corpus, with a line on what a data folder gave and what it left out."""
    corpus = load_corpus(path)
    if path is not None:
        size = (corpus.train.numel() + corpus.heldout.numel()) / 1e6
        skipped = f"; skipped {len(corpus.skipped)}: {describe_skipped(corpus.skipped)}" if corpus.skipped else ""
        say(f"data: {corpus.n_files} file(s), {size:.1f} MB of text from {path}{skipped}")
    return corpus


def fits(spec: RunSpec, options: PeerOptions, say: Say) -> memory.MemoryPlan:
    """The memory plan to train with (peer/train/memory.py ``choose``: the user's --micro-batch and
    --activation-checkpointing, else what fits the device), said in one line; ConfigError, in one line
    with what would fit, when the user's choice or nothing fits."""
    if options.micro_batch and spec.batch_size % options.micro_batch:
        raise ConfigError(f"--micro-batch {options.micro_batch} does not divide the run's batch of {spec.batch_size}")
    budget = memory.device_budget(options.device, options.memory_limit_gib)
    try:
        p = memory.choose(spec.model, spec.batch_size, spec.seq_len, options.device, budget, options.micro_batch,
                          options.checkpointing)
    except ConfigError as e:
        if options.memory_limit_gib and budget < memory.device_budget(options.device):  # the user's own limit
            raise ConfigError(f"{e}; or raise --memory-limit (now {options.memory_limit_gib:g} GiB)") from None
        raise
    say(p.describe(budget))
    return p


def announce(dht: DHT, run_key: str, spec: RunSpec, say: Say, info_file: str | None,
             bootstrap: Sequence[str] = ()) -> list[str]:
    """Tells the user (and, for tests and the demo, an info file) how to join this run: its join
    string (peer/join.py) lists our best addresses and then the peers we came in through
    (``bootstrap``). Returns our addresses for the heartbeat (``join.own``)."""
    maddrs = dht.visible_maddrs()
    if spec.compression == "int8":
        from hivetrain.kernels.fast_cpu import UNAVAILABLE_REASON
        from hivetrain.kernels.int8 import active_path

        path = active_path()  # builds the C kernel once (cached), or says why not
        say(f"int8 codec: {'compiled C kernel' if path == 'c' else f'pure-torch reference ({UNAVAILABLE_REASON})'}")
    if spec.compression == "sparse":
        codec = spec.codec()
        say(f"sparse codec: the {codec.k} largest of every {codec.chunk_size} values "
            f"({100 * codec.k / codec.chunk_size:.2g} %) per round, the rest carried into later rounds")
    say(f"run key: {run_key}")
    for maddr in maddrs:
        say(f"address: {maddr}")
    listed = list(dict.fromkeys([*join.pick(maddrs, join.OWN_ADDRESSES), *bootstrap]))[:join.LINE_ADDRESSES]
    say(f"join with: peer start --join {join.line(run_key, listed)}{join.limited(listed)}")
    if info_file:
        tmp = info_file + ".tmp"
        try:  # (the CLI checked that it can write there; this is for a folder gone since)
            with open(tmp, "w") as f:
                json.dump({"run_key": run_key, "peer_id": dht.peer_id, "maddrs": maddrs,
                           "join": join.line(run_key, listed), "spec_hash": spec.spec_hash().hex()}, f)
            os.replace(tmp, info_file)
        except OSError as e:
            raise ConfigError(f"--info-file {info_file}: cannot write it ({e.strerror or e})") from None
    return join.own(maddrs)


def auto_device() -> tuple[str, str]:
    """``--device auto``: (the device, why it was chosen) - the first CUDA device when torch sees
    one, else the CPU."""
    if torch.cuda.is_available():
        return "cuda", f"--device auto: {torch.cuda.get_device_name(0)}"
    return "cpu", "--device auto: no CUDA device here"


def run_peer(options: PeerOptions, choice: RunChoice, say: Say, wait_timeout: float = 120.0,
             info_file: str | None = None, progress: Callable[..., None] | None = None) -> dict[str, Any]:
    """Joins (or starts) a run and trains until ``options.max_rounds`` (0: until interrupted);
    returns the training totals."""
    behaviour = FaultPlan.parse(options.fault, options.fault_log)
    if options.device == "auto":
        device, why = auto_device()
        options = dataclasses.replace(options, device=device)
        say(f"device: {device} ({why}; --device chooses another)")
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {options.device}: no CUDA device is available here")
    if choice.new_run is not None and new_run_model(choice, options) is None:
        # a model that cannot fit is refused before anything is published (a Hugging Face model's
        # plan is made, and said, once its config is read)
        fits(RunSpec.from_preset(choice.new_run, choice.model_preset, **choice.overrides), options, lambda _: None)
    state_lock = checkpoint.lock_dir(options.state_dir)  # noqa: F841 (held until exit)
    # listening before anything is published: a port in use is one line, not a run started for nothing
    dashboard = Dashboard(parse_bind(options.dashboard, options.dashboard_public, options.dashboard_private), None,
                          public=options.dashboard_public) if options.dashboard else None
    # the same peer at the same address after a restart (peer/reach.py), unless asked to be a new one
    if options.ephemeral:
        identity, hosts = Identity.generate(), list(options.host_maddrs)
    else:
        identity = _load_identity(options.identity_path or os.path.join(options.state_dir, reach.IDENTITY_FILE))
        hosts = reach.remembered(options.state_dir, options.host_maddrs)
    check_ports(hosts)
    dht = DHT(DHTOptions(initial_peers=options.initial_peers, host_maddrs=tuple(hosts),
                         announce_maddrs=options.announce_maddrs, identity=identity,
                         timeout=options.dht_timeout)).start()
    visible = dht.visible_maddrs()
    if not options.ephemeral and not options.announce_maddrs:  # announced addresses are the user's to manage
        reach.remember(options.state_dir, hosts, visible)
    say(reach.listening(hosts, visible))
    link = LibP2PLink(dht.p2p)
    board: Dashboard | None = None
    peer: Peer | None = None
    try:
        # before anyone learns our address: a joiner may check with us at once
        dht.run(serve_dialback(link, behaviour), timeout=10)
        opened = open_run(dht, options, choice, say)
        run_key, spec, corpus = opened.run_key, opened.spec, opened.corpus
        plan = opened.plan or fits(spec, options, say)  # (its choice is what the inner steps use)
        addresses = announce(dht, run_key, spec, say, info_file, options.initial_peers)
        learner = LMLearner(spec, dht.peer_id, corpus, opened.model, options.device, options.eval_batches,
                            plan.micro_batch, plan.checkpointing, options.compile)
        ckpt_dir = os.path.join(options.state_dir, "checkpoints")
        os.makedirs(ckpt_dir, exist_ok=True)
        ckpt_path = os.path.join(ckpt_dir, f"{run_key}.ckpt")
        save_spec(ckpt_dir, run_key, spec)  # for `peer export`, which needs no network
        if opened.tokenizer is not None:
            save_tokenizer(ckpt_dir, run_key, opened.tokenizer)
        try:  # (the CLI checked that it can write there; this is for a folder gone since)
            metrics = TotalsWriter(options.metrics_file, Totals.of(dht.peer_id, spec))  # (the dashboard's totals)
        except OSError as e:
            raise ConfigError(f"--metrics-file {options.metrics_file}: cannot write it ({e.strerror or e})") from None
        ledger = LedgerFile(os.path.join(ckpt_dir, f"{run_key}.trust.json"), run_key, say)
        began = checkpoint.BeganFile(os.path.join(ckpt_dir, f"{run_key}.began.json"), say)
        peer = Peer(Seams(dht, link, learner, behaviour, checkpoint.Writer(ckpt_path, say), ledger=ledger,
                          began=began), run_key, spec, metrics, say)
        if addresses:  # where ``peer status`` finds us for a fresh join string
            peer.heartbeat.extra["addrs"] = addresses
        metrics.heartbeat = peer.heartbeat.extra  # ... and our totals (peer/totals.py)
        if dashboard is not None:
            board = dashboard
            board.watcher = RunWatcher(lambda: read_status(dht, run_key, spec), warn=say)
            board.rounds, board.totals = metrics.recent, metrics.totals
            say(f"dashboard at {board.start().url}")
        if progress is not None:
            peer.trainer.progress = progress
        try:
            saved = checkpoint.read(ckpt_path, peer.trainer.numel)
        except StateMismatch as e:
            say(f"warning: ignoring the local checkpoint ({e})")
            saved = None
        try:
            return peer.run(saved, options.max_rounds, options.until_round, options.wait_for_peers, wait_timeout)
        finally:
            metrics.close()
    finally:
        if board is not None:
            board.stop()
        if peer is not None:
            peer.stop()
        _shutdown_with_deadline(dht)


def _shutdown_with_deadline(dht: DHT) -> None:
    t = threading.Thread(target=dht.shutdown, daemon=True)
    t.start()
    t.join(15)
