"""Rough edges a new user hits, found by trying the CLI as one would (step 10): each is one clear line
and a documented exit code, before anything is started or published."""

from __future__ import annotations

from pathlib import Path

from .conftest import run_cli, wait_until

UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _one_line(result, code: int = 2) -> str:  # type: ignore[no-untyped-def]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return str(lines[0])


def test_joining_without_initial_peers_says_so_at_once(tmp_path: Path) -> None:
    line = _one_line(run_cli("start", "--run", "demo." + "a" * 32, "--state-dir", str(tmp_path)))
    assert "needs its join string (--join hivetrain://" in line and "or --initial-peers MADDR" in line, line
    assert not (tmp_path / "identity.key").exists()  # refused before anything started


def test_a_metrics_file_in_a_missing_folder_and_a_bad_identity_are_refused_before_anything_starts(
        tmp_path: Path) -> None:
    line = _one_line(run_cli("start", "--new-run", "edges", "--metrics-file", str(tmp_path / "nope" / "m.jsonl"),
                             "--state-dir", str(tmp_path)))
    assert "does not exist" in line and not (tmp_path / "owners").exists()
    bad = tmp_path / "id.pem"
    bad.write_text("not a key\n")
    line = _one_line(run_cli("start", "--new-run", "edges", "--identity", str(bad), "--state-dir", str(tmp_path)))
    assert "is not a PEM private key" in line and not (tmp_path / "owners").exists()


def test_an_upper_case_run_key_is_the_same_key(tmp_path: Path) -> None:
    # base32 is case-insensitive: the key is accepted, and the error is the unreachable peer, not the key
    line = _one_line(run_cli("start", "--run", "DEMO." + "A" * 32, "--initial-peers", UNREACHABLE, "--dht-timeout",
                             "5", "--state-dir", str(tmp_path)), code=1)
    assert "nothing listens at 127.0.0.1 port 9" in line, line


def test_a_malformed_address_shows_the_right_form(tmp_path: Path) -> None:
    for bad in ("garbage", "/ip4/203.0.113.5/tcp/31337"):
        line = _one_line(run_cli("start", "--run", "demo." + "a" * 32, "--initial-peers", bad,
                                 "--state-dir", str(tmp_path)))  # a usage error: exit code 2
        assert repr(bad) in line and "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW" in line, line


def test_version_and_exit_codes_are_documented() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("peer 0."), version
    helped = run_cli("--help")
    text = " ".join(helped.stdout.split())  # (argparse wraps the epilog)
    assert helped.returncode == 0 and "exit codes: 0 done" in text and "2 a usage" in text and "130 stopped" in text


def test_a_joiner_counts_max_rounds_from_where_it_starts_and_may_not_change_the_runs_spec(swarm, tmp_path: Path) -> None:
    # rounds of a few seconds: a joiner's vote needs the state an attester announced to still be served
    owner = swarm("p0", "--new-run", "later", "--sync-every", "20", "--until-round", "10", "--quiet",
                  "--target-group-size", "2", "--matchmaking-timeout", "4")
    info = owner.wait_info()
    wait_until(lambda: len(owner.records()) >= 3, [owner], 120, "3 rounds of the owner")
    join = ["--run", info["run_key"], "--initial-peers", info["maddrs"][0], "--dht-timeout", "10"]
    # run-spec flags: the same value as the run's is fine; another is refused, in one line, before training
    line = _one_line(run_cli("start", *join, "--sync-every", "8", "--allreduce-timeout", "60", "--state-dir",
                             str(tmp_path / "a")))
    assert "--sync-every 8 (the run's: 20)" in line and "allreduce" not in line, line
    line = _one_line(run_cli("start", *join, "--preset", "small", "--state-dir", str(tmp_path / "b")))
    assert "--preset small" in line and "owner's choice" in line, line
    # --max-rounds 1 on a run past round 3: one round of this process, not "round 1 is behind us, done"
    joiner = swarm("p1", *join, "--sync-every", "20", "--max-rounds", "1", "--quiet")
    assert joiner.wait(180) == 0, joiner.log.read_text()[-3000:]
    rounds = joiner.records()
    assert len(rounds) == 1 and rounds[0]["round"] >= 3, rounds
    assert joiner.records("sync"), joiner.records("start")  # it took the run's state first


def test_a_second_peer_on_a_state_folder_in_use_is_told_to_take_its_own(swarm, tmp_path: Path) -> None:
    owner = swarm("p0", "--new-run", "twice", "--quiet", "--until-round", "1000")
    info = owner.wait_info()
    state = str(tmp_path / "p0-state")  # the owner's (conftest's naming)
    line = _one_line(run_cli("start", "--run", info["run_key"], "--initial-peers", info["maddrs"][0],
                             "--state-dir", state))
    assert "another peer is using the state folder" in line and f"--state-dir {state}-2" in line, line
    assert owner.proc.poll() is None  # and the first peer trains on
