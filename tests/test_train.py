"""The recipe end to end: ZeRO-1/2 with 2 processes against 1 process, exact resume, launchers, bad input."""
import concurrent.futures
import json
import os
import subprocess

import pytest
import torch

from tests.helpers import FAST, PYTHON, ROOT, free_port, losses, metrics, run_dir, torchrun, train
from checkpoint.checkpointer import complete_checkpoints

pytestmark = pytest.mark.distributed

# One global batch of 4 samples per step: 1 process x 4, or 2 processes x 2.
LAYOUTS = {
    "w1_zero2": dict(nproc=1, deepspeed="configs/zero2.json", overrides=["training.batch_size=4"]),
    "w2_zero1": dict(nproc=2, deepspeed="configs/zero1.json", overrides=["training.batch_size=2"]),
    "w2_zero2": dict(nproc=2, deepspeed="configs/zero2.json", overrides=["training.batch_size=2"]),
}
# EMA on in every layout: updates after steps 3 (a copy) and 6 (decay min(0.1, 2/11) = 0.1), both
# saved, so that it can be recomputed from the raw weights; validated with the EMA at step 6.
EMA = ["training.ema.enabled=true", "training.ema.decay=0.1", "training.ema.start_step=3",
       "training.ema.update_every=3", "system.val_interval=6", "system.val_batches=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 6-step runs (saving at 3 and 6), then each resumed from its step-3 checkpoint; a
    1-process run with gradient accumulation, and one that validates after every step. The 1-process launches run beside the 2-process ones (two
    threads): a 1-process run leaves the second core idle. Each result is the same either way."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}

    def layout_and_resume(name):
        layout = LAYOUTS[name]
        train(tmp, layout["nproc"], name, layout["overrides"] + EMA, layout["deepspeed"])
        ckpt = os.path.join(run_dir(tmp, name), "checkpoint_step_3")
        resumed = f"{name}_resumed"
        train(tmp, layout["nproc"], resumed, layout["overrides"] + EMA + [f"resume.checkpoint_path={ckpt}"],
              layout["deepspeed"])
        out[name] = metrics(tmp, name)
        # resuming continues the checkpoint's own run: its metrics.jsonl gets steps 4-6 again
        out[resumed] = metrics(tmp, name)

    def one_process():
        layout_and_resume("w1_zero2")
        train(tmp, 1, "w1_ga2", ["training.batch_size=2", "training.gradient_accumulation_steps=2",
                                 "training.max_steps=4"])
        out["w1_ga2"] = metrics(tmp, "w1_ga2")
        train(tmp, 1, "w1_val_every_step", LAYOUTS["w1_zero2"]["overrides"] + EMA + ["system.val_interval=1"])
        out["w1_val_every_step"] = metrics(tmp, "w1_val_every_step")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        launched = [pool.submit(one_process), pool.submit(lambda: [layout_and_resume(n) for n in LAYOUTS
                                                                  if LAYOUTS[n]["nproc"] == 2])]
        for future in launched:
            future.result()
    return tmp, out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bit_identical(runs, name):
    tmp, out = runs
    assert [r["step"] for r in out[f"{name}_resumed"]] == [1, 2, 3, 4, 5, 6]
    # metrics.jsonl now holds the resumed run's steps 4-6; the uninterrupted run's were moved aside
    resumed = losses(out[name])
    rewound = [os.path.basename(p) for p in os.listdir(run_dir(tmp, name)) if "rewound" in p]
    assert rewound, "the records after the resumed step must be kept aside, not lost"
    with open(os.path.join(run_dir(tmp, name), rewound[0])) as f:
        records = [json.loads(line) for line in f]
    uninterrupted = {r["step"]: r["loss"] for r in records}
    assert uninterrupted == {s: resumed[s] for s in (4, 5, 6)}, "resume must reproduce losses exactly"
    # the EMA (restored with its update count) gives the same held-out errors, bit for bit
    ema_keys = [k for k in records[-1] if k.startswith("val_ema_")]
    assert {"val_ema_loss", "val_ema_policy_action_mse"} <= set(ema_keys)
    assert {k: records[-1][k] for k in ema_keys} == {k: out[name][-1][k] for k in ema_keys}
    assert records[-1]["val_ema_loss"] != records[-1]["val_loss"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_cpu_clock_goes_on_across_a_resume(runs, name):
    """Training's CPU seconds (train/cpu_clock.py) grow with every record; the step-3 save holds the
    count up to its step, read after the record; the resumed run goes on from it."""
    tmp, out = runs
    d = run_dir(tmp, name)
    rewound = [p for p in os.listdir(d) if "rewound" in p][0]
    with open(os.path.join(d, rewound)) as f:
        uninterrupted = [json.loads(line) for line in f]  # steps 4-6 of the run that was not stopped
    with open(os.path.join(d, "checkpoint_step_3", "trainer_state.json")) as f:
        saved = json.load(f)
    resumed = out[f"{name}_resumed"]
    for records in (resumed, uninterrupted):
        clock = [r["cpu_seconds"] for r in records]
        assert clock[0] > 0 and all(b > a for a, b in zip(clock, clock[1:])), clock
    assert saved["cpu_seconds_since_step"] == 0 and "cpu_seconds_since_step" not in resumed[-1]
    assert resumed[2]["cpu_seconds"] <= saved["cpu_seconds"] < resumed[3]["cpu_seconds"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ema_matches_a_recomputation_from_the_raw_weights(runs, name):
    """The EMA the ranks kept in their ZeRO partitions (reassembled by name from every rank's file)
    against 0.1 * w3 + 0.9 * w6 from the raw weights saved at steps 3 and 6, in float64."""
    from checkpoint.finetune import read_weights
    tmp, _ = runs
    d = run_dir(tmp, name)
    w3, w6 = (read_weights(os.path.join(d, f"checkpoint_step_{s}")) for s in (3, 6))
    ema = read_weights(os.path.join(d, "checkpoint_step_6"), weights="ema")
    trainable = [k for k in w6 if not torch.equal(w3[k], w6[k])]
    assert len(trainable) > 100
    for k in trainable:
        reference = 0.1 * w3[k].double() + 0.9 * w6[k].double()
        assert torch.allclose(ema[k].double(), reference, rtol=0, atol=1e-6), k


def test_ema_costs_4_bytes_per_parameter_over_the_world_size(runs):
    """Each rank's saved EMA is shaped like its fp32 master partition (zero_layout.json's partition_size,
    group by group): 4 bytes per trainable parameter at W=1, halved (to within DeepSpeed's alignment
    padding) at W=2, the same under ZeRO-1 and ZeRO-2."""
    tmp, _ = runs

    def ema_elements(name):
        engine = os.path.join(run_dir(tmp, name), "checkpoint_step_6", "engine")
        with open(os.path.join(engine, "zero_layout.json")) as f:
            sizes = [g["partition_size"] for g in json.load(f)["groups"]]
        partitions = torch.load(os.path.join(engine, "ema_rank_0.pt"), weights_only=True)["partitions"]
        assert [t.numel() for t in partitions] == sizes and {t.dtype for t in partitions} == {torch.float32}
        return sum(sizes)

    ema1, ema2 = ema_elements("w1_zero2"), ema_elements("w2_zero2")
    assert ema1 > 300_000 and 0 <= 2 * ema2 - ema1 <= 2 * 64  # tiny: 0.36M trainable parameters
    assert ema_elements("w2_zero1") == ema2


def test_gradient_accumulation_matches_a_larger_batch(runs):
    """2 micro-steps of 2 samples make the same update as 1 step of 4: the same losses, step by step."""
    _, out = runs
    ref, got = losses(out["w1_zero2"]), losses(out["w1_ga2"])
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-4, abs=1e-5), (step, got, ref)


def test_validation_leaves_training_untouched(runs):
    """Validating after every step (its own noise, its own loader) gives the losses of a run that
    validates once at the end, bit for bit: `system.val_interval` changes the cost, not the run."""
    _, out = runs
    every = out["w1_val_every_step"]
    assert [r["step"] for r in every if "val_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert losses(every) == losses(out["w1_zero2"])


@pytest.mark.parametrize("name", ["w2_zero1", "w2_zero2"])
def test_two_processes_match_one(runs, name):
    _, out = runs
    ref, got = losses(out["w1_zero2"]), losses(out[name])
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4, abs=1e-5), (step, got, ref)


def test_metrics_record_schedule_and_norms(runs):
    _, out = runs
    rec = out["w2_zero2"]
    for r in rec:
        for key in ("step", "loss", "video_loss", "action_loss", "lr", "grad_norm", "samples_per_sec", "step_time"):
            assert key in r
    # tiny.yaml: linear schedule, 2 warmup steps (FAST), lr 5e-3: step 1 runs at half the peak, then
    # Motus's linear decay towards f_min = 0.1 at cycle_length = 300
    first_lrs = rec[0]["lr"]
    assert set(first_lrs) == {"muon", "adamw"}
    assert all(v == pytest.approx(2.5e-3) for v in first_lrs.values()), first_lrs
    assert all(v == pytest.approx(5e-3) for v in rec[1]["lr"].values())
    assert all(v == pytest.approx(5e-3 * (0.1 + 0.9 * (300 - 3) / (300 - 2))) for v in rec[2]["lr"].values())


def test_retention_and_latest(runs):
    tmp, _ = runs
    d = run_dir(tmp, "w2_zero2")
    assert [os.path.basename(p) for p in complete_checkpoints(d)] == ["checkpoint_step_3", "checkpoint_step_6"]
    assert open(os.path.join(d, "latest")).read().strip() == "checkpoint_step_6"


def test_bad_dataset_path_fails_on_every_rank(tmp_path):
    r = train(tmp_path, 2, "bad", ["dataset.type=lerobot", "dataset.dataset_dir=/nonexistent/data"], check=False,
              timeout=180)
    assert r.returncode != 0
    assert r.stderr.count("/nonexistent/data") >= 2, r.stderr[-3000:]  # both ranks say why


@pytest.mark.parametrize("args,match", [
    (["--deepspeed", "configs/zero9.json"], "configs/zero9.json' does not exist"),
    (["training.optimizer=lion"], "training.optimizer"),
    (["training.global_batch_size=6"], "global_batch_size=6"),
])
def test_bad_input_exits_nonzero(tmp_path, args, match):
    r = torchrun(1, ["--config", "configs/tiny.yaml", "--checkpoint_dir", str(tmp_path), *args], timeout=180)
    assert r.returncode != 0 and match in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_other_launchers_give_the_same_run(runs, tmp_path, launcher):
    """The deepspeed launcher and `accelerate launch` (its torchrun-based --multi_gpu path, which also
    runs on CPU) start the same 2-process ZeRO-2 run as torchrun: the same losses, exactly."""
    bin_dir = os.path.dirname(PYTHON)
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [os.path.join(bin_dir, "deepspeed"), "--num_gpus", "2", "--master_port", port]
    else:
        cmd = [os.path.join(bin_dir, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    cmd += ["train/train.py", "--config", "configs/tiny.yaml", "--deepspeed", "configs/zero2.json",
            "--checkpoint_dir", str(tmp_path), "--run_name", launcher, *FAST, "training.max_steps=2",
            "training.batch_size=2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    _, out = runs
    ref = losses(out["w2_zero2"])
    assert losses(metrics(tmp_path, launcher)) == {1: ref[1], 2: ref[2]}


STUCK_TEARDOWN = """import atexit, os, sys, time
sys.path.insert(0, {root!r})
from train import train as trainer

class StuckState(trainer.TrainerState):
    def __del__(self):  # never returns, as a destructor joining a gloo thread that waits for the GIL
        time.sleep(3600)

trainer.TrainerState = StuckState
atexit.register(lambda: open({marker!r}, "w").write(str(os.getpid())))
trainer.run_guarded(trainer.main)
"""


def test_a_finished_run_exits_without_the_interpreter_teardown(tmp_path):
    """train.py ends with utils/dist.leave: the exit handlers run, the teardown of the trainer's
    objects does not. Here a local of main() (its TrainerState) has a destructor that never returns:
    freed, it would hold the rank after its last line, as a gloo group joined by a destructor that
    holds the GIL did (1 DDP run in 10)."""
    launcher, marker = tmp_path / "stuck_teardown.py", tmp_path / "exit_handlers_ran"
    launcher.write_text(STUCK_TEARDOWN.format(root=ROOT, marker=str(marker)))
    result = train(tmp_path, 1, "leave", ["training.max_steps=1", "system.save_interval=1"], deepspeed=None,
                   script=str(launcher), timeout=120)
    assert "Training finished at step 1." in result.stdout
    assert marker.read_text().isdigit()
