"""Names in a run folder that are not plain `checkpoint_step_N`: found while annotating checkpoint/
(mypy: a step is `int | None`, and `auto` needs a run folder)."""
import json
import os

from checkpoint import checkpointer as ck
from checkpoint.__main__ import main as checkpoint_cli
from checkpoint.manifest import digest_files, list_files

GOOD = {"weights_finite": True, "loss_finite": True}


def sealed(run, step):
    path = run / f"checkpoint_step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    ck.seal(str(path), step, digest_files(str(path), list_files(str(path), ck.NOT_LISTED)), GOOD, 1)
    return str(path)


def test_verify_lists_a_run_beside_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    good = sealed(tmp_path, 2)
    (tmp_path / "checkpoint_step_2.old").mkdir()  # a user's copy: its name has no step
    assert checkpoint_cli(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"OK          {good}" in out and "1 of 1 checkpoints are whole" in out and ".old" not in out


def test_an_explicit_run_folder_named_auto_is_a_folder(tmp_path, monkeypatch):
    """Inference passes no run folder: `--checkpoint auto` names the folder `auto`, as any other path."""
    newest = sealed(tmp_path / "auto", 3)
    sealed(tmp_path / "auto", 1)
    monkeypatch.chdir(tmp_path)
    assert ck.resolve_resume_path("auto", None, key="--checkpoint") == os.path.relpath(newest, tmp_path)
    assert ck.resolve_resume_path("auto", str(tmp_path / "auto")) == newest  # a run's `auto`: as before
