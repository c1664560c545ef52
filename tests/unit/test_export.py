"""``peer export`` (peer/export.py): a checkpoint as a Hugging Face folder that transformers loads and
that computes the same logits as the peer's own model; byte-level tokenization kept exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.export import export_run, save_spec
from hivetrain.peer.state import checkpoint
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.train.diloco import copy_params_to_flat
from hivetrain.peer.train.model import build_model, count_parameters

RUN = "exp-tiny.abcdefghijklmnopqrstuvwxyz234567"


def _trained_state(tmp_path: Path) -> tuple[RunSpec, torch.nn.Module, Path]:
    """A state folder as a peer leaves it: the verified spec and a checkpoint of a (perturbed) model."""
    spec = RunSpec.from_preset("exp", "tiny")
    model = build_model(spec.model, seed=7)
    with torch.no_grad():  # not the init any more: norms and every matrix moved
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    n = count_parameters(model)
    master = copy_params_to_flat(model.parameters(), torch.empty(n))
    ckpt = tmp_path / "state" / "checkpoints"
    ckpt.mkdir(parents=True)
    checkpoint.write(str(ckpt / f"{RUN}.ckpt"), Snapshot.of(12, master, torch.zeros(n)))
    save_spec(str(ckpt), RUN, spec)
    return spec, model, tmp_path / "state"


def test_exported_folder_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    spec, model, state = _trained_state(tmp_path)
    done = export_run(RUN, str(state), str(tmp_path / "out"))
    assert done["round"] == 12
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    idx = torch.randint(0, 256, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model.eval()(idx)
        theirs = hf(idx).logits
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=2e-4, rtol=1e-4), (theirs - ours).abs().max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.99
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    text = "Hello, wörld \U0001f600\n\ttabs"
    assert tok(text)["input_ids"] == list(text.encode())  # token i is byte i, as the peers trained
    assert tok.decode(list(text.encode())) == text


def test_export_refuses_what_it_cannot_do_in_one_line(tmp_path: Path) -> None:
    _, _, state = _trained_state(tmp_path)
    with pytest.raises(ConfigError, match=r"no checkpoint of run other.*\(peer start --join \.\.\.\)"):
        export_run("other.abcdefghijklmnopqrstuvwxyz234567", str(state), str(tmp_path / "x"))
    (state / "checkpoints" / f"{RUN}.ckpt").unlink()  # a spec, but no round finished here (review case 44)
    with pytest.raises(ConfigError, match="it never finished a round here"):
        export_run(RUN, str(state), str(tmp_path / "x"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export_run(RUN, str(state), str(tmp_path / "full"))
    out = subprocess.run([sys.executable, "-m", "hivetrain.peer.cli", "export", "--run", "nope.x", "--out",
                          str(tmp_path / "y"), "--state-dir", str(state)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().startswith("error: --run: run key 'nope.x' is malformed"), out.stderr


def test_export_takes_only_a_run_key_and_ignores_its_case(tmp_path: Path) -> None:
    """The key names files in the state folder: a path in its place (review N15) must not reach them."""
    spec, _, state = _trained_state(tmp_path)
    planted = tmp_path / "elsewhere"
    planted.mkdir()
    save_spec(str(planted), "planted", spec)  # a spec outside the state folder, as an attacker would leave it
    assert (planted / "planted.spec.json").exists()
    for key in ("../../elsewhere/planted", f"../checkpoints/{RUN}", "exp-tiny.x/../" + RUN.split(".")[1]):
        with pytest.raises(ConfigError, match="is malformed"):
            export_run(key, str(state), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    done = export_run(f"  {RUN.upper()} ", str(state), str(tmp_path / "upper"))  # as pasted, in capitals
    assert done["round"] == 12 and (tmp_path / "upper" / "model.safetensors").exists()


def test_a_run_started_again_with_other_settings_is_refused_naming_the_flags(tmp_path: Path) -> None:
    """``--new-run NAME`` again, with the same owner key, is the same run key: another spec published
    under it would change the run under its peers (found while writing the README: an owner started
    with --sync-every 4, restarted without it, republished H=20 and resumed the H=4 checkpoint)."""
    from hivetrain.peer.app import _same_run

    ckpt = str(tmp_path)
    started = RunSpec.from_preset("exp-tiny", "tiny", sync_every=4)
    _same_run(ckpt, RUN, started)  # a run never started here: nothing to compare
    save_spec(ckpt, RUN, started)
    _same_run(ckpt, RUN, RunSpec.from_preset("exp-tiny", "tiny", sync_every=4))  # the same flags again
    with pytest.raises(ConfigError) as e:
        _same_run(ckpt, RUN, RunSpec.from_preset("exp-tiny", "small"))
    text = str(e.value)
    assert "was started here with other settings: --preset/--model as before (its model differs)" in text, text
    assert "--sync-every 4 (now 50)" in text and "another name" in text and "\n" not in text, text
