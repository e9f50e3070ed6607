"""Faults of long runs: non-finite steps, damaged checkpoint files, a full disk and write errors.

In-process tests use a fake engine that writes shards (as tests/test_checkpoint.py does); the
`distributed` ones run the real trainer with torchrun.
"""
import errno
import glob
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

import checkpoint.checkpointer as ck
from checkpoint.__main__ import main as checkpoint_cli
from checkpoint.manifest import MANIFEST, CheckpointCorrupt, digest_files, list_files
from tests.helpers import ROOT, metrics, run_dir, train
from recipe.schema import Config
from checkpoint.state import Document, PerRank, RandomState, Registry, Shared
from train.launch_checks import load_deepspeed_config
from train.engine import poison_nonfinite
from train.guard import NONFINITE_EXIT_CODE, SAVE_FAILED_EXIT_CODE, NonFiniteError, NonFiniteGuard
from train.trainer_state import TrainerState
from train.watchdog import stacks_path

GOOD = {"weights_finite": True, "loss_finite": True}
DIVERGED = {"weights_finite": True, "loss_finite": False}
SHARD_BYTES = 1 << 16


def write_shard(path, nbytes):
    """The fake engine's one write function (fault injection patches it)."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))


class FakeEngine:
    def __init__(self, nbytes=SHARD_BYTES):
        self.nbytes = nbytes

    def save(self, folder):
        os.makedirs(folder, exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            write_shard(os.path.join(folder, name), self.nbytes)


class Stats:
    def save(self, path):
        with open(path, "w") as f:
            json.dump({"action": {"mean": [0.5] * 8}}, f)


def saver(run, limit=None):
    cfg = OmegaConf.structured(Config)
    cfg.system.total_limit = limit
    return ck.Checkpointer(str(run), cfg)


def save(checkpointer, step, health=GOOD, nbytes=SHARD_BYTES):
    """A save of the trainer's parts: a fake engine, the RNG, the trainer state, the config and stats."""
    state = TrainerState(step=step)
    parts = Registry()
    parts.register("engine", FakeEngine(nbytes))
    parts.register("rng", PerRank(RandomState()))
    parts.register("trainer_state", Shared(state))
    parts.register("config.yaml", Document(lambda path: ck.disk.fsync_write(path, OmegaConf.to_yaml(checkpointer.cfg))))
    parts.register("norm_stats.json", Document(Stats().save))
    return checkpointer.save(step, parts, health)


def flip(path, count=64):
    """Flip `count` bytes in the middle of a file (all of it when it is shorter)."""
    data = bytearray(open(path, "rb").read())
    start = max(0, len(data) // 2 - count // 2)
    for i in range(start, min(len(data), start + count)):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def steps_of(paths):
    return [ck.step_of(p) for p in paths]


# --- manifest and verification -------------------------------------------------------------------
def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    path = save(saver(tmp_path), 5)
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    files = list_files(path, (MANIFEST, "COMPLETE"))
    assert sorted(manifest["files"]) == files and "rng/rank_0.pt" in files and "norm_stats.json" in files
    assert manifest["files"] == digest_files(path, files)
    assert manifest["health"] == GOOD and manifest["step"] == 5
    assert ck.read_marker(path)[1] == hashlib.sha256(open(os.path.join(path, MANIFEST), "rb").read()).hexdigest()
    assert ck.verify(path) == [] and checkpoint_cli(["verify", path]) == 0


DAMAGED = ["engine/mp_rank_00_model_states.pt", "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt",
           "rng/rank_0.pt", "trainer_state.json", "config.yaml", "norm_stats.json", MANIFEST, "COMPLETE"]


@pytest.mark.parametrize("rel", DAMAGED)
def test_a_damaged_file_is_named_and_auto_uses_the_previous_checkpoint(tmp_path, caplog, rel):
    checkpointer = saver(tmp_path)
    older, newest = save(checkpointer, 10), save(checkpointer, 20)
    flip(os.path.join(newest, rel))
    problems = ck.verify(newest)
    assert len(problems) == 1 and os.path.join(newest, rel) in problems[0], problems
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert ck.resolve_resume_path("auto", str(tmp_path)) == older
    assert "FAILS VERIFICATION" in caplog.text and rel in caplog.text
    with pytest.raises(CheckpointCorrupt, match=re.escape(rel)):
        ck.resolve_resume_path(newest, None)  # an explicit path: a clear error, nothing loaded
    assert checkpoint_cli(["verify", str(tmp_path)]) == 1 and checkpoint_cli(["verify", older]) == 0


def test_missing_truncated_and_extra_files(tmp_path):
    path = save(saver(tmp_path), 10)
    os.remove(os.path.join(path, "rng", "rank_0.pt"))
    with open(os.path.join(path, "config.yaml"), "a") as f:
        f.write("x")
    open(os.path.join(path, "engine", "stray.pt"), "w").write("?")
    problems = "\n".join(ck.verify(path))
    assert "rank_0.pt: missing" in problems and "config.yaml: " in problems and "stray.pt: not in the manifest" in problems
    os.remove(os.path.join(path, MANIFEST))
    assert "MANIFEST.json: cannot be read" in ck.verify(path)[0]


def test_several_damaged_checkpoints(tmp_path):
    checkpointer = saver(tmp_path / "tiny" / "run")
    paths = [save(checkpointer, s) for s in (10, 20, 30)]
    flip(os.path.join(paths[2], "engine", "mp_rank_00_model_states.pt"))
    flip(os.path.join(paths[1], "trainer_state.json"))
    assert ck.resolve_resume_path("auto", str(tmp_path / "tiny" / "run")) == paths[0]
    flip(os.path.join(paths[0], "rng", "rank_0.pt"))
    with pytest.raises(CheckpointCorrupt, match="none of the 3 complete checkpoints"):
        ck.resolve_resume_path("auto", str(tmp_path / "tiny" / "run"))
    # the trainer then refuses to start rather than training from scratch next to them
    from train.run_dir import choose_run_dir
    cfg = OmegaConf.structured(Config)
    cfg.system.checkpoint_dir, cfg.logging.run_name, cfg.resume.checkpoint_path = str(tmp_path), "run", "auto"
    with pytest.raises(CheckpointCorrupt):
        choose_run_dir(cfg, "tiny")


def test_auto_and_retention_keep_the_newest_finite_checkpoint(tmp_path):
    checkpointer = saver(tmp_path, limit=1)
    good = save(checkpointer, 10)
    save(checkpointer, 20, DIVERGED)
    newest = save(checkpointer, 30, DIVERGED)
    assert steps_of(ck.complete_checkpoints(str(tmp_path))) == [10, 30]  # 20 deleted, 10 protected
    assert ck.resolve_resume_path("auto", str(tmp_path)) == good
    save(checkpointer, 40)  # healthy again: the protection moves on
    assert steps_of(ck.complete_checkpoints(str(tmp_path))) == [40]
    assert ck.saved_health(newest) is None and not os.path.exists(newest)


# --- fault injection of the save path ------------------------------------------------------------
class Faults:
    """Counts the calls of every write a save makes; raises OSError(ENOSPC) at the chosen ones."""

    POINTS = {"write_shard": (__name__, "write_shard"), "torch_save": (ck.torch, "save"),
              "fsync_write": (ck.disk, "fsync_write"), "replace": (ck.os, "replace"), "makedirs": (ck.os, "makedirs"),
              "digest": (ck, "digest_files"), "rmtree": (ck.shutil, "rmtree"), "stats": (Stats, "save")}

    def __init__(self, monkeypatch):
        self.calls, self.fail_at = 0, set()
        for name, (owner, attr) in self.POINTS.items():
            owner = sys.modules[owner] if isinstance(owner, str) else owner
            monkeypatch.setattr(owner, attr, self._wrap(getattr(owner, attr)))

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls in self.fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return fn(*args, **kwargs)
        return wrapped


def check_invariants(run, before):
    """Nothing partial left; `latest` names a complete checkpoint and auto one that passes verification;
    checkpoints that were there before are unchanged (unless retention deleted them)."""
    assert not glob.glob(os.path.join(run, ".tmp_*")) and not os.path.exists(os.path.join(run, "latest.tmp"))
    whole = [p for p in ck.complete_checkpoints(run) if ck.verify(p) == []]
    if not whole:  # every checkpoint damaged: auto refuses rather than loading one
        with pytest.raises(CheckpointCorrupt, match="passes verification"):
            ck.resolve_resume_path("auto", run)
        return None
    chosen = ck.resolve_resume_path("auto", run)
    assert chosen == whole[-1]
    assert ck.is_complete(os.path.join(run, open(os.path.join(run, "latest")).read().strip()))
    for path, digest in before.items():
        if os.path.exists(path):
            assert digest_files(path, list_files(path)) == digest, path
    return chosen


def snapshot(run):
    return {p: digest_files(p, list_files(p)) for p in ck.complete_checkpoints(run)}


def test_an_oserror_at_each_write_step_leaves_the_run_loadable(tmp_path, monkeypatch):
    faults = Faults(monkeypatch)
    run = str(tmp_path / "count")
    save(saver(run, limit=2), 10)
    save(saver(run, limit=2), 20)
    start = faults.calls
    save(saver(run, limit=2), 30)
    writes = faults.calls - start
    assert writes >= 12  # shards, rng, trainer state, config, stats, digest, manifest, marker, latest, renames
    outcomes = set()
    for point in range(1, writes + 1):
        run = str(tmp_path / f"fault_{point}")
        for step in (10, 20):
            save(saver(run, limit=2), step)
        before = snapshot(run)
        faults.fail_at = {faults.calls + point}
        try:
            save(saver(run, limit=2), 30)
            outcomes.add("saved")  # the fault hit retention: a warning, the new checkpoint is whole
            assert ck.resolve_resume_path("auto", run).endswith("_30")
        except ck.CheckpointSaveError as e:
            outcomes.add("failed")
            assert "no space left on" in str(e) and "checkpoint_step_30" in str(e), str(e)
            assert check_invariants(run, before).endswith("_20")
        check_invariants(run, before)
        faults.fail_at = set()
        save(saver(run, limit=2), 40)  # the next save works and cleans up after the failed one
        assert steps_of(ck.complete_checkpoints(run))[-1] == 40 and check_invariants(run, {}).endswith("_40")
    assert outcomes == {"saved", "failed"}


def test_no_sequence_of_faults_leaves_auto_on_a_bad_checkpoint(tmp_path, monkeypatch):
    faults, rng, run = Faults(monkeypatch), random.Random(0), str(tmp_path)
    save(saver(run, limit=2), 1)
    for step in range(2, 30):
        before = snapshot(run)
        faults.fail_at = {faults.calls + rng.randint(1, 18) for _ in range(rng.choice([0, 1, 1, 2, 3]))}
        try:
            save(saver(run, limit=2), step)
        except ck.CheckpointSaveError:
            pass
        check_invariants(run, before)
        if rng.random() < 0.2:  # bit rot between saves: auto must step over it
            flip(os.path.join(ck.complete_checkpoints(run)[-1], rng.choice(DAMAGED)))
            check_invariants(run, {})


def test_disk_full_message(tmp_path, monkeypatch):
    checkpointer = saver(tmp_path)
    save(checkpointer, 10)
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys.modules[__name__], "write_shard", full)
    with pytest.raises(ck.CheckpointSaveError) as e:
        save(checkpointer, 20)
    assert re.search(r"no space left on \S+ \(/\S*\) while saving checkpoint_step_20 to " + re.escape(str(tmp_path)) +
                     r": it needs about 0\.000\d+ GB, [\d.e+]+ GB free", str(e.value)), str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_step_10", "latest"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MB file system (tmpfs; needs root and mount permission)."""
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 12 MB tmpfs here ({r.stderr.strip() or 'mount failed'}): needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_on_a_real_small_file_system(small_disk, caplog):
    checkpointer = saver(small_disk, limit=2)
    save(checkpointer, 10, nbytes=2 << 20)  # about 4 MB each
    save(checkpointer, 20, nbytes=2 << 20)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        with pytest.raises(ck.CheckpointSaveError, match=r"no space left on tmpfs .* it needs about 0.00[45]\d* GB"):
            save(checkpointer, 30, nbytes=2 << 20)
    assert "will likely fail" in caplog.text  # warned before the save
    assert sorted(os.listdir(small_disk)) == ["checkpoint_step_10", "checkpoint_step_20", "latest"]
    assert open(small_disk / "latest").read().strip() == "checkpoint_step_20"
    assert all(ck.verify(p) == [] for p in ck.complete_checkpoints(str(small_disk)))


# --- non-finite steps ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1.5, float("nan"), float("inf")])
def test_a_nonfinite_loss_makes_every_gradient_nonfinite(value):
    w = torch.tensor([2.0, -3.0], requires_grad=True)
    loss = torch.tensor(value) + (w ** 2).sum()  # a non-finite term with no gradient path of its own
    poison_nonfinite(loss).backward()
    if value == 1.5:
        assert torch.equal(w.grad, 2 * w.detach())  # finite: exactly the plain gradient
    else:
        assert torch.isnan(w.grad).all()


def test_guard_counts_and_stops_after_max_in_a_row():
    state = TrainerState()
    guard = NonFiniteGuard(state, 3)
    losses = {"loss": torch.tensor(float("nan")), "video_loss": torch.tensor(0.5)}
    for step, skipped in enumerate([True, True, False, True, True], start=1):
        guard.after_step(step, skipped, losses, float("inf"))
        guard.check()
    assert state.skipped_nonfinite_steps == 4 and not guard.last_step_finite
    guard.after_step(6, True, losses, float("nan"))
    with pytest.raises(NonFiniteError, match=r"3 steps in a row \(up to step 6\).*loss=nan, video_loss=0.5"):
        guard.check()


@pytest.mark.parametrize("patch", [{"bf16": {"enabled": "auto", "check_grad_overflow": False}},
                                   {"zero_optimization": {"stage": 2, "compute_grad_norm": False}}])
def test_deepspeed_switches_that_disable_the_skip_are_rejected(tmp_path, patch):
    ds = json.load(open(os.path.join(ROOT, "configs", "zero2.json")))
    ds.update(patch)
    (tmp_path / "z.json").write_text(json.dumps(ds))
    with pytest.raises(ValueError, match="must be skipped"):
        load_deepspeed_config(str(tmp_path / "z.json"), OmegaConf.structured(Config), 1)


# --- the real trainer ----------------------------------------------------------------------------
LAUNCHER = os.path.join(ROOT, "tests", "poison_launcher.py")


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """ZeRO-2 and DDP, 2 processes: rank 1's loss is NaN at step 3 (finite gradients) and 4 (NaN ones)."""
    tmp, out = tmp_path_factory.mktemp("poison"), {}
    for name, deepspeed in (("zero2", "configs/zero2.json"), ("ddp", None)):
        env = {"POISON": "3:add,4:mul", "POISON_RANK": "1", "POISON_OUT": str(tmp / name)}
        train(tmp, 2, name, ["training.batch_size=2"], deepspeed=deepspeed, script=LAUNCHER, env=env)
        out[name] = [json.load(open(tmp / name / f"rank_{r}.json")) for r in (0, 1)]
    return tmp, out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero2", "ddp"])
def test_nan_on_one_rank_skips_the_update_on_every_rank(poisoned, name):
    tmp, out = poisoned
    for rank in (0, 1):
        by_step = {r["step"]: r for r in out[name][rank]}
        for step in (3, 4):  # weights, fp32 masters and optimizer state bit-identical
            assert by_step[step] == {"step": step, "skipped": True, "params": True, "master": True, "state": True}
        assert by_step[5]["skipped"] is False and not by_step[5]["params"]  # the next step updates again
    records = {r["step"]: r for r in metrics(tmp, name)}
    assert [records[s]["skipped_nonfinite_steps"] for s in range(1, 7)] == [0, 0, 1, 2, 2, 2]
    assert all(records[s]["loss"] == records[s]["loss"] for s in (1, 2, 5, 6))  # finite elsewhere
    health = [json.load(open(os.path.join(p, MANIFEST)))["health"] for p in ck.complete_checkpoints(run_dir(tmp, name))]
    assert health == [DIVERGED, GOOD]  # step 3 was skipped, step 6 not


@pytest.mark.distributed
def test_a_damaged_model_states_file_is_skipped_by_auto(poisoned):
    tmp, _ = poisoned
    run = run_dir(tmp, "zero2")
    flip(os.path.join(run, "checkpoint_step_6", "engine", "mp_rank_00_model_states.pt"))
    result = train(tmp, 2, "zero2", ["training.batch_size=2", "resume.checkpoint_path=auto",
                                     "training.max_steps=7"])
    log = result.stdout + result.stderr
    assert "checkpoint_step_6 FAILS VERIFICATION" in log and "mp_rank_00_model_states.pt: checksum mismatch" in log
    assert "resumed from " + os.path.join(run, "checkpoint_step_3") in log
    assert [r["step"] for r in metrics(tmp, "zero2")] == list(range(1, 8))


@pytest.mark.distributed
def test_divergence_stops_the_run_without_saving(tmp_path):
    result = train(tmp_path, 2, "nan", ["training.optimizer=adamw", "training.learning_rate=1e4",
                                        "training.grad_clip_norm=0", "training.max_steps=40",
                                        "system.save_interval=2", "training.max_nonfinite_steps=3"], check=False)
    log = result.stdout + result.stderr
    assert result.returncode != 0 and f"exitcode  : {NONFINITE_EXIT_CODE}" in log, log[-3000:]
    assert log.count("error: 3 steps in a row (up to step 4)") == 1 and "Training finished" not in log
    records = metrics(tmp_path, "nan")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["skipped_nonfinite_steps"] == 3
    saved = ck.complete_checkpoints(run_dir(tmp_path, "nan"))
    assert steps_of(saved) == [2]  # step 2 (finite weights, skipped step) but never step 4
    assert json.load(open(os.path.join(saved[0], MANIFEST)))["health"] == DIVERGED


@pytest.mark.distributed
def test_disk_full_during_a_real_save(small_disk):
    """Checkpoints of about 4.7 MB on 12 MB, two kept: the third save (step 6) cannot fit."""
    result = train(small_disk, 2, "full", ["system.save_interval=2", "system.total_limit=2"], check=False)
    log = result.stdout + result.stderr
    assert f"exitcode  : {SAVE_FAILED_EXIT_CODE}" in log, log[-3000:]
    assert log.count("error: no space left on tmpfs") == 1 and "basic_ios" not in log, log[-3000:]
    assert "checkpoint_step_6" in log.split("error: no space left on tmpfs")[1].split("\n")[0]
    assert "will likely fail" in log  # warned after the save of step 4
    run = run_dir(small_disk, "full")
    assert sorted(n for n in os.listdir(run) if n.startswith((".", "checkpoint", "latest"))) == \
        ["checkpoint_step_2", "checkpoint_step_4", "latest"]
    assert open(os.path.join(run, "latest")).read().strip() == "checkpoint_step_4"
    assert all(ck.verify(p) == [] for p in ck.complete_checkpoints(run))
    shutil.rmtree(run)


@pytest.mark.distributed
def test_a_run_folder_rank0_cannot_write_stops_every_rank(tmp_path):
    """Rank 0 alone writes the run's config.yaml (here a folder in the way, as a full or read-only
    disk would): both ranks exit with the error, the other one does not wait for rank 0 in its next
    collective (the group timeout is set to a minute so that, broken, the test ends)."""
    run = run_dir(tmp_path, "blocked")
    os.makedirs(os.path.join(run, "config.yaml"))
    result = train(tmp_path, 2, "blocked", ["system.dist_timeout_minutes=1"], deepspeed=None, check=False)
    log = result.stdout + result.stderr
    assert result.returncode != 0 and "Training finished" not in log, log[-3000:]
    assert re.search(r"\[rank 0\] error: .*config\.yaml", log), log[-3000:]
    assert "[rank 1] error: another rank failed during start-up" in log, log[-3000:]


@pytest.mark.distributed
def test_a_hung_rank_exits_with_its_stack_and_the_run_resumes_from_its_last_save(tmp_path):
    """Rank 1 waits forever for step 3's batch while rank 0 waits for it in the step's all-reduce
    (the group timeout, 60 minutes, would hold both): the watchdog writes where the rank hangs to
    its own file (both ranks time out together: on one stream their dumps interleave) and ends the
    run non-zero; the step-2 save resumes, and the stacks stay."""
    overrides = ["system.save_interval=2", "training.max_steps=6"]
    result = train(tmp_path, 2, "hang", overrides + ["system.hang_timeout_minutes=0.25"], deepspeed=None,
                   script=os.path.join(ROOT, "tests", "hang_launcher.py"), env={"HANG_STEP": "3"}, check=False)
    log = result.stdout + result.stderr
    run = run_dir(tmp_path, "hang")
    assert result.returncode != 0 and "Training finished" not in log, log[-3000:]
    assert f"writes its stacks to {stacks_path(run, 'R')}" in log, log[-3000:]
    stacks = open(stacks_path(run, 1)).read()
    assert stacks.startswith("Timeout (0:00:15)!\n") and "in wait_for_a_batch_that_never_comes" in stacks, stacks
    assert steps_of(ck.complete_checkpoints(run)) == [2]
    result = train(tmp_path, 2, "hang", overrides + ["resume.checkpoint_path=auto"], deepspeed=None)
    log = result.stdout + result.stderr
    assert f"an earlier launch of this run hung: its stacks are in {stacks_path(run, 1)}" in log, log[-3000:]
    assert [r["step"] for r in metrics(tmp_path, "hang")][-4:] == [3, 4, 5, 6]
    assert open(stacks_path(run, 1)).read() == stacks  # rank 0's file: its own dump, or removed when left empty
    assert all(os.path.getsize(p) > 0 for p in glob.glob(stacks_path(run, "*"))), os.listdir(run)


# DeepSpeed without ZeRO (stage 0, fp32) steps the client optimizer itself: the engine drops the
# non-finite gradients first. One process, a linear model, AdamW.
@pytest.mark.distributed
def test_deepspeed_stage0_skips_a_nonfinite_step(tmp_path):
    code = f"""
import json, sys, torch
sys.path.insert(0, {ROOT!r})
from omegaconf import OmegaConf
from recipe.schema import Config
from train.launch_checks import load_deepspeed_config
from train.launch import make_accelerator, make_engine
from utils.batch import FlowLosses
cfg = OmegaConf.structured(Config)
cfg.training.batch_size = 4
ds = json.load(open("configs/zero2.json"))
ds["zero_optimization"] = {{"stage": 0}}
json.dump(ds, open(sys.argv[1], "w"))

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, inputs):
        loss = self.lin(inputs["x"]).pow(2).mean() * inputs["scale"]
        zero = torch.zeros(())  # the engine backpropagates .loss alone
        return FlowLosses(loss, zero, zero, zero, zero)

torch.manual_seed(0)
net = Net()
eng = make_engine(make_accelerator(load_deepspeed_config(sys.argv[1], cfg, 1), 5), net,
             torch.optim.AdamW(net.parameters(), lr=0.1), cfg)
out = []
for scale in (1.0, float("nan"), float("inf"), 1.0):
    before = [p.detach().clone() for p in eng.unwrapped_model().parameters()]
    eng.micro_step({{"x": torch.randn(4, 4), "scale": torch.tensor(scale)}}, is_last=True)
    _, skipped = eng.optimizer_step(1)
    after = list(eng.unwrapped_model().parameters())
    out.append([skipped, all(torch.equal(a, b) for a, b in zip(before, after))])
print("RESULT", json.dumps(out), eng.ds.skipped_steps)
"""
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "z0.json")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results, skipped_steps = r.stdout.split("RESULT")[1].rsplit(" ", 1)
    assert json.loads(results) == [[False, False], [True, True], [True, True], [False, False]]
    assert int(skipped_steps) == 2  # DeepSpeed's own counter agrees
