"""Closed-loop evaluation during training, the trainer's side: the recipe's `evaluation` section is
checked at load; train/evaluation.py runs one rollout at a time beside training (the newest due
checkpoint waits), logs every record at its checkpoint's step once (also across a resume), records a
failed rollout and goes on, and on preemption stops the rollout with everything it started. The
evaluator's own tests run stand-in rollouts (a script that writes a report when told to); the last
test trains the tiny architecture on a 14-D dataset and rolls it out in gym-aloha for real."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from checkpoint import evaluations
from recipe.config import load_config
from tests.helpers import ROOT, metrics, run_dir, train
from utils.config import ConfigError

# the tiny recipe shaped for transfer_cube: 14-D actions and state, one camera
ALOHA_SHAPED = ["common.action_dim=14", "common.state_dim=14", "serving.image_keys=[observation.images.top]",
                "evaluation.task=transfer_cube", "evaluation.interval=200"]


# --- the recipe section ---------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("evaluation.task=fold_towel", "'evaluation.task' is 'fold_towel'; expected one of insertion, pusht, transfer_cube"),
    ("evaluation.interval=150", "'evaluation.interval' is 150; expected a positive multiple of system.save_interval "
                                "(100): an evaluation runs on a saved checkpoint"),
    ("evaluation.interval=0", "'evaluation.interval' is 0; expected a positive multiple of system.save_interval"),
    ("common.action_dim=4", "'common.action_dim' is 4; expected 14: evaluation.task transfer_cube "
                            "(gym_aloha/AlohaTransferCube-v0) takes 14-D actions"),
    ("common.state_dim=8", "'common.state_dim' is 8; expected 14: evaluation.task transfer_cube "
                           "(gym_aloha/AlohaTransferCube-v0) gives a 14-D state"),
    ("serving.image_keys=[a,b]", "'serving.image_keys' is ['a', 'b']; expected one key: evaluation.task "
                                 "transfer_cube (gym_aloha/AlohaTransferCube-v0) gives one camera"),
    ("evaluation.seed=5", "'evaluation.seed' is 5; expected null or a seed such that seed .. seed + episodes - 1 "
                          "(50 episodes) lie in the evaluation seeds [1000000, 2000000)"),
    ("evaluation.seed=1999990", "'evaluation.seed' is 1999990; expected null or a seed such that"),
    ("evaluation.runner=folower", "'evaluation.runner' is 'folower'; expected one of trainer, follower"),
    ("evaluation.episode_steps=301", "'evaluation.episode_steps' is 301; expected null (the task's cap) or 1 .. 300"),
    ("evaluation.replan=9", "'evaluation.replan' is 9; expected null (the whole chunk) or 1 .. "
                            "common.action_chunk_size (8)"),
    ("evaluation.device=gpu", "'evaluation.device' is 'gpu'; expected cpu, cuda or cuda:N"),
    ("evaluation.episodes=0", "'evaluation.episodes' is 0; expected a positive integer"),
    ("evaluation.videos=-1", "'evaluation.videos' is -1; expected an integer >= 0"),
    ("evaluation.interal=200", "unknown key 'evaluation.interal'. Did you mean 'evaluation.interval'?"),
])
def test_evaluation_rules_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", [*ALOHA_SHAPED, override])


def test_a_task_whose_simulator_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gym_pusht", None)  # as if gym-pusht were not installed
    with pytest.raises(ConfigError, match=re.escape(
            "'evaluation.task' is 'pusht': task 'pusht' needs the package gym-pusht==0.1.8 (no module named "
            "'gym_pusht'); install it with `pip install gym-pusht==0.1.8`")):
        load_config("configs/tiny.yaml", ["common.action_dim=2", "common.state_dim=2", "evaluation.task=pusht",
                                          "evaluation.interval=100"])


def test_the_aloha_recipe_evaluates_and_reading_it_imports_no_simulator():
    cfg = load_config("configs/aloha_sim.yaml")
    ev = cfg.evaluation
    assert (ev.task, ev.episodes, ev.workers, ev.runner) == ("transfer_cube", 50, 2, "trainer")
    assert ev.interval % cfg.system.save_interval == 0 and cfg.training.max_steps % ev.interval == 0
    assert load_config("configs/tiny.yaml").evaluation.task is None  # off by default
    code = ("import json, sys\nfrom recipe.config import load_config\nload_config('configs/aloha_sim.yaml')\n"
            "print(json.dumps([m for m in ('torch', 'gymnasium', 'gym_aloha', 'dm_control', 'mujoco') "
            "if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# --- Metrics.log_evaluation -----------------------------------------------------------------------

class FakeWandb:
    def __init__(self):
        self.defined, self.rows = [], []

    def define_metric(self, name, **kwargs):
        self.defined.append((name, kwargs))

    def log(self, row, step):
        self.rows.append((step, row))

    def finish(self):
        pass


def test_an_evaluation_is_logged_at_its_checkpoint_s_step_in_every_sink(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import utils.metrics
    from utils.metrics import Metrics
    from utils.video_file import VideoEncoder

    wandb = FakeWandb()
    monkeypatch.setattr(utils.metrics, "init_wandb", lambda cfg, run_dir: wandb)
    video = str(tmp_path / "episode.mp4")
    encoder = VideoEncoder(video, 50, 32, 24, codec="libx264", crf=None, gop=None)
    for k in range(5):
        encoder.write(np.full((24, 32, 3), 40 * k, np.uint8))
    encoder.close()
    m = Metrics(load_config("configs/tiny.yaml"), str(tmp_path), True, 0, "all")
    assert wandb.defined == [("eval/step", {}), ("eval/*", {"step_metric": "eval/step"})]
    m.log({"step": 500, "loss": 1.0})
    figures = {"eval/success_rate": 0.5, "eval/success_low": 0.1, "eval/success_high": 0.9}
    m.log_evaluation(300, figures, video)
    m.log_evaluation(400, {"eval/error": "inference.rollout ended with exit code 1: boom"})
    m.log_evaluation(200, {"eval/success_rate": 0.25}, str(tmp_path / "missing.mp4"))  # figures all the same
    m.close()

    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines[1:] == [{"step": 300, **figures}, {"step": 400, "eval/error": "inference.rollout ended with "
                                                                             "exit code 1: boom"},
                         {"step": 200, "eval/success_rate": 0.25}]
    events = EventAccumulator(str(tmp_path / "tensorboard_logs"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/success_rate")] == [(300, 0.5), (200, 0.25)]
    assert [e.step for e in events.Images("eval/video")] == [300]
    (text,) = events.Tensors("eval/error/text_summary")
    assert text.step == 400 and b"exit code 1: boom" in text.tensor_proto.string_val[0]
    # wandb: at its own current step (500: an earlier one would be dropped), eval/step the x-axis
    assert wandb.rows[0] == (500, {"loss": 1.0})
    rows = wandb.rows[1:]
    assert [(step, row["eval/step"]) for step, row in rows] == [(500, 300), (500, 400), (500, 200)]
    assert rows[0][1]["eval/success_rate"] == 0.5 and "eval/video" in rows[0][1]
    assert rows[1][1]["eval/error"].endswith("boom") and "eval/video" not in rows[2][1]


# --- the evaluator, with stand-in rollouts ----------------------------------------------------------

STAND_IN = r"""
import json, os, shutil, subprocess, sys, time
checkpoint, control = sys.argv[1], sys.argv[2]
step = checkpoint.rsplit("_", 1)[1]
partial = os.path.join(checkpoint, ".eval.partial_standin")
os.makedirs(partial)
# like inference.rollout's policy server: a process in a session of its own
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(os.path.join(control, f"started_{step}"), "w").write(str(server.pid))
go = os.path.join(control, f"go_{step}")
while not os.path.exists(go):
    time.sleep(0.05)
server.kill()
outcome = open(go).read()
if outcome == "fail":
    shutil.rmtree(partial)
    sys.exit("rollout failed: the stand-in simulator broke")
wins = int(outcome)
report = {"task": "transfer_cube", "results": {"policy": {
    "success_rate": wins / 4, "successes": wins, "episodes": 4, "wilson_95": [wins / 8, (wins + 4) / 8],
    "mean_max_reward": wins + 0.5, "latency_ms": {"p50": 10.0 + wins}, "per_episode": []}}}
json.dump(report, open(os.path.join(partial, "report.json"), "w"))
os.rename(partial, os.path.join(checkpoint, "eval"))
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A 13-step run's folder with checkpoints 3, 6, 9 and 13 (evaluation.interval 3); rollouts are STAND_IN,
    steered through files in `control`: go(step, "fail" | wins) ends one."""
    import train.evaluation

    run, control = tmp_path / "run", tmp_path / "control"
    control.mkdir()
    for step in (3, 6, 9, 13):
        (run / f"checkpoint_step_{step}").mkdir(parents=True)
        (run / f"checkpoint_step_{step}" / "COMPLETE").write_text(f"{step}\n")
    commands, real = [], evaluations.rollout_command

    def command(checkpoint, evaluation, python):
        commands.append(real(checkpoint, evaluation, python))
        return [python, "-c", STAND_IN, checkpoint, str(control)]

    monkeypatch.setattr(evaluations, "rollout_command", command)
    monkeypatch.setattr(train.evaluation, "STOP_GRACE_S", 3.0)
    monkeypatch.setattr(evaluations, "HEARTBEAT_S", 0.2)
    cfg = load_config("configs/tiny.yaml", ALOHA_SHAPED + ["evaluation.interval=3", "system.save_interval=3",
                                                           "evaluation.episodes=4", "training.max_steps=13",
                                                           "logging.report_to=none"])

    class Run:
        def __init__(self):
            self.dir, self.cfg, self.commands = str(run), cfg, commands

        def ckpt(self, step):
            return str(run / f"checkpoint_step_{step}")

        def evaluator(self, start_step=0):
            from train.evaluation import Evaluator
            from utils.metrics import Metrics

            return Evaluator(cfg, self.dir, Metrics(cfg, self.dir, True, start_step, "none"), True)

        def go(self, step, outcome):
            (control / f"go_{step}").write_text(str(outcome))

        def started(self, step, timeout=60):
            path = control / f"started_{step}"
            deadline = time.monotonic() + timeout  # a hang guard: a Python start on a busy machine
            while not path.exists() or not path.read_text():
                assert time.monotonic() < deadline, f"the stand-in rollout of step {step} did not start"
                time.sleep(0.05)
            return int(path.read_text())

        def evaluating(self):
            return sorted(int(os.path.basename(os.path.dirname(p)).rsplit("_", 1)[1]) for p in
                          glob.glob(os.path.join(self.dir, "checkpoint_step_*", evaluations.EVALUATING)))

        def records(self):
            with open(os.path.join(self.dir, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f]

    return Run()


def wait_for(evaluator, what):
    deadline = time.monotonic() + 60  # a hang guard
    while not what():
        assert time.monotonic() < deadline
        evaluator.poll()
        time.sleep(0.05)


def test_one_rollout_at_a_time_the_newest_waits_and_a_failure_is_logged(stand_in):
    ev = stand_in.evaluator()
    ev.after_save(3, stand_in.ckpt(3))
    ev.after_save(4, stand_in.ckpt(3))  # not a multiple of evaluation.interval: nothing
    ev.after_save(6, stand_in.ckpt(6))
    ev.after_save(9, stand_in.ckpt(9))  # takes 6's place: 6 is never evaluated
    assert stand_in.evaluating() == [3, 9] and ev.waiting == stand_in.ckpt(9)
    ckpt = stand_in.ckpt(3)
    assert stand_in.commands == [[sys.executable, "-m", "inference.rollout", "--task", "transfer_cube", "--checkpoint",
                                  ckpt, "--episodes", "4", "--out", os.path.join(ckpt, "eval"), "--workers", "2",
                                  "--videos", "1", "--device", "cpu", "--baselines", ""]]
    stand_in.started(3)
    marker = os.path.join(ckpt, evaluations.EVALUATING)
    os.utime(marker, (0, 0))  # as if its owner had died long ago: the heartbeat makes it fresh again
    assert not evaluations.is_being_evaluated(ckpt)
    wait_for(ev, lambda: evaluations.is_being_evaluated(ckpt))
    stand_in.go(3, 3)
    wait_for(ev, lambda: ev.running is not None and ev.running.checkpoint == stand_in.ckpt(9))
    assert stand_in.records() == [{"step": 3, "eval/success_rate": 0.75, "eval/success_low": 0.375,
                                   "eval/success_high": 0.875, "eval/mean_max_reward": 3.5, "eval/episodes": 4,
                                   "eval/latency_p50_ms": 13.0}]
    assert stand_in.evaluating() == [9]
    assert open(os.path.join(stand_in.dir, "best")).read().strip() == "checkpoint_step_3"
    stand_in.started(9)
    stand_in.go(9, "fail")
    wait_for(ev, lambda: len(stand_in.records()) == 2)
    error = stand_in.records()[1]
    assert error["step"] == 9 and error["eval/error"].startswith(
        "inference.rollout ended with exit code 1: rollout failed: the stand-in simulator broke (log: ")
    assert evaluations.read_failure(stand_in.ckpt(9)) == error["eval/error"]
    assert stand_in.evaluating() == [] and evaluations.read_report(stand_in.ckpt(9)) is None
    assert not glob.glob(os.path.join(stand_in.ckpt(9), ".eval.partial_*"))
    ev.after_save(13, stand_in.ckpt(13))  # the last step: due, though not a multiple of 3
    stand_in.started(13)
    stand_in.go(13, 1)
    ev.close(preempted=False)  # waits for 13
    assert [(r["step"], r.get("eval/success_rate")) for r in stand_in.records()] == [(3, 0.75), (9, None),
                                                                                      (13, 0.25)]
    log = open(os.path.join(stand_in.dir, "eval_logs", "checkpoint_step_13.log")).read()
    assert log.startswith(f"$ {sys.executable} -c ")

    resumed = stand_in.evaluator(start_step=13)  # a resumed run logs nothing twice and redoes nothing
    resumed.poll()
    resumed.close(preempted=False)
    assert len(stand_in.records()) == 3 and not os.path.exists(os.path.join(stand_in.ckpt(6), "eval"))


def gone(process):
    """Ended (a zombie: ended, its exit status not yet collected by the parent it was handed to)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ends(process, timeout=60):
    """A signal is delivered when the kernel next schedules the process: on a busy machine it can still be
    running just after kill(). A hang guard, not a timing: the stand-in server would sleep for 600 s."""
    deadline = time.monotonic() + timeout
    while not gone(process):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("by_the_scheduler", [False, True], ids=["stopped-by-the-trainer", "killed-by-sigterm"])
def test_preemption_stops_the_rollout_and_its_server_and_the_resumed_run_evaluates_again(stand_in, by_the_scheduler):
    """by_the_scheduler: Slurm's preemption and pkill signal every process of the job, and the rollout dies of
    the SIGTERM that preempts the trainer before the trainer stops it: no failure of the checkpoint either."""
    ev = stand_in.evaluator()
    ev.after_save(3, stand_in.ckpt(3))
    ev.after_save(6, stand_in.ckpt(6))
    server = psutil.Process(stand_in.started(3))
    rollout = psutil.Process(ev.running.proc.pid)
    if by_the_scheduler:
        os.kill(rollout.pid, signal.SIGTERM)
        server.kill()  # its share of the job-wide signal
        ev.running.proc.wait(60)
    ev.close(preempted=True)
    assert ends(rollout) and ends(server)  # the server was in a session of its own
    assert evaluations.read_failure(stand_in.ckpt(3)) is None
    assert not glob.glob(os.path.join(stand_in.ckpt(3), ".eval.partial_*"))  # its partial output is removed
    assert stand_in.evaluating() == [3, 6]  # the markers stay: both are evaluated again
    assert not os.path.exists(os.path.join(stand_in.dir, "metrics.jsonl"))

    os.remove(os.path.join(stand_in.dir, "..", "control", "started_3"))
    resumed = stand_in.evaluator(start_step=6)
    assert resumed.running.checkpoint == stand_in.ckpt(3) and resumed.waiting == stand_in.ckpt(6)
    stand_in.started(3)
    stand_in.go(3, 2)
    stand_in.go(6, 4)
    resumed.close(preempted=False)
    assert [(r["step"], r["eval/success_rate"]) for r in stand_in.records()] == [(3, 0.5), (6, 1.0)]
    assert stand_in.evaluating() == []
    assert open(os.path.join(stand_in.dir, "best")).read().strip() == "checkpoint_step_6"


def test_a_follower_s_records_are_logged_and_nothing_is_started(stand_in):
    cfg = load_config("configs/tiny.yaml", ALOHA_SHAPED + ["evaluation.interval=3", "system.save_interval=3",
                                                           "evaluation.runner=follower"])
    from train.evaluation import Evaluator
    from utils.metrics import Metrics

    ev = Evaluator(cfg, stand_in.dir, Metrics(cfg, stand_in.dir, True, 0, "none"), True)
    ev.after_save(3, stand_in.ckpt(3))
    assert ev.running is None and stand_in.evaluating() == []
    os.makedirs(os.path.join(stand_in.ckpt(6), "eval"))
    report = {"results": {"policy": {"success_rate": 0.5, "episodes": 2, "wilson_95": [0.1, 0.9],
                                     "mean_max_reward": 2.0, "per_episode": []}}}
    with open(evaluations.report_path(stand_in.ckpt(6)), "w") as f:
        json.dump(report, f)
    evaluations.record_failure(stand_in.ckpt(9), "the follower's server did not start")
    ev.poll()
    ev.poll()
    ev.close(preempted=False)
    assert stand_in.records() == [
        {"step": 6, "eval/success_rate": 0.5, "eval/success_low": 0.1, "eval/success_high": 0.9,
         "eval/mean_max_reward": 2.0, "eval/episodes": 2},
        {"step": 9, "eval/error": "the follower's server did not start"}]

    off = load_config("configs/tiny.yaml")  # evaluation.task null (interval 0) on rank 0, then any cfg on rank 1
    for disabled in (Evaluator(off, stand_in.dir, Metrics(off, stand_in.dir, True, 13, "none"), True),
                     Evaluator(cfg, stand_in.dir, Metrics(cfg, stand_in.dir, False, 0, "none"), False)):
        disabled.after_save(13, stand_in.ckpt(13))
        disabled.poll()
        disabled.close(preempted=True)
    assert len(stand_in.records()) == 2 and stand_in.evaluating() == []


# --- training with evaluation, for real -----------------------------------------------------------

def aloha_shaped_dataset(folder):
    """Two 40-frame episodes of 14-D actions and state and one 48x64 camera (random values: the rollouts
    check the plumbing, not a skill)."""
    from data.lerobot_writer import LeRobotWriter

    rng = np.random.default_rng(0)
    writer = LeRobotWriter(str(folder), fps=50, features={
        "observation.state": {"dtype": "float32", "shape": [14], "names": None},
        "action": {"dtype": "float32", "shape": [14], "names": None},
        "observation.images.top": {"dtype": "video", "shape": [48, 64, 3], "names": ["height", "width", "channels"]}})
    for _ in range(2):
        writer.add_episode({"observation.state": rng.normal(0, 0.1, (40, 14)).astype(np.float32),
                            "action": rng.normal(0, 0.1, (40, 14)).astype(np.float32),
                            "observation.images.top": rng.integers(0, 256, (40, 48, 64, 3), dtype=np.uint8)},
                           "Pick up the cube.")
    writer.close()
    return str(folder)


@pytest.fixture(scope="module")
def aloha_recipe(tmp_path_factory):
    """Overrides of configs/tiny.yaml for a transfer_cube-shaped run on the tiny frozen parts."""
    from train.train import make_generated_inputs

    make_generated_inputs(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                                      [f"dataset.dataset_dir={ROOT}/assets/synthetic"] + TINY_PARTS))
    data = aloha_shaped_dataset(tmp_path_factory.mktemp("aloha_shaped") / "data")
    return [*ALOHA_SHAPED, *TINY_PARTS, "dataset.type=lerobot", f"dataset.dataset_dir={data}",
            "dataset.val_fraction=0", "serving.image_shape=[48,64,3]", "serving.state_key=observation.state",
            "serving.prompt_key=task", "system.total_limit=null", "logging.report_to=tensorboard",
            "evaluation.interval=3", "evaluation.episodes=2", "evaluation.episode_steps=20", "evaluation.workers=1",
            "evaluation.videos=1"]


TINY_PARTS = [f"model.{k}={ROOT}/assets/tiny/{part}" for k, part in
              (("wan.text_encoder_path", "text_encoder"), ("wan.vae_path", "vae"), ("vlm.checkpoint_path", "vlm"))]


def tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(folder, "tensorboard_logs"), size_guidance={"images": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)], events.Tags()["images"]


@pytest.mark.distributed
def test_training_logs_each_save_s_success_once_across_a_resume_and_a_failed_rollout_is_logged(tmp_path,
                                                                                              aloha_recipe):
    result = train(tmp_path, 1, "eval", aloha_recipe, deepspeed=None, timeout=900)
    out = result.stdout + result.stderr
    folder = run_dir(tmp_path, "eval")
    evals = [r for r in metrics(tmp_path, "eval") if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [3, 6], out[-3000:]
    for record in evals:
        report = evaluations.read_report(os.path.join(folder, f"checkpoint_step_{record['step']}"))
        policy = report["results"]["policy"]
        assert record["eval/success_rate"] == policy["success_rate"] and record["eval/episodes"] == 2
        assert [record["eval/success_low"], record["eval/success_high"]] == policy["wilson_95"]
        assert record["eval/latency_p50_ms"] == policy["latency_ms"]["p50"] > 0
        assert report["steps"] == 20 and report["seeds"] == [1_000_000, 1_000_001]
        assert list(report["results"]) == ["policy"] and report["policy"]["checkpoint"].endswith(
            f"checkpoint_step_{record['step']}")
    scalars, images = tensorboard_scalars(folder, "eval/success_rate")
    assert scalars == [(r["step"], pytest.approx(r["eval/success_rate"])) for r in evals]
    assert "eval/video" in images
    for line in ("evaluation: started on checkpoint_step_3 (2 episodes of transfer_cube",
                 "evaluation: started on checkpoint_step_6", "training is done; waiting for the evaluation of"):
        assert line in out, out[-3000:]
    assert os.path.exists(os.path.join(folder, "best")) and os.path.exists(os.path.join(folder, "eval_logs",
                                                                                       "checkpoint_step_6.log"))

    # resumed to step 9, its rollout served on a GPU that is not there: the policy server fails, then the
    # rollout; training finishes
    result = train(tmp_path, 1, "eval", [*aloha_recipe, "resume.checkpoint_path=auto", "training.max_steps=9",
                                         "evaluation.device=cuda:7"], deepspeed=None, timeout=900)
    records = [r for r in metrics(tmp_path, "eval") if any(k.startswith("eval/") for k in r)]
    assert [(r["step"], "eval/error" in r) for r in records] == [(3, False), (6, False), (9, True)]  # once each
    error = records[-1]["eval/error"]
    assert error.startswith("inference.rollout ended with exit code 1: rollout failed: the policy server for "
                            "--checkpoint "), error
    assert "cuda" in error.split(" ... ")[1].lower(), error  # the server's own last line
    assert "Training finished at step 9" in result.stdout
    assert f"evaluation of checkpoint_step_9 failed: {error}" in result.stdout + result.stderr
    ckpt = os.path.join(folder, "checkpoint_step_9")
    assert evaluations.read_failure(ckpt) == error and evaluations.read_report(ckpt) is None
    assert not os.path.exists(os.path.join(ckpt, evaluations.EVALUATING))
    assert [s for s, _ in tensorboard_scalars(folder, "eval/success_rate")[0]] == [3, 6]
