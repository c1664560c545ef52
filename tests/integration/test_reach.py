"""Coming back after a restart, and the connectivity errors a user sees (peer/reach.py, dht/diagnose.py),
with real peers on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open

from .conftest import run_cli, wait_until

FAST = ["--sync-every", "4", "--allreduce-timeout", "12"]
OTHER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(result) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return str(lines[0])


def test_a_restarted_owner_is_the_same_peer_at_the_same_address_and_rejoins(swarm) -> None:
    """The run owner killed and started again with the same command: same peer id, same address, same
    run key; the join line it printed before still works, and its old partner groups with it again."""
    owner_cmd = ["--new-run", "comeback", "--target-group-size", "3", "--matchmaking-timeout", "4",
                 "--until-round", "400", "--quiet", *FAST]
    owner = swarm("p0", *owner_cmd)
    before = owner.wait_info()
    join = ["--run", before["run_key"], "--initial-peers", before["maddrs"][0], "--until-round", "400", "--quiet", *FAST]
    p1 = swarm("p1", *join)
    wait_until(lambda: any(r["group_size"] == 2 for r in p1.records()), [owner, p1], 120, "a round of the pair")
    owner.kill()
    owner.info.unlink()
    rounds_at_restart = len(p1.records())

    again = swarm("p0", *owner_cmd)  # the same command: the same state folder
    after = again.wait_info()
    assert (after["peer_id"], after["maddrs"][0], after["run_key"]) == (before["peer_id"], before["maddrs"][0],
                                                                          before["run_key"])
    wait_until(lambda: any(before["peer_id"] in r["group"] for r in p1.records()[rounds_at_restart:]),
               [again, p1], 150, "the restarted owner back in a group with its partner")
    p2 = swarm("p2", *join)  # the join line printed before the restart
    assert p2.wait_info()["run_key"] == before["run_key"]


def test_a_port_in_use_is_one_clear_line(swarm, tmp_path: Path) -> None:
    port = free_port()
    owner = swarm("p0", "--new-run", "busy", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--until-round", "400",
                  "--quiet")
    owner.wait_info()
    line = one_line(run_cli("start", "--new-run", "busy2", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                            "--state-dir", str(tmp_path / "other")))
    assert f"port {port} on 127.0.0.1 is already in use" in line, line


def test_bootstrap_errors_say_what_is_wrong_in_plain_words(swarm, tmp_path: Path) -> None:
    owner = swarm("p0", "--new-run", "plain", "--until-round", "400", "--quiet")
    maddr = owner.wait_info()["maddrs"][0]
    wrong_id = maddr.rsplit("/p2p/", 1)[0] + "/p2p/" + OTHER_ID
    line = one_line(run_cli("start", "--run", "plain." + "a" * 32, "--initial-peers", wrong_id, "--dht-timeout", "5",
                            "--state-dir", str(tmp_path / "a")))
    assert "accepts connections, but no libp2p peer 12D3KooWDpJ7As7B" in line and "daemon" not in line.lower(), line
    closed = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{OTHER_ID}"
    line = one_line(run_cli("start", "--run", "plain." + "a" * 32, "--initial-peers", closed, "--dht-timeout", "5",
                            "--state-dir", str(tmp_path / "b")))
    assert "nothing listens at 127.0.0.1 port" in line and "daemon" not in line.lower(), line


def test_a_stock_hivemind_dht_node_works_as_the_initial_peer(swarm, tmp_path: Path) -> None:
    """``hivemind-dht`` from the hivemind package (no hivetrain code) as the only bootstrap node: the
    owner publishes its run through it, a joiner finds the spec and the owner through it, and they train."""
    log = tmp_path / "stock.log"
    with open(log, "wb") as out:
        stock = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "hivemind-dht"), "--host_maddrs",
                                  "/ip4/127.0.0.1/tcp/0", "--refresh_period", "5"], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"--initial_peers (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)",
                                      re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")))):
            assert stock.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        stock_maddr = found.group(1)
        rounds = ["--until-round", "3", "--wait-for-peers", "2", "--target-group-size", "2", "--quiet", *FAST]
        owner = swarm("p0", "--new-run", "stock", "--initial-peers", stock_maddr, *rounds)
        run_key = owner.wait_info()["run_key"]
        joiner = swarm("p1", "--run", run_key, "--initial-peers", stock_maddr, *rounds)
        for p in (owner, joiner):
            assert p.wait(180) == 0, p.log.read_text()[-3000:]
        owner_id = owner.records("start")[0]["peer_id"]
        assert any(not r["void"] and owner_id in r["group"] and r["group_size"] == 2 for r in joiner.records()), \
            joiner.records()
        # the joiner's last state, exported offline as a Hugging Face folder (peer/export.py)
        out = run_cli("export", "--run", run_key, "--out", str(tmp_path / "hf"), "--state-dir",
                      str(tmp_path / "p1-state"))
        assert out.returncode == 0, out.stderr[-2000:]
        last = joiner.records()[-1]
        assert f"state {last['state_hash'][:12]}" in out.stdout and "from_pretrained" in out.stdout, out.stdout
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            assert f.metadata()["state_hash"] == last["state_hash"]
    finally:
        os.killpg(stock.pid, signal.SIGKILL)
        stock.wait(10)


def test_a_model_that_will_not_fit_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """A simulated 2 GiB device and the user's own micro-batch of 32 (the whole batch): the medium
    preset does not fit; the error says what would. (Without the flag the plan chooses micro-batches
    of 1 by itself: tests/unit/test_memory.py.)"""
    line = one_line(run_cli("start", "--new-run", "big", "--preset", "medium", "--memory-limit", "2",
                            "--micro-batch", "32", "--state-dir", str(tmp_path / "s")))
    assert "will not fit cpu with --micro-batch 32" in line and "pass --micro-batch 1" in line, line
    assert line.endswith("; or raise --memory-limit (now 2 GiB)"), line
    assert not (tmp_path / "s").exists()  # refused before the state folder, the daemon or the DHT
