"""The records of closed-loop evaluations in checkpoint folders (checkpoint/evaluations.py): planted
checkpoints with planted reports, no training. Verification and `auto` ignore the records; the `best`
pointer; retention keeps the best checkpoint and those being evaluated; `--which best`."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from checkpoint import checkpointer as ck
from checkpoint import evaluations as ev
from checkpoint.__main__ import main as checkpoint_cli
from checkpoint.state import Document, Registry
from recipe.schema import Config

GOOD = {"weights_finite": True, "loss_finite": True}


def saver(run, limit=None):
    cfg = OmegaConf.structured(Config)
    cfg.system.total_limit = limit
    return ck.Checkpointer(str(run), cfg)


def save(checkpointer, step):
    """A real save (manifest, COMPLETE, `latest`, retention) of two small files."""
    parts = Registry()
    parts.register("config.yaml", Document(lambda path: open(path, "w").write("model: {}\n")))
    parts.register("trainer_state.json", Document(lambda path: open(path, "w").write(json.dumps({"step": step}))))
    return checkpointer.save(step, parts, GOOD)


def plant_report(checkpoint, success_rate, episodes=4):
    os.makedirs(os.path.join(checkpoint, ev.EVAL_DIR), exist_ok=True)
    report = {"task": "transfer_cube", "results": {"policy": {
        "success_rate": success_rate, "successes": round(success_rate * episodes), "episodes": episodes}}}
    with open(ev.report_path(checkpoint), "w") as f:
        json.dump(report, f)


def run_of(tmp_path, steps, limit=None):
    checkpointer = saver(tmp_path, limit)
    return checkpointer, [save(checkpointer, s) for s in steps]


def steps_of(run):
    return [ck.step_of(p) for p in ck.complete_checkpoints(str(run))]


def best_file(run):
    return (run / ev.BEST).read_text() if (run / ev.BEST).exists() else None


def test_verification_and_auto_ignore_the_evaluation_records_and_nothing_else(tmp_path, capsys):
    _, (older, newest) = run_of(tmp_path, [2, 4])
    plant_report(newest, 0.5)
    os.makedirs(os.path.join(newest, ev.EVAL_DIR, "videos"))
    open(os.path.join(newest, ev.EVAL_DIR, "videos", "policy_seed1.mp4"), "wb").write(b"\0" * 10)
    ev.begin_evaluation(newest, ev.default_owner())
    ev.record_failure(newest, "an earlier try died")
    partial = os.path.join(newest, ev.PARTIAL + "x1y2")  # what inference.rollout writes before its rename
    os.makedirs(partial)
    open(os.path.join(partial, "server.log"), "w").write("serving on ws://127.0.0.1:1\n")
    assert ck.verify(newest) == [] and ck.quick_check(newest)[1] == []
    assert ck.resolve_resume_path("auto", str(tmp_path)) == newest
    assert ck.resolve_resume_path(newest, None) == newest
    assert checkpoint_cli(["verify", str(tmp_path)]) == 0
    assert "2 of 2 checkpoints are whole; the newest whole one: " + newest in capsys.readouterr().out
    # the rule names the records only: a stray file beside them, or one named eval deeper down, is not the manifest's
    open(os.path.join(newest, "evaluation.txt"), "w").write("?")
    os.makedirs(os.path.join(newest, "engine", ev.EVAL_DIR))
    open(os.path.join(newest, "engine", ev.EVAL_DIR, "x"), "w").write("?")
    problems = ck.verify(newest)
    assert problems == [f"{newest}/engine/eval/x: not in the manifest", f"{newest}/evaluation.txt: not in the manifest"]
    assert ck.resolve_resume_path("auto", str(tmp_path)) == older


def test_best_is_the_highest_success_the_later_on_a_tie(tmp_path):
    _, paths = run_of(tmp_path, [1, 2, 3, 4, 5])
    assert ev.best_checkpoint(str(tmp_path)) is None
    ev.update_best(str(tmp_path))
    assert best_file(tmp_path) is None
    for path, rate in zip(paths, [0.5, 0.75, 0.75, 0.25]):
        plant_report(path, rate)
    ev.update_best(str(tmp_path))
    assert ev.best_checkpoint(str(tmp_path)) == paths[2] and best_file(tmp_path) == "checkpoint_step_3\n"
    assert ev.read_best(str(tmp_path)) == paths[2]
    # an unreadable report, one without a policy success, and an incomplete folder's report do not count
    os.makedirs(os.path.join(paths[4], ev.EVAL_DIR))
    open(ev.report_path(paths[4]), "w").write("{not json")
    with open(ev.report_path(paths[3]), "w") as f:
        json.dump({"results": {"hold": {"success_rate": 1.0}}}, f)
    for odd in ([], {"results": []}, {"results": {"policy": {"success_rate": "0.9"}}}):
        with open(ev.report_path(paths[1]) + ".odd", "w") as f:
            json.dump(odd, f)
        os.replace(ev.report_path(paths[1]) + ".odd", ev.report_path(paths[1]))
        assert ev.read_report(paths[1]) is None
    plant_report(paths[1], 0.75)
    interrupted = tmp_path / "checkpoint_step_9"
    interrupted.mkdir()
    plant_report(str(interrupted), 1.0)
    assert ev.read_report(paths[4]) is None and ev.read_report(paths[3]) is None
    assert ev.best_checkpoint(str(tmp_path)) == paths[2]
    plant_report(paths[0], 1.0)
    ev.update_best(str(tmp_path))
    assert best_file(tmp_path) == "checkpoint_step_1\n"
    assert sorted(os.listdir(tmp_path)) == [ev.BEST, "checkpoint_step_1", "checkpoint_step_2", "checkpoint_step_3",
                                            "checkpoint_step_4", "checkpoint_step_5", "checkpoint_step_9", "latest"]
    for path in paths:
        ev.discard_partial(path)  # eval/ without a readable report goes; a report stays
    assert [ev.read_report(p) is not None for p in paths] == [True, True, True, False, False]
    assert not os.path.exists(os.path.join(paths[4], ev.EVAL_DIR))
    for path in paths[:3]:
        os.remove(ev.report_path(path))
    ev.update_best(str(tmp_path))
    assert best_file(tmp_path) is None


def test_retention_keeps_the_best_checkpoint_that_total_limit_would_delete(tmp_path):
    checkpointer, (first, second, third) = run_of(tmp_path / "with", [10, 20, 30], limit=2)
    assert steps_of(tmp_path / "with") == [20, 30]  # the limit works: 10 is gone
    plant_report(second, 0.75)
    plant_report(third, 0.5)
    save(checkpointer, 40)
    save(checkpointer, 50)
    assert steps_of(tmp_path / "with") == [20, 50]  # 20 is the best: kept; 30 and 40 went instead
    assert best_file(tmp_path / "with") == "checkpoint_step_20\n"
    plant_report(os.path.join(tmp_path / "with", "checkpoint_step_50"), 0.75)  # a tie: the later one is best
    save(checkpointer, 60)
    assert steps_of(tmp_path / "with") == [50, 60] and best_file(tmp_path / "with") == "checkpoint_step_50\n"
    # the same run without reports keeps the newest only
    checkpointer, _ = run_of(tmp_path / "without", [10, 20, 30, 40, 50], limit=2)
    assert steps_of(tmp_path / "without") == [40, 50] and best_file(tmp_path / "without") is None


def test_retention_keeps_a_checkpoint_with_a_live_marker_only(tmp_path):
    checkpointer, (first, second) = run_of(tmp_path, [1, 2], limit=1)
    assert steps_of(tmp_path) == [2]
    ev.begin_evaluation(second, ev.default_owner())  # this process: alive
    save(checkpointer, 3)
    save(checkpointer, 4)
    assert steps_of(tmp_path) == [2, 4]
    stale = time.time() - ev.STALE_AFTER_S - 1
    os.utime(os.path.join(second, ev.EVALUATING), (stale, stale))  # its owner stopped touching it
    save(checkpointer, 5)
    assert steps_of(tmp_path) == [5]


def test_a_marker_is_live_while_touched_and_its_owner_exists(tmp_path):
    path = str(tmp_path / "checkpoint_step_1")
    os.makedirs(path)
    assert not ev.is_being_evaluated(path)
    ev.begin_evaluation(path, ev.default_owner())
    assert ev.is_being_evaluated(path) and json.load(open(os.path.join(path, ev.EVALUATING)))["owner"] == \
        f"{socket.gethostname()}:{os.getpid()}"
    old = time.time() - 100
    os.utime(os.path.join(path, ev.EVALUATING), (old, old))
    assert ev.is_being_evaluated(path) and not ev.is_being_evaluated(path, stale_after_s=99)
    ev.heartbeat(path)
    assert ev.is_being_evaluated(path, stale_after_s=99)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ev.begin_evaluation(path, f"{socket.gethostname()}:{dead.pid}")  # a follower killed with SIGKILL
    assert not ev.is_being_evaluated(path)
    ev.begin_evaluation(path, f"another-host-{socket.gethostname()}:{dead.pid}")  # only its heartbeat tells
    assert ev.is_being_evaluated(path)
    ev.end_evaluation(path)
    ev.end_evaluation(path)  # twice: no error
    assert not ev.is_being_evaluated(path) and os.listdir(path) == []


def test_a_failure_is_recorded_and_cleared(tmp_path):
    path = str(tmp_path)
    assert ev.read_failure(path) is None
    ev.record_failure(path, "inference.rollout exited with code 1: boom")
    assert ev.read_failure(path) == "inference.rollout exited with code 1: boom" and ev.read_report(path) is None
    ev.clear_failure(path)
    assert ev.read_failure(path) is None


def test_the_rollout_command(tmp_path):
    ckpt = str(tmp_path / "checkpoint_step_4")
    full = {"task": "transfer_cube", "episodes": 2, "seed": 1_000_010, "workers": 3, "videos": 1, "replan": 4,
            "episode_steps": 20, "device": "cuda:1"}
    assert ev.rollout_command(ckpt, full, "/py") == [
        "/py", "-m", "inference.rollout", "--task", "transfer_cube", "--checkpoint", ckpt, "--episodes", "2",
        "--out", f"{ckpt}/eval", "--seed", "1000010", "--workers", "3", "--videos", "1", "--replan", "4",
        "--steps", "20", "--device", "cuda:1", "--baselines", ""]
    least = {"task": "pusht", "episodes": 5, "seed": None, "replan": None, "device": None}
    assert ev.rollout_command(ckpt, least, "py") == [
        "py", "-m", "inference.rollout", "--task", "pusht", "--checkpoint", ckpt, "--episodes", "5",
        "--out", f"{ckpt}/eval", "--baselines", ""]
    with pytest.raises(ValueError, match="needs a 'episodes'"):
        ev.rollout_command(ckpt, {"task": "pusht"}, "py")


# --- --which best --------------------------------------------------------------------------------
def test_which_best_resolves_the_best_file_and_says_when_there_is_none(tmp_path):
    from checkpoint.export import ExportError, source_checkpoint
    from inference.load import CheckpointError, resolve_checkpoint

    run = str(tmp_path)
    _, (first, second, third) = run_of(tmp_path, [1, 2, 3])
    assert resolve_checkpoint(run) == resolve_checkpoint(run, "latest") == third  # the default: as before
    with pytest.raises(CheckpointError, match=re.escape(f"--checkpoint '{run}' has no `best` file: no checkpoint "
                                                        "of it has an evaluation report (eval/report.json)")):
        resolve_checkpoint(run, "best")
    with pytest.raises(ExportError, match=re.escape(f"checkpoint_dir '{run}' has no `best` file")):
        source_checkpoint(run, "best")
    plant_report(first, 0.75)
    plant_report(second, 0.25)
    ev.update_best(run)
    assert resolve_checkpoint(run, "best") == first and resolve_checkpoint(run) == third
    assert source_checkpoint(run, "best") == first and source_checkpoint(run, None) == third
    assert source_checkpoint(second, None) == second  # a checkpoint folder is read as it is
    with pytest.raises(ExportError, match=re.escape(f"'{tmp_path / 'eval'}' has no config.yaml: expected a "
                                                    "checkpoint_step_N folder written by train/train.py, or a run")):
        source_checkpoint(str(tmp_path / "eval"), None)
    assert ck.resolve_which(run, "best", "--checkpoint") == first
    with pytest.raises(FileNotFoundError, match=re.escape(f"--which best picks a checkpoint of a run folder, and "
                                                          f"--checkpoint '{second}' is a checkpoint folder")):
        ck.resolve_which(second, "best", "--checkpoint")
    with open(os.path.join(first, "trainer_state.json"), "a") as f:
        f.write(" ")  # damaged: refused, not replaced by another
    with pytest.raises(CheckpointError, match=re.escape(f"--checkpoint '{first}' fails verification")):
        resolve_checkpoint(run, "best")
    os.remove(os.path.join(first, ck.MARKER))
    with pytest.raises(CheckpointError, match=re.escape(f"--checkpoint '{run}' --which best: `best` names "
                                                        "checkpoint_step_1, which has no COMPLETE marker")):
        resolve_checkpoint(run, "best")


def test_which_on_the_command_lines(tmp_path):
    from checkpoint.export import main as export_main
    from inference.rollout import main as rollout_main
    from inference.serve import main as serve_main

    run_of(tmp_path / "run", [1])
    run = str(tmp_path / "run")
    with pytest.raises(SystemExit, match=re.escape(f"serve failed: --checkpoint '{run}' has no `best` file")):
        serve_main(["--checkpoint", run, "--which", "best"])
    with pytest.raises(SystemExit, match=re.escape(f"export failed: checkpoint_dir '{run}' has no `best` file")):
        export_main([run, str(tmp_path / "out"), "--which", "best"])
    with pytest.raises(SystemExit, match="rollout failed: --which best picks the checkpoint this command serves: "
                                         "it needs --checkpoint"):
        rollout_main(["--task", "pusht", "--policy", "ws://127.0.0.1:1", "--which", "best", "--episodes", "1",
                      "--out", str(tmp_path / "report")])
    assert sorted(os.listdir(tmp_path)) == ["run"]  # nothing written
