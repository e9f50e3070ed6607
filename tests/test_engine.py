"""DeepSpeed JSON filling and gradient clipping through the real engine (one process, gloo)."""
import json
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from tests.helpers import ROOT
from train.launch_checks import load_deepspeed_config
from recipe.schema import Config


def cfg(**training):
    c = OmegaConf.structured(Config)
    c.training.update(training)
    return c


def test_zero_jsons_are_the_stages_they_say():
    for stage in (1, 2):
        ds = load_deepspeed_config(f"configs/zero{stage}.json", cfg(), 2)
        assert ds["zero_optimization"]["stage"] == stage


def test_auto_fields_come_from_the_yaml():
    ds = load_deepspeed_config("configs/zero2.json", cfg(batch_size=3, gradient_accumulation_steps=2,
                                                         grad_clip_norm=0.5), 4)
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 24 and ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is False


@pytest.mark.parametrize("patch,match", [
    ({"gradient_clipping": 2.0}, "gradient_clipping' is 2.0 but the YAML gives 1.0"),
    ({"optimizer": {"type": "Muon"}}, "remove the 'optimizer' section"),
    ({"zero_optimization": {"stage": 3}}, "stage is 3"),
])
def test_contradictions_are_rejected(tmp_path, patch, match):
    with open("configs/zero2.json") as f:
        ds = json.load(f)
    ds.update(patch)
    path = tmp_path / "z.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=match):
        load_deepspeed_config(str(path), cfg(), 1)


# One SGD step (lr 1, no momentum) on a linear model: the update is the clipped gradient, so its norm
# must be exactly grad_clip_norm whenever the raw norm is larger, and the engine reports the raw norm.
CLIP = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from omegaconf import OmegaConf
    from train.launch_checks import load_deepspeed_config
    from train.launch import make_accelerator, make_engine
    from recipe.schema import Config
    from utils.batch import FlowLosses
    use_ds, clip = sys.argv[1] == "ds", float(sys.argv[2])
    cfg = OmegaConf.structured(Config)
    cfg.training.grad_clip_norm = clip
    cfg.training.batch_size = 4
    ds = load_deepspeed_config("configs/zero2.json", cfg, 1) if use_ds else None
    acc = make_accelerator(ds, 5)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
        def forward(self, inputs):
            loss = (self.lin(inputs["x"]) * 100).pow(2).mean()
            zero = torch.zeros(())  # the engine backpropagates .loss alone
            return FlowLosses(loss, zero, zero, zero, zero)

    torch.manual_seed(0)
    net = Net()
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    eng = make_engine(acc, net, opt, cfg)
    eng.micro_step({{"x": torch.randn(4, 8)}}, is_last=True)
    raw = float(eng.optimizer_step(1)[0])
    after = [p.detach().float() for p in eng.unwrapped_model().parameters()]
    delta = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, before))).item()
    print("RESULT", raw, delta)
""")


@pytest.mark.parametrize("mode", ["ds", "ddp"])
def test_gradient_clipping_is_applied(mode):
    code = CLIP.format(root=ROOT)
    out = {}
    for clip in ("0.25", "0"):
        r = subprocess.run([sys.executable, "-c", code, mode, clip], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        raw, delta = map(float, r.stdout.split("RESULT")[1].split())
        out[clip] = (raw, delta)
    raw, delta = out["0.25"]
    assert raw > 10 and delta == pytest.approx(0.25, rel=1e-4)
    raw0, delta0 = out["0"]  # 0 disables clipping: the whole gradient is applied
    assert raw0 == pytest.approx(raw, rel=1e-5) and delta0 == pytest.approx(raw, rel=1e-4)
