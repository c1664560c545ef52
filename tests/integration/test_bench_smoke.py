"""``python -m bench.convergence --quick`` at an even smaller size: it runs and writes well-formed outputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["ddp", "diloco_fp32_H5", "diloco_int8_H5", "diloco_int8_H5_delayed", "diloco_int8_H5_eager",
            "diloco_fp32_H10", "diloco_int8_H10", "diloco_int8_H10_delayed", "diloco_int8_H10_eager", "sparse_H10"]
KEYS = {"variant", "H", "tokens", "final_eval_loss_mean", "final_eval_loss_std", "seeds", "bytes_per_worker",
        "bytes_ratio_vs_ddp", "curve"}


def test_convergence_quick_smoke(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="bench.convergence draws plot.png with matplotlib")
    cmd = [sys.executable, "-m", "bench.convergence", "--quick", "--out", str(tmp_path), "--steps", "10", "--no-default",
           "--seeds", "2", "--batch-size", "2", "--eval-batches", "1", "--threads", "1", "--overlap"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[diloco_int8_H5 seed 1] round 2/2" in result.stderr  # progress on stderr

    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in results] == VARIANTS
    for r in results:
        assert KEYS <= set(r), f"{r['variant']} lacks {KEYS - set(r)}"
        assert r["seeds"] == [0, 1] and len(r["final_eval_loss_per_seed"]) == 2
        assert r["tokens"] == 10 * 2 * 2 * 128  # steps * workers * batch * seq_len, the same for every variant
        for key in ("final_eval_loss_mean", "final_eval_loss_std", "bytes_per_worker", "bytes_ratio_vs_ddp"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (r["variant"], key, r[key])
        assert 0 < r["final_eval_loss_mean"] < math.log(256) + 0.5
        curve = r["curve"]
        assert curve[0][0] == 0 and curve[-1][0] == r["tokens"]
        assert all(len(p) == 3 and all(math.isfinite(v) for v in p) for p in curve)
        assert [p[0] for p in curve] == sorted({p[0] for p in curve})
        assert curve[-1][1] == pytest.approx(r["final_eval_loss_mean"])
    ddp, fp32_h5, int8_h5, delayed_h5, eager_h5, fp32_h10, int8_h10, delayed_h10, eager_h10, sparse_h10 = results
    assert ddp["H"] is None and ddp["bytes_ratio_vs_ddp"] == 1.0
    assert len(ddp["curve"]) == 3  # 0, 5 and 10 steps: the token counts of every DiLoCo round
    assert (fp32_h5["H"], len(fp32_h5["curve"]), len(fp32_h10["curve"])) == (5, 3, 2)
    # audits (the run spec's default) send every part to a second member too: 1.5x a plain all-reduce
    assert fp32_h5["bytes_ratio_vs_ddp"] == pytest.approx(1.5 / 5)
    assert fp32_h10["bytes_ratio_vs_ddp"] == pytest.approx(1.5 / 10)
    assert int8_h5["bytes_ratio_vs_ddp"] == pytest.approx(1.5 / 20, rel=0.01)
    assert int8_h10["bytes_ratio_vs_ddp"] == pytest.approx(1.5 / 40, rel=0.01)
    # sparse: 64 of every 4096 values (the tiny vector's shards have a short last chunk), results for 2 members
    assert sparse_h10["codec"] == "sparse" and sparse_h10["bytes_ratio_vs_ddp"] < int8_h10["bytes_ratio_vs_ddp"] / 5
    assert sparse_h10["final_eval_loss_per_seed"] != int8_h10["final_eval_loss_per_seed"]
    for overlapped, sync in ((delayed_h5, int8_h5), (eager_h5, int8_h5), (delayed_h10, int8_h10), (eager_h10, int8_h10)):
        assert overlapped["bytes_per_worker"] == sync["bytes_per_worker"]  # the same rounds, applied later
    # one round (H10): the drain applies it, so overlapped ends exactly where synchronous does; two rounds
    # (H5): the second round's inner steps started elsewhere
    assert delayed_h10["final_eval_loss_per_seed"] == eager_h10["final_eval_loss_per_seed"] == int8_h10[
        "final_eval_loss_per_seed"]
    assert delayed_h5["final_eval_loss_per_seed"] != int8_h5["final_eval_loss_per_seed"] != eager_h5[
        "final_eval_loss_per_seed"]

    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and len(png) > 20_000

    md = (tmp_path / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    for name in VARIANTS:
        assert sum(line.startswith(f"| {name} |") for line in rows) == 1, md
    assert "overlapped − synchronous int8" in md and "| 10 | eager |" in md


def test_convergence_sweep_picks_the_best_ddp_and_runs_the_shipped_default(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="bench.convergence draws plot.png with matplotlib")
    cmd = [sys.executable, "-m", "bench.convergence", "--quick", "--out", str(tmp_path), "--steps", "20", "--H", "20",
           "--seeds", "2", "--batch-size", "2", "--eval-batches", "1", "--threads", "1", "--inner-lrs", "0.0003,0.004",
           "--warmup", "4", "--schedule", "cosine"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(rows) == {"ddp", "ddp_lr0.0003", "ddp_lr0.004", "diloco_fp32_H20_lr0.0003", "diloco_fp32_H20_lr0.004",
                         "diloco_int8_H20_lr0.0003", "diloco_int8_H20_lr0.004", "sparse_H20", "default"}
    swept = [rows["ddp_lr0.0003"], rows["ddp_lr0.004"]]
    best = min(swept, key=lambda r: r["final_eval_loss_mean"])
    assert rows["ddp"]["picked"] == best["variant"] and rows["ddp"]["final_eval_loss_mean"] == best["final_eval_loss_mean"]
    assert swept[0]["final_eval_loss_mean"] != swept[1]["final_eval_loss_mean"]  # the rate really changed
    assert all(r["inner_schedule"] == "cosine" and r["inner_warmup"] == 4 for r in swept)
    default = rows["default"]  # the run spec's defaults, whatever the sweep: no schedule, the preset's H and rate
    assert (default["H"], default["codec"], default["aggregation"], default["audit"]) == (20, "int8", "robust", True)
    assert (default["inner_schedule"], default["inner_warmup"], default["inner_lr"]) == ("constant", 0, 2e-3)
    assert default["bytes_ratio_vs_ddp"] == pytest.approx(1.5 / 80, rel=0.01)
