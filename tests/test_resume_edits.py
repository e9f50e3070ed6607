"""Resume with an edited YAML: every edit takes effect, or is refused by name (train/resume_policy.py).

The distributed tests resume a 2-process run (ZeRO-2, and DDP) from its step-2 checkpoint with
another learning rate, weight decay, AdamW betas and Muon momentum, and compare the weights and
optimizer state after step 3 with an update computed here from the saved state and the new
hyperparameters. The gradient of step 3 comes from the same run continued without a resume:
it trains with Muon momentum 0 and AdamW beta1 0, so its step-3 momentum buffer and first
moment *are* that gradient, bit for bit (lerp with weight 1 returns its end exactly), and the
resumed run computes the same gradient (same weights, batch, noise and RNG at the same world size).
"""
import concurrent.futures
import json
import math
import os
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from checkpoint.checkpointer import NOT_LISTED, seal
from checkpoint.manifest import digest_files, list_files
from tests.helpers import metrics, run_dir, torchrun, train
from train import resume_policy
from recipe.config import load_config, save_config
from recipe.schema import Config

BASE = ["training.scheduler_type=constant", "training.warmup_steps=0", "training.max_steps=3",
        "system.save_interval=1", "system.speed.fused_adamw=false", "training.batch_size=2",
        "training.muon.momentum=0.0", "training.betas=[0.0,0.999]"]
OLD = dict(lr=5e-3, wd=0.01, betas=(0.0, 0.999), momentum=0.0)  # configs/tiny.yaml + BASE
NEW = dict(lr=1e-3, wd=0.5, betas=(0.5, 0.99), momentum=0.9)
EDITS = ["training.learning_rate=1e-3", "training.weight_decay=0.5", "training.betas=[0.5,0.99]",
         "training.muon.momentum=0.9"]
LAUNCHERS = {"zero2": "configs/zero2.json", "ddp": None}


# --- reading a checkpoint by parameter name --------------------------------------------------------
def saved_state(ckpt):
    """{name: {"w": fp32 weight, "group": group name, "step": int, state key: tensor}} of the
    trainable tensors of a ZeRO-1/2 or DDP checkpoint."""
    from checkpoint.zero import ShardReader, read_layout
    engine = os.path.join(ckpt, "engine")
    layout = read_layout(engine)
    out = {}
    if layout["zero_stage"]:
        reader = ShardReader(engine)
        groups = reader.shard(0)[2]["base_optimizer_state"]["param_groups"]
        for name, (g, _, _, _) in reader.where.items():
            keys, scalars = reader.state_keys(g)
            out[name] = {"w": reader.full(name), "group": groups[g]["name"], "step": int(scalars.get("step", 0)),
                         **{k: reader.full(name, k) for k in keys}}
        return out
    weights = torch.load(os.path.join(engine, "model.pt"), weights_only=True)
    optimizer = torch.load(os.path.join(engine, "optimizer.pt"), weights_only=True)
    index = 0
    for g, group in enumerate(layout["groups"]):
        for p in group["params"]:
            state = optimizer["state"][index]
            out[p["name"]] = {"w": weights[p["name"]], "group": optimizer["param_groups"][g]["name"],
                              **{k: v for k, v in state.items() if k != "step"}}
            if "step" in state:
                out[p["name"]]["step"] = int(state["step"])
            index += 1
    return out


# --- the update, by hand ---------------------------------------------------------------------------
def adamw_by_hand(w, m, v, step, g, lr, wd, betas, eps=1e-8):
    """torch's single-tensor AdamW step (decoupled weight decay), op for op."""
    b1, b2 = betas
    w = w * (1 - lr * wd)
    m = m.lerp(g, 1 - b1)
    v = torch.addcmul(v * b2, g, g, value=1 - b2)
    step += 1
    denom = (v.sqrt() / (1 - b2 ** step) ** 0.5) + eps
    return w.addcdiv(m, denom, value=-(lr / (1 - b1 ** step))), m, v


def muon_by_hand(w, buf, g, lr, wd, momentum):
    """Nesterov momentum; the quintic Newton-Schulz iteration in fp32 (configs/tiny.yaml: ns_dtype
    float32, the default coefficients, 5 steps) on each [A, B] matrix of the tensor (a 3-D tensor
    holds several), the wide way round; the match_rms_adamw lr 0.2 * sqrt(max(A, B)) * lr; decoupled
    weight decay with the plain lr."""
    buf = buf.lerp(g, 1 - momentum)
    u = g.lerp(buf, momentum)
    x = u.reshape(-1, *u.shape[-2:]) if u.dim() == 3 else u.reshape(1, u.shape[0], -1)
    a, b = x.shape[-2:]
    x = x.mT if a > b else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=-4.7750, alpha=2.0315)
        x = torch.baddbmm(x, poly, x, beta=3.4445)
    o = (x.mT if a > b else x).reshape(w.shape)
    return (w * (1 - lr * wd)).add(o, alpha=-(lr * 0.2 * math.sqrt(max(a, b)))), buf


def expected_step3(before, after_old_run, h):
    """{name: (weight, state)} after step 3 from the step-2 state `before`, the step-3 gradient (the
    momentum-0 / beta1-0 run's step-3 state `after_old_run`) and the hyperparameters `h`."""
    out = {}
    for name, s in before.items():
        g = after_old_run[name]["momentum_buffer" if s["group"] == "muon" else "exp_avg"]
        if s["group"] == "muon":
            w, buf = muon_by_hand(s["w"], s["momentum_buffer"], g, h["lr"], h["wd"], h["momentum"])
            out[name] = (w, {"momentum_buffer": buf})
        else:
            w, m, v = adamw_by_hand(s["w"], s["exp_avg"], s["exp_avg_sq"], s["step"], g, h["lr"], h["wd"],
                                    h["betas"])
            out[name] = (w, {"exp_avg": m, "exp_avg_sq": v})
    return out


@pytest.fixture(scope="module")
def edited(tmp_path_factory):
    """Per launcher: a 3-step run (checkpoints 2 and 3), and its step-2 checkpoint resumed with EDITS
    (in a copy, so that the resumed run writes its own step-3 checkpoint)."""
    tmp = tmp_path_factory.mktemp("edited")
    out = {}
    for launcher, ds in LAUNCHERS.items():
        train(tmp, 2, launcher, BASE, ds)
        copy = os.path.join(run_dir(tmp, f"{launcher}_edited"), "checkpoint_step_2")
        shutil.copytree(os.path.join(run_dir(tmp, launcher), "checkpoint_step_2"), copy)
        resumed = train(tmp, 2, f"{launcher}_edited", BASE + EDITS + [f"resume.checkpoint_path={copy}"], ds)
        out[launcher] = resumed.stderr
    return tmp, out


@pytest.fixture(scope="module")
def one_process(edited):
    """The 1-process launches of the tests below, side by side in two threads (each leaves a core idle):
    the ZeRO-2 step-2 checkpoint resumed by 1 process with EDITS; a fine-tune recipe with
    resume.checkpoint_path=auto launched twice from the DDP step-2 weights, moved away between the
    launches (the second must not read them)."""
    tmp, _ = edited

    def world_size_one():
        copy = os.path.join(run_dir(tmp, "w1_edited"), "checkpoint_step_2")
        shutil.copytree(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_2"), copy)
        return train(tmp, 1, "w1_edited", BASE + EDITS + ["training.batch_size=4", f"resume.checkpoint_path={copy}"])

    def finetune_twice():
        source = os.path.join(str(tmp), "ft_source", "checkpoint_step_2")
        shutil.copytree(os.path.join(run_dir(tmp, "ddp"), "checkpoint_step_2"), source)
        ft = BASE + [f"finetune.checkpoint_path={source}", "resume.checkpoint_path=auto", "training.max_steps=1"]
        first = train(tmp, 1, "ft", ft, deepspeed=None)
        shutil.move(source, source + "_moved")
        return source, first, train(tmp, 1, "ft", ft[:-1] + ["training.max_steps=2"], deepspeed=None)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        w1, ft = pool.submit(world_size_one), pool.submit(finetune_twice)
        return {"w1_edited": w1.result(), "ft": ft.result()}


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_resume_logs_the_edits_and_trains_at_the_new_lr(edited, launcher):
    tmp, logs = edited
    assert ("resume: training.learning_rate 0.005 -> 0.001; training.weight_decay 0.01 -> 0.5; "
            "training.betas [0.0, 0.999] -> [0.5, 0.99]; training.muon.momentum 0.0 -> 0.9") in logs[launcher]
    records = metrics(tmp, f"{launcher}_edited")
    assert [r["step"] for r in records] == [3]
    assert records[0]["lr"] == {"muon": 1e-3, "adamw": 1e-3}


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_resumed_update_uses_the_new_hyperparameters_and_the_saved_state(edited, launcher):
    """AdamW weights and every optimizer state (moments, Muon momentum buffers, step counts):
    bit-exact. Muon weights: within 3e-8, two fp32 ulps of the weights (|w| < 0.25; measured: one
    ulp, 1.5e-8): Newton-Schulz runs here on one tensor's matrices and in the trainer on every
    same-shape matrix of the group as one batch, whose matmul blocking may round the last bit
    differently. The checkpoint's hyperparameters give weights more than 1e-6 away."""
    tmp, _ = edited
    before = saved_state(os.path.join(run_dir(tmp, launcher), "checkpoint_step_2"))
    gradient_run = saved_state(os.path.join(run_dir(tmp, launcher), "checkpoint_step_3"))
    got = saved_state(os.path.join(run_dir(tmp, f"{launcher}_edited"), "checkpoint_step_3"))
    want, stale = expected_step3(before, gradient_run, NEW), expected_step3(before, gradient_run, OLD)
    groups = {s["group"] for s in before.values()}
    assert groups == {"muon", "adamw"}
    muon_err = 0.0
    for name, (w, state) in want.items():
        for key, value in state.items():
            assert torch.equal(got[name][key], value), (name, key)  # the saved moments carried on
        if before[name]["group"] == "adamw":
            assert got[name]["step"] == 3, name
            assert torch.equal(got[name]["w"], w), (name, (got[name]["w"] - w).abs().max())
        else:
            muon_err = max(muon_err, (got[name]["w"] - w).abs().max().item())
        # the checkpoint's hyperparameters give another update: the test can tell them apart
        assert not torch.allclose(got[name]["w"], stale[name][0], rtol=0, atol=1e-6), name
    assert muon_err <= 3e-8, muon_err


@pytest.mark.distributed
def test_edits_take_effect_at_another_world_size(edited, one_process):
    """The 2-process ZeRO-2 checkpoint resumed by 1 process (batches of 4: the same samples per step)
    with EDITS: the state is re-partitioned by name (checkpoint/zero.py), the hyperparameters are
    the YAML's. The gradient is now summed in another order than the 2-process run's (whose
    gradient the expected update uses), so the weights are compared within 5e-7 (measured: 1.2e-7;
    the checkpoint's hyperparameters give weights at least 3e-5 away) and each state tensor within
    1e-5 of its largest element (measured: 2.7e-6)."""
    tmp, _ = edited
    result = one_process["w1_edited"]
    assert "training.batch_size 2 -> 4" in result.stderr and "a step now takes" not in result.stderr
    assert metrics(tmp, "w1_edited")[0]["lr"] == {"muon": 1e-3, "adamw": 1e-3}
    before = saved_state(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_2"))
    gradient_run = saved_state(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_3"))
    got = saved_state(os.path.join(run_dir(tmp, "w1_edited"), "checkpoint_step_3"))
    want, stale = expected_step3(before, gradient_run, NEW), expected_step3(before, gradient_run, OLD)
    for name, (w, state) in want.items():
        torch.testing.assert_close(got[name]["w"], w, rtol=0, atol=5e-7, msg=name)
        assert not torch.allclose(got[name]["w"], stale[name][0], rtol=0, atol=1e-5), name
        for key, value in state.items():
            torch.testing.assert_close(got[name][key], value, rtol=0, atol=1e-5 * value.abs().max().item(),
                                       msg=f"{name} {key}")


@pytest.mark.distributed
def test_reset_optimizer_keeps_the_weights_and_starts_a_fresh_optimizer(edited):
    """ZeRO-2 muon_adamw checkpoint resumed as plain AdamW: the step-3 update is AdamW's first step
    (zero moments, step 1) from the saved fp32 weights, bit for bit."""
    tmp, _ = edited
    copy = os.path.join(run_dir(tmp, "reset"), "checkpoint_step_2")
    shutil.copytree(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_2"), copy)
    result = train(tmp, 2, "reset", BASE + ["training.optimizer=adamw", "training.betas=[0.9,0.999]",
                                            "resume.reset_optimizer=true", f"resume.checkpoint_path={copy}"])
    assert "resume.reset_optimizer: the weights are the checkpoint's, the optimizer starts fresh" in result.stderr
    assert "training.optimizer muon_adamw -> adamw" in result.stderr
    before = saved_state(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_2"))
    gradient_run = saved_state(os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_3"))
    got = saved_state(os.path.join(run_dir(tmp, "reset"), "checkpoint_step_3"))
    for name, s in before.items():
        g = gradient_run[name]["momentum_buffer" if s["group"] == "muon" else "exp_avg"]
        zeros = torch.zeros_like(g)
        w, m, v = adamw_by_hand(s["w"], zeros, zeros, 0, g, OLD["lr"], OLD["wd"], (0.9, 0.999))
        assert got[name]["group"] == "adamw" and got[name]["step"] == 1, name
        assert torch.equal(got[name]["exp_avg"], m) and torch.equal(got[name]["exp_avg_sq"], v), name
        assert torch.equal(got[name]["w"], w), (name, (got[name]["w"] - w).abs().max())


@pytest.mark.distributed
def test_a_finetune_recipe_with_resume_auto_starts_from_the_weights_then_resumes(edited, one_process):
    """finetune.checkpoint_path and resume.checkpoint_path=auto in one YAML (a fine-tune that SLURM may
    requeue): the first launch starts from the fine-tune weights, the next continues the run's own
    checkpoint and does not read the fine-tune path again (moved away here, so reading it would fail)."""
    tmp, _ = edited
    source, first, second = one_process["ft"]
    assert f"fine-tune weights from {source}" in first.stderr and "resumed from" not in first.stderr
    assert "resumed from" in second.stderr and "checkpoint_step_1 at step 1" in second.stderr
    assert f"finetune.checkpoint_path {source} is not read" in second.stderr
    assert [r["step"] for r in metrics(tmp, "ft")] == [1, 2]


@pytest.mark.distributed
def test_refused_edit_exits_before_any_step_on_every_rank(edited):
    tmp, _ = edited
    ckpt = os.path.join(run_dir(tmp, "zero2"), "checkpoint_step_3")
    r = torchrun(2, ["--config", "configs/tiny.yaml", "--deepspeed", "configs/zero2.json", "--checkpoint_dir",
                     str(tmp), *BASE, "training.max_steps=4", "training.optimizer=adamw",
                     f"resume.checkpoint_path={ckpt}"], timeout=180)
    assert r.returncode != 0
    message = "training.optimizer is adamw but the checkpoint was trained with muon_adamw"
    assert r.stderr.count(message) == 2, r.stderr[-3000:]  # both ranks say why
    assert "set resume.reset_optimizer=true, or set training.optimizer=muon_adamw" in r.stderr
    assert "step 4" not in r.stderr and len(metrics(tmp, "zero2")) == 3


# --- the table -------------------------------------------------------------------------------------
def test_every_config_key_has_a_stated_behaviour():
    """A key added to the schema without a rule fails here; so does a rule that matches no key."""
    keys = resume_policy.leaves(OmegaConf.structured(Config))
    assert len(keys) > 100
    uncovered = []
    for key in keys:
        try:
            resume_policy.rule_for(key)
        except KeyError:
            uncovered.append(key)
    assert not uncovered, uncovered
    used = {resume_policy.rule_for(k).pattern for k in keys}
    assert [r.pattern for r in resume_policy.RULES if r.pattern not in used] == []
    assert resume_policy.rule_for("training.learning_rate").behaviour == resume_policy.EFFECT
    assert resume_policy.rule_for("model.size").behaviour == resume_policy.REFUSED
    assert resume_policy.rule_for("training.optimizer").unless == "resume.reset_optimizer"
    assert resume_policy.rule_for("training.scheduler_type").unless == "resume.reset_scheduler"


def test_training_md_lists_the_table():
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "TRAINING.md")) as f:
        assert resume_policy.render() in f.read(), "regenerate with python -m train.resume_policy"


def _checkpoint(tmp_path, overrides, world_size=1):
    ckpt = tmp_path / f"run{len(list(tmp_path.iterdir()))}" / "checkpoint_step_4"
    ckpt.mkdir(parents=True)
    save_config(load_config("configs/tiny.yaml", overrides), str(ckpt / "config.yaml"))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "samples_seen": 16}))
    seal(str(ckpt), 4, digest_files(str(ckpt), list_files(str(ckpt), NOT_LISTED)),
         {"weights_finite": True, "loss_finite": True}, world_size)  # the manifest records the world size
    return str(ckpt)


@pytest.mark.parametrize("overrides,message", [
    (["model.size=small"], "model.size is small but the checkpoint was trained with tiny"),
    (["common.action_dim=6"], "common.action_dim is 6 but the checkpoint was trained with 4"),
    (["model.precision=bf16_mixed"], "model.precision is bf16_mixed but the checkpoint was trained with fp32"),
    (["training.scheduler_type=cosine"], "set resume.reset_scheduler=true, or set training.scheduler_type=linear"),
    (["training.muon.routing=action_expert_only"], "set resume.reset_optimizer=true"),
])
def test_refused_edits_name_the_key_and_both_values(tmp_path, overrides, message):
    ckpt = _checkpoint(tmp_path, [])
    with pytest.raises(resume_policy.ResumeRefused, match=message.replace("[", r"\[")):
        resume_policy.check(load_config("configs/tiny.yaml", overrides), ckpt, 1)


def test_allowed_edits_are_listed_with_their_consequences(tmp_path):
    ckpt = _checkpoint(tmp_path, ["training.batch_size=4"], world_size=2)
    cfg = load_config("configs/tiny.yaml", ["training.batch_size=2", "model.precision=fp32_mixed",
                                            "training.grad_clip_norm=0.5", "training.ema.enabled=true",
                                            "training.scheduler_type=cosine", "resume.reset_scheduler=true"])
    edits = resume_policy.check(cfg, ckpt, 1)
    assert edits.line() == ("resume: model.precision fp32 -> fp32_mixed; training.batch_size 4 -> 2; "
                            "training.scheduler_type linear -> cosine; training.grad_clip_norm 1.0 -> 0.5; "
                            "training.ema.enabled false -> true; resume.reset_scheduler false -> true")
    notes = "\n".join(edits.notes)
    assert "a step now takes 2 samples instead of 8" in notes and "continues at sample 16" in notes
    assert "training.ema.enabled: turned on" in notes
    same = resume_policy.check(load_config("configs/tiny.yaml", ["resume.checkpoint_path=auto"]),
                               _checkpoint(tmp_path, []), 1)
    assert same.line() == "resume: no config change relative to the checkpoint's config.yaml" and not same.notes


# --- the pieces ------------------------------------------------------------------------------------
def test_group_options_survive_a_state_load():
    """The optimizer loads another run's state dict: its moments and step come in, its groups'
    hyperparameters are put back to the built ones."""
    from optim.hyperparameters import apply_group_options, group_options
    from optim.muon_adamw import MuonAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))

    def built(**kw):
        return MuonAdamW(model.named_parameters(), ns_dtype="float32", world_size=1, **kw)

    old = built(lr=5e-3, weight_decay=0.01, muon_momentum=0.95, betas=(0.9, 0.999))
    model(torch.randn(4, 8)).sum().backward()
    old.step()
    new = built(lr=1e-4, weight_decay=0.5, muon_momentum=0.8, betas=(0.5, 0.99), eps=1e-6)
    fresh = group_options(new)
    new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["lr"] == 5e-3  # what torch does: the saved options come back
    apply_group_options(new, fresh)
    for group, own in zip(new.param_groups, fresh):
        assert {k: v for k, v in group.items() if k != "params"} == own
    assert new.param_groups[0]["momentum"] == 0.8 and new.param_groups[1]["betas"] == (0.5, 0.99)
    for p in model.parameters():
        assert all(torch.equal(a, b) for a, b in zip(new.state[p].values(), old.state[p].values()))


def test_stream_keeps_its_position_in_samples():
    """Saved after 3 batches of 2 at world size 2 (12 samples): resumed with batches of 4 at world
    size 1 the next batch is samples 12-15; with batches of 5, samples 12-16 (an offset of 2)."""
    from data.stream import TrainStream
    saved = TrainStream(None, 0, batch_size=2, world_size=2)
    saved.batches = 3
    state = saved.state_dict()
    assert state["samples_consumed"] == 12
    resumed = TrainStream(None, 0, batch_size=4, world_size=1)
    resumed.load_state_dict(state)
    assert next(iter(resumed._loader().batch_sampler)) == [12, 13, 14, 15]
    resumed = TrainStream(None, 0, batch_size=5, world_size=1)
    resumed.load_state_dict(state)
    assert next(iter(resumed._loader().batch_sampler)) == [12, 13, 14, 15, 16]
    assert resumed.state_dict()["samples_consumed"] == 12
