"""Crash safety and retention of checkpoint.checkpointer (no model needed: a fake engine writes shards)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from checkpoint.checkpointer import complete_checkpoints, resolve_resume_path, verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child process saves checkpoints with a fake engine; `KILL` makes it SIGKILL itself at the
# n-th call of one of the functions a save goes through, i.e. at that moment of the save.
CHILD = textwrap.dedent("""
    import os, signal, sys, json
    sys.path.insert(0, {root!r})
    import checkpoint.checkpointer as ck
    from checkpoint.state import Document, PerRank, RandomState, Registry, Shared
    from omegaconf import OmegaConf
    from recipe.schema import Config

    run_dir, steps, limit, kill = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    calls = {{}}

    def trap(name, fn):
        def wrapped(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            if kill and kill[0] == name and calls[name] == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapped

    class Engine:
        def save(self, d):
            os.makedirs(d, exist_ok=True)
            for i in range(3):
                p = os.path.join(d, f"shard_{{i}}.pt")
                with open(p, "wb") as f:
                    f.write(os.urandom(1 << 16))
                calls["shard"] = calls.get("shard", 0) + 1
                if kill and kill[0] == "shard" and calls["shard"] == kill[1]:
                    os.kill(os.getpid(), signal.SIGKILL)

    class Stats:
        def save(self, p):
            open(p, "w").write("{{}}")

    ck.os.replace = trap("replace", os.replace)
    ck.disk.fsync_write = trap("fsync_write", ck.disk.fsync_write)
    ck.shutil.rmtree = trap("rmtree", ck.shutil.rmtree)
    cfg = OmegaConf.structured(Config)
    cfg.system.total_limit = limit
    saver = ck.Checkpointer(run_dir, cfg)
    saver.remove_interrupted_saves()
    class Trainer:
        def state_dict(self):
            return {{"step": self.step}}

    trainer = Trainer()
    parts = Registry()
    parts.register("engine", Engine())
    parts.register("rng", PerRank(RandomState()))
    parts.register("trainer_state", Shared(trainer))
    parts.register("config.yaml", Document(lambda p: ck.disk.fsync_write(p, OmegaConf.to_yaml(cfg))))
    parts.register("norm_stats.json", Document(Stats().save))
    for step in steps:
        trainer.step = step
        saver.save(step, parts, {{"weights_finite": True, "loss_finite": True}})
""")


def run_child(run_dir, steps, limit=None, kill=None):
    code = CHILD.format(root=ROOT)
    args = [sys.executable, "-c", code, str(run_dir), json.dumps(steps), str(limit or 0), json.dumps(kill)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            h.update(name.encode())
            with open(os.path.join(root, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_complete_save_layout(tmp_path):
    assert run_child(tmp_path, [5]).returncode == 0
    ck = tmp_path / "checkpoint_step_5"
    assert sorted(os.listdir(ck)) == ["COMPLETE", "MANIFEST.json", "config.yaml", "engine", "norm_stats.json", "rng",
                                      "trainer_state.json"]
    assert (tmp_path / "latest").read_text().strip() == "checkpoint_step_5"
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 5
    assert resolve_resume_path("auto", str(tmp_path)) == str(ck)


# Moments of the second save (step 20) at which the process is killed: while the engine writes
# its shards, while the trainer state / marker are written, at the rename, at the `latest` update,
# and while retention deletes the oldest checkpoint.
# (fsync_write: 1 trainer state, 2 config, 3 manifest, 4 marker, 5 latest; replace: 1 rename, 2 latest;
# rmtree: 1 stale temporary folder, 2 retention.)
KILL_POINTS = [("shard", 2), ("fsync_write", 4), ("replace", 1), ("fsync_write", 5), ("replace", 2),
               ("rmtree", 2)]


@pytest.fixture(scope="module")
def saved_at_10(tmp_path_factory):
    """A run folder holding one complete checkpoint (step 10), copied by each kill test."""
    run = tmp_path_factory.mktemp("saved_at_10")
    assert run_child(run, [10], limit=1).returncode == 0
    return run


@pytest.mark.parametrize("kill", KILL_POINTS)
def test_kill_during_save_never_leaves_a_loadable_partial(saved_at_10, tmp_path, kill):
    tmp_path = tmp_path / "run"
    shutil.copytree(saved_at_10, tmp_path)
    before = digest(tmp_path / "checkpoint_step_10")
    result = run_child(tmp_path, [20], limit=1, kill=list(kill))
    assert result.returncode == -9, result.stderr
    found = complete_checkpoints(str(tmp_path))
    newest = resolve_resume_path("auto", str(tmp_path))
    assert newest in found
    for ck in found:  # whatever is complete is whole
        assert verify(ck) == [] and len(os.listdir(os.path.join(ck, "engine"))) == 3
    if newest.endswith("_10"):
        assert digest(tmp_path / "checkpoint_step_10") == before, "the older checkpoint was damaged"
    # a restarted run cleans up the interrupted save and saves again
    assert run_child(tmp_path, [30], limit=1).returncode == 0
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["checkpoint_step_30"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_retention_keeps_newest_n(tmp_path):
    assert run_child(tmp_path, [1, 2, 3, 4, 5], limit=2).returncode == 0
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["checkpoint_step_4", "checkpoint_step_5"]
    assert run_child(tmp_path / "all", [1, 2, 3], limit=None).returncode == 0
    assert len(complete_checkpoints(str(tmp_path / "all"))) == 3


def test_resume_path_errors(tmp_path):
    assert resolve_resume_path("auto", str(tmp_path)) is None  # nothing yet: start fresh
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_resume_path(str(tmp_path / "nope"), None)
    os.makedirs(tmp_path / "checkpoint_step_3")
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        resolve_resume_path(str(tmp_path / "checkpoint_step_3"), None)
    with pytest.raises(FileNotFoundError, match="holds no complete"):
        resolve_resume_path(str(tmp_path), None)


def test_saved_steps_lists_complete_folders_in_step_order(tmp_path):
    """Numeric order (4 before 30 before 100, which a sort by name breaks); a folder without the COMPLETE
    marker or not named for a step is left out."""
    from checkpoint.layout import MARKER, saved_steps
    for name, complete in (("checkpoint_step_30", True), ("checkpoint_step_4", True), ("checkpoint_step_100", True),
                           ("checkpoint_step_7", False), ("checkpoint_step_x", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / MARKER).write_text("")
    assert saved_steps(str(tmp_path)) == [(s, str(tmp_path / f"checkpoint_step_{s}")) for s in (4, 30, 100)]
    assert complete_checkpoints(str(tmp_path)) == [p for _, p in saved_steps(str(tmp_path))]
