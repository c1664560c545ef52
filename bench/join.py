"""Time for a joiner to download and verify the outer state from 1, 2, 4 donors, with the real StateSync.

Usage (from the repository root; setting (b) needs root for ``ip netns`` and ``tc``)::

    python -m bench.join [--size-mb 100] [--donors 1,2,4] [--rate 100mbit] [--repeat 3]
                         [--no-netns] [--json] [--quick]

Every peer is its own OS process (``python -m bench.join --role donor|joiner``) with its own DHT and
p2pd. ``max(--donors)`` donors start once per setting (the first bootstraps the others). Each builds a
:class:`~hivetrain.peer.state.snapshot.Snapshot` of the same synthetic state (seeded random master and momentum,
``numel = SIZE_MB * 1e6 / 8``, so every donor attests the same state hash), serves it through
:class:`~hivetrain.peer.state.sync.StateSync` and publishes a heartbeat (signed by its libp2p identity)
attesting ``(round, hash, parent)``. The joiner joins the DHT, waits (bounded) until every donor's heartbeat
is visible, builds the target with the joiner's fork choice (``StateSync.check``: it asks every donor for the
manifest and counts the network prefixes/IPs of its connections, peer/state/choose.py), and times ``StateSync.download(target, timeout)`` with the
target's attesters cut to the first k donors, for each k in ``--donors``, ``--repeat`` times (interleaved),
after one untimed warm-up download from all donors (a cold join; its time is reported apart).

Settings:

* ``loopback``: every peer on 127.0.0.1. On a small machine this is CPU-bound (p2pd's TLS and yamux,
  hashing, copies), so only MB/s and the time relative to 1 donor are reported.
* ``netns``: each donor in its own network namespace whose egress is capped with ``tc tbf`` at ``--rate``,
  the joiner in its own uncapped namespace, all on one bridge (10.79.x.0/24, namespaces ``hj<pid>*``). The
  lower bound is ``bytes / (k * rate)``; ratio = measured / bound. Skipped with a message if namespaces
  cannot be created here.

Every wait has a deadline; every process started here is killed (process groups, and the parent-death
signal if this process is SIGKILLed) and every namespace removed, on error, Ctrl+C and SIGTERM too. Only
a SIGKILL of the bench itself can leave its (empty) namespaces behind; the next run deletes them.

The joiner also times every request (a wrapper around ``StateSync._fetch`` in the bench process only) and
reports where each download's time went: manifest, pieces (first request to last byte), after (the last
byte to ``download()`` returning: ``assemble``), the median piece request, and the links' idle tail.
``--json`` prints one JSON object on the last line. ``--quick``: 10 MB, donors 1,2, one repeat, 50mbit.
``--per-donor`` and ``--piece-kib`` are what-if knobs that patch StateSync's constants in the bench
processes only (defaults: the shipped values).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.netns import Netns, parse_rate
from bench.peers import _die_with_parent

ROOT = Path(__file__).resolve().parents[1]
SEED = 20240611
ROUND = 1
RUN_NAME = "bench-join"
MB = 1e6
STARTUP_TIMEOUT = 60.0  # seconds for one peer process to come up (DHT, snapshot, serving)
HEARTBEAT_TIMEOUT = 60.0  # seconds for the joiner to see every donor's heartbeat


# ---- helpers shared by all roles ------------------------------------------------------------------------


def numel_for(size_mb: float) -> int:
    return max(1, int(size_mb * MB / 8))


def spec_hash_for(run_key: str) -> str:
    return hashlib.sha256(f"hivetrain-bench-join\0{run_key}".encode()).hexdigest()


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all namespaces share /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(a) for a in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _patch_constants(piece_kib: int | None, per_donor: int | None) -> None:
    """What-if knobs: patch StateSync's piece size / pieces in flight in this process only (a donor lets
    one requester have that many requests in flight: ``_state_sync``)."""
    from hivetrain.peer.state import snapshot as state
    from hivetrain.peer.state import sync as state_sync

    if piece_kib:
        state.PIECE_SIZE = piece_kib * 1024
        state_sync.PIECE_SIZE = piece_kib * 1024
    if per_donor:
        state_sync.PER_DONOR = per_donor


def _state_sync(dht: Any, run_key: str, numel: int, per_donor: int | None) -> Any:
    """The real StateSync over the peer's libp2p link, with its StateService served."""
    from hivetrain.peer.averaging.behaviour import HONEST
    from hivetrain.peer.net.libp2p import LibP2PLink
    from hivetrain.peer.state.serve import MAX_PER_REQUESTER, StateService
    from hivetrain.peer.state.sync import StateSync

    link = LibP2PLink(dht.p2p)
    service = StateService(spec_hash_for(run_key), HONEST)
    service.server.max_per_peer = max(MAX_PER_REQUESTER, per_donor or 0)
    dht.run(link.serve(service.protocol, service.server), timeout=10)
    return StateSync(dht, link, service, run_key, numel)


def _emit(obj: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(obj), flush=True)


# ---- role: donor --------------------------------------------------------------------------------------


def run_donor(args: argparse.Namespace) -> int:
    import torch

    from hivetrain.dht.node import DHT, DHTOptions
    from hivetrain.peer.state.heartbeats import attestation_fields, publish_heartbeat
    from hivetrain.peer.state.snapshot import Snapshot

    torch.set_num_threads(1)
    _patch_constants(args.piece_kib, args.per_donor)
    deadline = time.monotonic() + args.lifetime
    dht = DHT(DHTOptions(initial_peers=tuple(args.initial_peers), host_maddrs=(f"/ip4/{args.host}/tcp/0",),
                         timeout=15.0)).start()
    try:
        gen = torch.Generator().manual_seed(SEED)
        master = torch.randn(args.numel, generator=gen)
        momentum = torch.randn(args.numel, generator=gen) * 0.01
        snapshot = Snapshot.of(ROUND, master, momentum)
        del master, momentum
        sync = _state_sync(dht, args.run_key, args.numel, args.per_donor)
        sync.serve(snapshot)

        def heartbeat() -> None:  # signed by the DHT's identity: heartbeats are bound to the libp2p id
            publish_heartbeat(dht, dht.identity, args.run_key, args.lifetime + 60, **attestation_fields(snapshot),
                              throughput=0.0, train_loss=None, eval_loss=None)

        heartbeat()
        info = {"peer_id": dht.peer_id, "maddrs": dht.visible_maddrs(), "hash": snapshot.hash,
                "bytes": len(snapshot.data), "pid": os.getpid()}
        tmp = args.info_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, args.info_file)
        next_hb = time.monotonic() + 10
        # serve until the parent closes our stdin (or dies), or the lifetime runs out
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([sys.stdin], [], [], min(left, max(0.0, next_hb - time.monotonic())))
            if ready and not os.read(sys.stdin.fileno(), 4096):
                break
            if time.monotonic() >= next_hb:  # republish, as a real peer does every round
                with contextlib.suppress(Exception):
                    heartbeat()
                next_hb = time.monotonic() + 10
    finally:
        dht.shutdown()
    return 0


# ---- role: joiner -------------------------------------------------------------------------------------


def run_joiner(args: argparse.Namespace) -> int:
    from hivetrain.dht.node import DHT, DHTOptions
    from hivetrain.peer.state import sync as state_sync
    from hivetrain.peer.state.choose import Attested, Clock, Own, State
    from hivetrain.peer.state.heartbeats import read_heartbeats
    from hivetrain.peer.state.snapshot import ZERO, state_nbytes
    from hivetrain.peer.state.sync import StateSyncFailed

    _patch_constants(args.piece_kib, args.per_donor)
    donor_ids: list[str] = args.donor_ids.split(",")
    counts = [int(c) for c in args.counts.split(",")]
    dht = DHT(DHTOptions(initial_peers=tuple(args.initial_peers), host_maddrs=(f"/ip4/{args.host}/tcp/0",),
                         timeout=15.0)).start()
    try:
        t0 = time.monotonic()
        seen: set[str] = set()
        heartbeats: list[dict[str, Any]] = []
        while True:  # the DHT has no watch: bounded retry until every donor's attestation is visible
            with contextlib.suppress(Exception):
                heartbeats = read_heartbeats(dht, args.run_key)
            seen = {hb["peer_id"] for hb in heartbeats
                    if hb["round"] == ROUND and hb["state_hash"] == args.expected_hash}
            if set(donor_ids) <= seen:
                break
            if time.monotonic() - t0 > HEARTBEAT_TIMEOUT:
                raise RuntimeError(f"saw heartbeats of {len(seen & set(donor_ids))}/{len(donor_ids)} donors "
                                   f"within {HEARTBEAT_TIMEOUT:.0f} s")
            time.sleep(0.5)
        sync = _state_sync(dht, args.run_key, args.numel, args.per_donor)
        choice = sync.check(Own(dht.peer_id, State(0, ZERO, ZERO)), {}, Clock(0.2, 0.0))  # as a joiner
        target = choice.target
        if target is None or target.hash != args.expected_hash or not set(donor_ids) <= set(target.attesters):
            raise RuntimeError(f"fork choice picked {target}, expected the donors' state {args.expected_hash[:12]}")
        _emit({"event": "ready", "heartbeat_wait_s": time.monotonic() - t0, "chosen": choice.detail,
               "per_donor": state_sync.PER_DONOR, "piece_size": state_sync.PIECE_SIZE})
        index = {pid: i for i, pid in enumerate(donor_ids)}
        trace: list[tuple[str, int, float, float]] = []  # (donor, piece index or -1, start, end), perf_counter
        fetch = sync._fetch

        async def traced_fetch(donor: str, target: Any, piece: int, max_body: int) -> bytes:
            t = time.perf_counter()
            body = await fetch(donor, target, piece, max_body)
            trace.append((donor, piece, t, time.perf_counter()))
            return body

        setattr(sync, "_fetch", traced_fetch)  # bench-only timing of every request; StateSync is unchanged  # noqa: B010
        # one untimed download from every donor first: connections, code paths and allocator warm; its
        # time (a cold join) is reported apart
        w0 = time.perf_counter()
        try:
            warm_ok = sync.download(Attested(target.round, target.hash, target.parent, tuple(donor_ids)),
                                    args.timeout).hash \
                == args.expected_hash
        except StateSyncFailed as e:
            warm_ok = False
            logging.getLogger(__name__).warning("warm-up download failed: %s", e)
        _emit({"event": "warmup", "donors": len(donor_ids), "seconds": time.perf_counter() - w0, "ok": warm_ok})
        for rep in range(args.repeat):
            for k in counts:
                sub = Attested(target.round, target.hash, target.parent, tuple(donor_ids[:k]))
                gc.collect()
                trace.clear()
                busy0, w0 = _busy_seconds(), time.perf_counter()
                try:
                    snapshot = sync.download(sub, args.timeout)
                except StateSyncFailed as e:
                    _emit({"event": "download", "donors": k, "rep": rep, "ok": False, "error": str(e)[:500],
                           "seconds": time.perf_counter() - w0})
                    continue
                seconds = time.perf_counter() - w0
                busy = (_busy_seconds() - busy0) / seconds
                verified = (snapshot.hash == target.hash == args.expected_hash
                            and len(snapshot.data) == state_nbytes(args.numel))
                info = sync.last_download
                _emit({"event": "download", "donors": k, "rep": rep, "ok": True, "seconds": seconds,
                       "inner_seconds": info.get("seconds"), "bytes": len(snapshot.data), "verified": verified,
                       "served": {str(index.get(d, d)): n for d, n in sorted(info.get("donors", {}).items())},
                       "dropped": info.get("dropped", {}), "cpu_cores_busy": busy,
                       "phases": _phases(trace, w0, w0 + seconds)})
                del snapshot
    finally:
        dht.shutdown()
    return 0


def _phases(trace: list[tuple[str, int, float, float]], t0: float, t1: float) -> dict[str, float]:
    """Where a download's time went, from the per-request trace (seconds).

    manifest_s: start -> manifest received; pieces_s: first piece request -> last piece received;
    after_s: last piece -> download() returned (assemble: a second SHA-256 pass and the join);
    piece_median_s: one piece request, open to last byte; tail_idle_s: mean over donors of the time
    between a donor's last piece and the last piece overall (links idle while one donor finishes)."""
    manifest = [e for d, i, s, e in trace if i == -1]
    pieces = [(d, s, e) for d, i, s, e in trace if i >= 0]
    if not pieces:
        return {}
    last = max(e for _, _, e in pieces)
    ends: dict[str, float] = {}
    for d, _, e in pieces:
        ends[d] = max(ends.get(d, 0.0), e)
    return {"manifest_s": (max(manifest) - t0) if manifest else 0.0,
            "pieces_s": last - min(s for _, s, _ in pieces), "after_s": t1 - last,
            "piece_median_s": statistics.median(e - s for _, s, e in pieces),
            "tail_idle_s": statistics.fmean(last - e for e in ends.values())}


# ---- orchestration: processes ---------------------------------------------------------------------------


class Proc:
    """A bench peer in its own process group, logging to a file; stopped by ``stop()``."""

    def __init__(self, name: str, workdir: Path, role_args: list[str], prefix: list[str]):
        self.name = name
        self.log = workdir / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1")
        cmd = [*prefix, sys.executable, "-m", "bench.join", *role_args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def tail(self, n: int = 2500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # a donor shuts its DHT down cleanly on EOF
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group (p2pd included)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _wait_info(proc: Proc, path: Path, deadline: float) -> dict[str, Any]:
    while not path.exists():
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early (rc {proc.proc.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not come up in time:\n{proc.tail()}")
        time.sleep(0.1)
    info: dict[str, Any] = json.loads(path.read_text())
    return info


# ---- orchestration: network namespaces -----------------------------------------------------------------


# ---- orchestration: one setting ----------------------------------------------------------------------


def run_setting(setting: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Starts the donors and the joiner for one setting; returns the joiner's download records."""
    from hivetrain.dht.identity import Identity, make_run_key

    n = max(args.donor_counts)
    numel = numel_for(args.size_mb)
    run_key = make_run_key(RUN_NAME, Identity.generate().public_key)  # a throwaway owner
    net = Netns(n + 1) if setting == "netns" else None  # n donors, then the joiner
    procs: list[Proc] = []
    extra = [*(["--piece-kib", str(args.piece_kib)] if args.piece_kib else []),
             *(["--per-donor", str(args.per_donor)] if args.per_donor else [])]
    lifetime = str(int(args.budget))
    b0, w0 = _busy_seconds(), time.monotonic()
    time.sleep(1.0)  # what the machine does without us (others' load skews the CPU-bound loopback numbers)
    background = (_busy_seconds() - b0) / (time.monotonic() - w0)
    try:
        if net is not None:
            net.up()
            for i in range(n):  # donors: upload capped; the joiner (the last one) is uncapped
                net.shape(i, args.rate, burst_floor=32768)
        hosts = net.addrs if net is not None else ["127.0.0.1"] * (n + 1)

        def donor(i: int, initial: list[str]) -> tuple[Proc, Path]:
            info = workdir / f"{setting}-donor{i}.json"
            proc = Proc(f"{setting}-donor{i}", workdir,
                        ["--role", "donor", "--run-key", run_key, "--numel", str(numel), "--host", hosts[i],
                         "--info-file", str(info), "--lifetime", lifetime, *extra,
                         *(a for m in initial for a in ("--initial-peers", m))],
                        net.prefix(i) if net is not None else [])
            procs.append(proc)
            return proc, info

        deadline = time.monotonic() + STARTUP_TIMEOUT
        first = donor(0, [])
        infos = [_wait_info(*first, deadline)]
        bootstrap = infos[0]["maddrs"][:1]
        rest = [donor(i, bootstrap) for i in range(1, n)]
        deadline = time.monotonic() + STARTUP_TIMEOUT
        infos += [_wait_info(p, path, deadline) for p, path in rest]
        hashes = {info["hash"] for info in infos}
        if len(hashes) != 1:
            raise RuntimeError(f"donors attest different states: {sorted(hashes)}")
        expected = hashes.pop()

        joiner = Proc(f"{setting}-joiner", workdir,
                      ["--role", "joiner", "--run-key", run_key, "--numel", str(numel), "--host", hosts[n],
                       "--expected-hash", expected, "--donor-ids", ",".join(i["peer_id"] for i in infos),
                       "--counts", ",".join(map(str, args.donor_counts)), "--repeat", str(args.repeat),
                       "--timeout", str(args.download_timeout), *extra,
                       *(a for m in bootstrap for a in ("--initial-peers", m))],
                      net.prefix(n) if net is not None else [])
        procs.append(joiner)
        try:
            joiner.proc.wait(args.budget)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the joiner did not finish within {args.budget:.0f} s:\n{joiner.tail()}") from None
        records = [json.loads(line[6:]) for line in joiner.tail(10**7).splitlines() if line.startswith("BENCH ")]
        if joiner.proc.returncode != 0:
            raise RuntimeError(f"the joiner failed (rc {joiner.proc.returncode}):\n{joiner.tail()}")
        ready: dict[str, Any] = next((r for r in records if r["event"] == "ready"), {})
        warm: dict[str, Any] = next((r for r in records if r["event"] == "warmup"), {})
        return [dict(r, setting=setting, per_donor=ready.get("per_donor"), piece_size=ready.get("piece_size"),
                     heartbeat_wait_s=ready.get("heartbeat_wait_s"), warmup_s=warm.get("seconds"),
                     background_cores_busy=background)
                for r in records if r["event"] == "download"]
    finally:  # a second Ctrl+C must not cut the clean-up short: signals wait until it is done
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            for proc in reversed(procs):
                proc.stop()
            if net is not None:
                net.down()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def summarize(records: list[dict[str, Any]], setting: str, counts: list[int], nbytes: int,
              rate_bps: float | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for k in counts:
        mine = [r for r in records if r["donors"] == k]
        ok = [r for r in mine if r["ok"]]
        times = [r["seconds"] for r in ok]
        row: dict[str, Any] = {"setting": setting, "donors": k, "runs": len(mine), "failures": len(mine) - len(ok),
                               "times": times, "verified": bool(ok) and all(r["verified"] for r in ok),
                               "warmup_s": mine[0]["warmup_s"] if mine else None,
                               "background_cores_busy": mine[0]["background_cores_busy"] if mine else None}
        if times:
            med = statistics.median(times)
            row.update(seconds=med, mb_s=nbytes / MB / med,
                       cpu_cores_busy=statistics.median(r["cpu_cores_busy"] for r in ok),
                       served=ok[-1]["served"],
                       phases={p: statistics.median(r["phases"][p] for r in ok if p in r.get("phases", {}))
                               for p in ok[0].get("phases", {})})
        else:
            row.update(seconds=None, mb_s=None)
        if len(ok) < len(mine):
            row["errors"] = [r.get("error") for r in mine if not r["ok"]]
        if rate_bps is not None and times:
            row["rate_bps"] = rate_bps
            row["bound_s"] = nbytes * 8 / (k * rate_bps)
            row["ratio_to_bound"] = row["seconds"] / row["bound_s"]
        rows.append(row)
    one = next((r for r in rows if r["donors"] == 1 and r["seconds"]), None)
    for row in rows:
        if one is not None and row["seconds"]:
            row["vs_1_donor"] = row["seconds"] / one["seconds"]
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'setting':<10}{'donors':>7}{'seconds':>9}{'MB/s':>8}{'bound s':>9}{'ratio':>7}{'vs 1 donor':>11}" \
           f"{'cpu busy':>9}  verified  times"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['setting']:<10}{r['donors']:>7}{_fmt(r.get('seconds'), '.2f'):>9}{_fmt(r.get('mb_s'), '.1f'):>8}"
              f"{_fmt(r.get('bound_s'), '.2f'):>9}{_fmt(r.get('ratio_to_bound'), '.2f'):>7}"
              f"{_fmt(r.get('vs_1_donor'), '.2f'):>11}{_fmt(r.get('cpu_cores_busy'), '.2f'):>9}"
              f"  {'yes' if r['verified'] else 'NO':<8}  {' '.join(f'{t:.2f}' for t in r['times'])}"
              + (f"  FAILED {r['failures']}x: {(r.get('errors') or ['?'])[0]}" if r["failures"] else ""))


class _Interrupted(BaseException):
    pass


def _on_signal(signum: int, frame: Any) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=None, help="state size in MB (default 100, 10 with --quick)")
    ap.add_argument("--donors", default=None, help="donor counts, e.g. 1,2,4 (1,2 with --quick)")
    ap.add_argument("--rate", default=None, help="donor egress cap in the netns setting (100mbit; 50mbit --quick)")
    ap.add_argument("--repeat", type=int, default=None, help="downloads per point; the median is reported (3)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only")
    ap.add_argument("--no-loopback", action="store_true", help="network namespaces only")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--quick", action="store_true", help="10 MB, donors 1,2, 1 repeat, 50mbit")
    ap.add_argument("--per-donor", type=int, default=None, help="what-if: pieces in flight per donor")
    ap.add_argument("--piece-kib", type=int, default=None, help="what-if: piece size in KiB")
    ap.add_argument("--workdir", default=None, help="keep the peers' logs here (default: a temp dir)")
    # internal: the peer roles
    ap.add_argument("--role", choices=("donor", "joiner"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-key", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peers", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--info-file", help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--expected-hash", help=argparse.SUPPRESS)
    ap.add_argument("--donor-ids", help=argparse.SUPPRESS)
    ap.add_argument("--counts", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.role == "donor":
        return run_donor(args)
    if args.role == "joiner":
        return run_joiner(args)

    args.size_mb = args.size_mb if args.size_mb is not None else (10.0 if args.quick else 100.0)
    args.donor_counts = sorted({int(c) for c in (args.donors or ("1,2" if args.quick else "1,2,4")).split(",")})
    args.rate = args.rate or ("50mbit" if args.quick else "100mbit")
    args.repeat = args.repeat or (1 if args.quick else 3)
    if min(args.donor_counts) < 1 or args.repeat < 1 or args.size_mb <= 0:
        ap.error("donor counts, --repeat and --size-mb must be positive")
    rate_bps = parse_rate(args.rate)
    nbytes = 8 * numel_for(args.size_mb)
    slowest = nbytes * 8 / rate_bps  # one capped donor at the full rate
    args.download_timeout = 60 + 5 * slowest  # one download; the real deadline of a too-slow run
    # the whole joiner (DHT join, heartbeats, all downloads) must finish within this
    args.budget = 120 + args.repeat * len(args.donor_counts) * args.download_timeout

    settings = [s for s, off in (("loopback", args.no_loopback), ("netns", args.no_netns)) if not off]
    skipped: dict[str, str] = {}
    if "netns" in settings:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if stale := Netns.remove_stale():
                print(f"removed namespaces left by a killed earlier run: {' '.join(stale)}", flush=True)
        why = Netns.available()
        if why is not None:
            settings.remove("netns")
            skipped["netns"] = why
            print(f"skipping the netns setting: {why}", flush=True)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    t_start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-join-")))
            workdir.mkdir(parents=True, exist_ok=True)
            for setting in settings:
                print(f"{setting}: {nbytes / MB:.1f} MB state, donors {args.donor_counts}, {args.repeat} repeat(s)"
                      + (f", donor egress {args.rate}" if setting == "netns" else ""), flush=True)
                try:
                    records = run_setting(setting, args, workdir)
                except RuntimeError as e:
                    errors[setting] = str(e)
                    print(f"{setting} failed: {e}", flush=True)
                    continue
                rows += summarize(records, setting, args.donor_counts, nbytes,
                                  rate_bps if setting == "netns" else None)
    except (KeyboardInterrupt, _Interrupted) as e:
        print(f"interrupted ({type(e).__name__} {e}); all peers and namespaces were removed", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)

    print()
    print_table(rows)
    print(f"\nstate {nbytes / MB:.1f} MB ({nbytes} B, numel {numel_for(args.size_mb)} x 2 fp32); seconds = median "
          f"of {args.repeat}; bound = bytes / (donors x {args.rate}) (netns only); ratio = seconds / bound; "
          f"'vs 1 donor' = seconds / the same setting's 1-donor seconds; cpu busy = machine cores busy during "
          f"the download (of {os.cpu_count()}); total {time.monotonic() - t_start:.0f} s")
    print("\nwhere the time went (medians, s): manifest = until the manifest arrived; pieces = first piece "
          "request to last piece; after = last piece to return (assemble); piece = one 1-piece request; "
          "tail idle = mean time a donor's link idles at the end")
    for r in rows:
        ph = r.get("phases") or {}
        if ph:
            print(f"  {r['setting']:<9} {r['donors']} donor(s): manifest {ph['manifest_s']:.3f}  pieces "
                  f"{ph['pieces_s']:.3f}  after {ph['after_s']:.3f}  piece {ph['piece_median_s']:.3f}  "
                  f"tail idle {ph['tail_idle_s']:.3f}")
    for setting in dict.fromkeys(r["setting"] for r in rows):
        warm = next((r["warmup_s"] for r in rows if r["setting"] == setting and r.get("warmup_s")), None)
        bg = next((r["background_cores_busy"] for r in rows if r["setting"] == setting), None)
        print(f"{setting}: untimed warm-up (cold first download from all {max(args.donor_counts)} donors) "
              f"took {_fmt(warm, '.2f')} s; other load before the setting started: {_fmt(bg, '.2f')} cores busy")
    for setting, why in {**skipped, **errors}.items():
        print(f"{setting}: {why.splitlines()[0] if why else why}")
    verified = bool(rows) and all(r["verified"] for r in rows)
    if args.json:
        print(json.dumps({"size_mb": args.size_mb, "bytes": nbytes, "numel": numel_for(args.size_mb),
                          "rate": args.rate, "rate_bps": rate_bps, "repeat": args.repeat,
                          "donors": args.donor_counts, "per_donor": args.per_donor, "piece_kib": args.piece_kib,
                          "cpus": os.cpu_count(), "results": rows, "verified": verified,
                          "skipped": skipped, "errors": errors}))
    return 0 if verified and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
