"""Every user mistake is one line on stderr and exit code 2, before anything starts or is published
(peer/cli.py): the cases of the UX review of 2026-12-02 that ended in a traceback, a wrong exit code,
an accepted bad value or an internal field name. In-process: ``main`` with argv lists; the modules that
would start torch, the p2p daemon or peer processes are made unimportable, so a check that came too
late fails the test with an ImportError instead of starting anything."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from hivetrain.peer import cli, flags
from hivetrain.peer.config import PRESET_NAMES, flag_knobs
from hivetrain.peer.errors import ConfigError

RUN_KEY = "demo." + "a" * 32
PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture(autouse=True)
def _nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """No logging or signal set-up in the test process, and no module that starts anything."""
    monkeypatch.setattr(cli, "_quiet_libraries", lambda verbose: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    for name in ("hivetrain.peer.app", "hivetrain.peer.status", "hivetrain.peer.demo"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``peer ARGV``: exit code 2, nothing on stdout, one 'error:' line on stderr; returns it."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and not out, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _start(tmp_path: Path, *flags: str) -> list[str]:
    port = [] if {"--port", "--host-maddrs"} & set(flags) else ["--port", "0"]  # (31337 may be in use here)
    return ["start", "--new-run", "x", "--state-dir", str(tmp_path / "state"), *port, *flags]


# ---- files the run writes: refused before the run is announced (review cases 40-42) --------------


def test_a_metrics_file_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, "--metrics-file", str(tmp_path)), capsys)
    assert f"--metrics-file {tmp_path}: that is a folder" in line and "metrics.jsonl" in line, line
    assert not (tmp_path / "state").exists()  # nothing started: no identity, no lock, no run


def test_a_metrics_file_in_an_unwritable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root writes anyway: the refusal it would get without CAP_DAC_OVERRIDE
        def refuse(path: str, mode: str = "r") -> None:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

        monkeypatch.setattr(flags, "open", refuse, raising=False)
    line = _one_line(_start(tmp_path, "--metrics-file", str(folder / "m.jsonl")), capsys)
    assert f"--metrics-file {folder / 'm.jsonl'}: cannot write there (Permission denied)" in line, line
    assert not (tmp_path / "state").exists()


def test_an_info_file_in_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, "--info-file", str(tmp_path / "nofolder" / "i.json")), capsys)
    assert f"--info-file {tmp_path / 'nofolder' / 'i.json'}: the folder {tmp_path / 'nofolder'} does not exist" in line
    assert not (tmp_path / "state").exists()


def test_an_info_file_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, "--info-file", str(tmp_path)), capsys)
    assert f"--info-file {tmp_path}: that is a folder" in line, line


def test_writable_files_pass_and_the_probes_leave_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "old.jsonl").write_text('{"round": 0}\n')
    for metrics in ("new.jsonl", "old.jsonl"):
        args = cli.build_parser().parse_args(_start(tmp_path, "--metrics-file", str(tmp_path / metrics),
                                                    "--info-file", str(tmp_path / "i.json")))
        flags.check_start(args)
    assert sorted(os.listdir(tmp_path)) == ["old.jsonl"]
    assert (tmp_path / "old.jsonl").read_text() == '{"round": 0}\n'


# ---- durations and counts (review cases 51, 56, 61, 63) -------------------------------------------


@pytest.mark.parametrize("flags, named", [
    (["--wait-timeout", "-1", "--wait-for-peers", "2"], "--wait-timeout must be a positive number of seconds, got -1.0"),
    (["--wait-timeout", "0"], "--wait-timeout must be a positive number of seconds, got 0.0"),
    (["--wait-timeout", "nan"], "--wait-timeout must be a positive number of seconds, got nan"),
    (["--max-rounds", "-1"], "--max-rounds must be an integer in [0, 10000000], got -1"),
    (["--until-round", "-1"], "--until-round must be"),
    (["--threads", "-1"], "--threads must be"),
    (["--wait-for-peers", "0"], "--wait-for-peers must be an integer in [1, 64], got 0"),
    (["--dht-timeout", "0"], "--dht-timeout must be a number in [0.1, 600.0], got 0.0"),
    (["--eval-batches", "-1"], "--eval-batches must be"),
    (["--micro-batch", "-1"], "--micro-batch must be"),
    (["--memory-limit", "-1"], "--memory-limit must be a number in [0.0, 1000000.0], got -1.0"),
])
def test_a_bad_duration_or_count_of_this_peer(flags: list[str], named: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, *flags), capsys)
    assert line.startswith(f"error: {named}"), line
    assert "peer." not in line and "_" not in line, line


def test_a_joiners_bad_wait_timeout_is_refused_before_it_bootstraps(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(["start", "--run", RUN_KEY, "--initial-peers", PEER, "--wait-timeout", "-1",
                      "--state-dir", str(tmp_path)], capsys)
    assert "--wait-timeout" in line, line


@pytest.mark.parametrize("flags, named", [
    (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5.0"),
    (["--eval-batches", "-1"], "--eval-batches must be an integer in [0, 10000], got -1"),
    (["--sync-every", "0"], "--sync-every must be an integer in [1, 100000], got 0"),
])
def test_a_bad_demo_flag_is_refused_before_any_peer_is_spawned(flags: list[str], named: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert _one_line(["demo", *flags], capsys) == f"error: {named}"


@pytest.mark.parametrize("flags, named", [
    (["--dht-timeout", "0"], "--dht-timeout must be a number in [0.1, 600.0], got 0.0"),
    (["--interval", "0"], "--interval must be a positive number of seconds, got 0.0"),
    (["--count", "-1"], "--count must be 0 or more, got -1"),
])
def test_a_bad_status_flag_is_refused_before_the_dht_starts(flags: list[str], named: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _one_line(["status", "--run", RUN_KEY, "--initial-peers", PEER, *flags], capsys) == f"error: {named}"


# ---- --data: every error is exit code 2 (review cases 19-28) --------------------------------------


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "nope.txt", "does not exist"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "has no text files"),
    (lambda d: d / "*.nothing", "matches no files"),
    (lambda d: (d / "tiny.txt").write_text("abc") and d / "tiny.txt", "too little text"),
    (lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9 " * 20000) and d / "latin1.txt", "not valid UTF-8"),
    (lambda d: (d / "blob.bin").write_bytes(b"PK\0\x03" * 5000) and d / "blob.bin", "looks binary (a NUL byte"),
])
def test_every_data_error_is_exit_code_2(make, expected: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from hivetrain.peer.train.data import load_corpus

    # the corpus is read where run_peer reads it; here without the DHT around it
    monkeypatch.setattr(cli, "cmd_start", lambda args: load_corpus(args.data))
    path = make(tmp_path)
    line = _one_line(_start(tmp_path, "--data", str(path)), capsys)
    assert expected in line and str(path) in line, line


@pytest.mark.parametrize("name, expected", [("nope.txt", "does not exist"), ("*.nothing", "matches no files")])
def test_a_data_path_that_leads_nowhere_is_refused_before_anything_starts(
        name: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, "--data", str(tmp_path / name)), capsys)  # (cmd_start's modules: unimportable)
    assert expected in line and str(tmp_path / name) in line, line
    assert not (tmp_path / "state").exists()


# ---- --preset and the run-spec flags (review cases 1, 49, 51-53, 62) ------------------------------


@pytest.mark.parametrize("command", [["start", "--new-run", "x"], ["demo"]])
def test_an_unknown_preset_lists_every_preset(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line([*command, "--preset", "huge"], capsys)
    assert line == f"error: unknown preset 'huge'; choose one of {', '.join(PRESET_NAMES)}", line
    assert "smollm2-135m" in line and "tiny" in line


@pytest.mark.parametrize("flags, named", [
    (["--sync-every", "0"], "--sync-every must be an integer in [1, 100000], got 0"),
    (["--sync-every", "-5"], "--sync-every must be an integer in [1, 100000], got -5"),
    (["--inner-lr", "-0.1"], "--inner-lr must be a number in [1e-07, 1.0], got -0.1"),
    (["--batch-size", "0"], "--batch-size must be an integer in [1, 4096], got 0"),
    (["--eval-every", "0"], "--eval-every must be"),
    (["--sparse-k", "0"], "--sparse-k must be"),
    (["--piece-values", "0"], "--piece-values must be"),
    (["--matchmaking-timeout", "-1"], "--matchmaking-timeout must be"),
    (["--allreduce-timeout", "0"], "--allreduce-timeout must be"),
    (["--seq-len", "100000"], "--seq-len must be an integer in [8, 128], got 100000"),
    (["--min-group-size", "10", "--target-group-size", "4"], "--min-group-size must be an integer in [1, 4], got 10"),
    (["--inner-schedule", "cosine"], "--inner-schedule 'cosine' needs --inner-total-steps above --inner-warmup (0)"),
    (["--outer-momentum", "1"], "--outer-momentum must be"),
])
def test_a_bad_run_spec_flag_is_named_as_the_flag(flags: list[str], named: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, *flags), capsys)
    assert line.startswith(f"error: {named}"), line
    assert "spec." not in line and "_" not in line, line
    assert not (tmp_path / "state").exists()


def test_the_spec_flags_of_a_run_on_a_hugging_face_model_are_checked_too(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(_start(tmp_path, "--preset", "smollm2-135m", "--sync-every", "0"), capsys)
    assert line == "error: --sync-every must be an integer in [1, 100000], got 0", line


def test_errors_about_fields_no_flag_sets_keep_their_names() -> None:
    assert str(flags.in_flags(ConfigError("spec.hf_config lacks vocab_size"))) == "spec.hf_config lacks vocab_size"
    assert str(flags.in_flags(ConfigError("run name 'a b' is invalid"))) == "run name 'a b' is invalid"


# ---- a mistyped run key or a port in use: refused before bootstrap (review cases 13, 29) --------------


@pytest.mark.parametrize("command", [["start", "--run", "not-a-key", "--initial-peers", PEER],
                                     ["status", "--run", "Foo.!!!!", "--initial-peers", PEER]])
def test_a_malformed_run_key_is_refused_before_bootstrap(command: list[str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # (the initial peer is dead: before, its "nothing listens" hid the mistyped key, exit 1)
    extra = ["--state-dir", str(tmp_path / "state")] if command[0] == "start" else []
    line = _one_line(command + extra, capsys)
    assert line.startswith("error: --run: run key") and "is malformed" in line, line
    assert not (tmp_path / "state").exists()


def test_a_listen_port_in_use_is_refused_before_the_daemon_starts(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _one_line(_start(tmp_path, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"), capsys)
    assert f"port {port} on 127.0.0.1 is already in use" in line, line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("knob", [f for f in flag_knobs() if "lo" in f.metadata], ids=lambda f: f.name)
def test_every_run_spec_knob_is_a_flag_whose_range_error_names_it(knob: Any, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Step 15 item 8: a knob is declared once (peer/config.py ``knob``); its flag, help and range
    check come from that declaration, and a value out of its range is one line naming the flag."""
    flag = "--" + knob.name.replace("_", "-")
    assert flag in cli.build_parser().format_help() or flag in _start_help()
    below = knob.metadata["lo"] - 1
    line = _one_line(_start(tmp_path, flag, str(int(below) if knob.type == "int" else below)), capsys)
    assert f"{flag} must be" in line and "spec." not in line, line
    assert not (tmp_path / "state").exists()


def _start_help() -> str:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return str(action.choices["start"].format_help())
