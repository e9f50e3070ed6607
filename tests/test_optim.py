"""MuonAdamW on one process: parity with torch.optim.Muon / AdamW, routing, ownership plan, state."""
import copy
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

import torch.optim._muon as torch_muon
from optim import MuonAdamW, build_optimizer
from optim.newton_schulz import ns_flops, orthogonalize
from optim.ownership import Piece, assign_owners, balanced_order, partition_size, predicted_pieces
from optim.routing import split_params
from recipe.schema import TrainingConfig


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matrices: one thread avoids oversubscribing shared cores (10x faster when they are busy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(torch.nn.Module):
    """Square, wide and tall matrices, a 3-D stack, biases, a norm, an embedder and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedder = torch.nn.Linear(10, 24)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            up=torch.nn.Linear(24, 56), down=torch.nn.Linear(56, 24), sq=torch.nn.Linear(24, 24, bias=False),
            norm=torch.nn.LayerNorm(24))) for _ in range(2))
        self.stack = torch.nn.Parameter(torch.randn(3, 24, 8) / 5)
        self.head = torch.nn.Linear(24 + 24, 3)

    def forward(self, x):
        h = self.embedder(x)
        for b in self.blocks:
            h = b["norm"](h + b["down"](torch.tanh(b["up"](h))) + b["sq"](h))
        q = torch.einsum("nd,kde->nke", h, self.stack).flatten(1)
        return self.head(torch.cat([h, q], 1))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 10, generator=g), torch.randn(6, 3, generator=g)


def _loss(model, step):
    x, y = _batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def _train(model, optimizers, steps, start=0):
    for s in range(start, start + steps):
        _loss(model, s).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()


def _run_reference(model, steps, lr, wd, adjust_lr_fn, fused_adamw=False):
    """Reference step: torch.optim.Muon's own functional update on 2-D views of each matrix."""
    muon, adam = split_params(model.named_parameters())
    adamw = torch.optim.AdamW([p for _, p in adam], lr=lr, weight_decay=wd, fused=fused_adamw or None)
    bufs = {n: torch.zeros_like(p) for n, p in muon}
    for s in range(steps):
        _loss(model, s).backward()
        with torch.no_grad():
            for n, p in muon:
                mats = [p] if p.ndim == 2 else list(p)
                grads = [p.grad] if p.ndim == 2 else list(p.grad)
                b = [bufs[n]] if p.ndim == 2 else list(bufs[n])
                torch_muon._single_tensor_muon(mats, grads, b, lr=lr, weight_decay=wd, momentum=0.95,
                                               nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315),
                                               ns_steps=5, eps=1e-7, adjust_lr_fn=adjust_lr_fn, has_complex=False)
        adamw.step()
        model.zero_grad()


def _zeropower_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz with only its bfloat16 cast removed."""
    a, b, c = ns_coefficients
    ortho = grad.float()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


@pytest.mark.parametrize("adjust_lr_fn,fused_adamw", [("match_rms_adamw", False), ("original", False),
                                                     ("match_rms_adamw", True)])
def test_bfloat16_matches_torch_muon_and_adamw(adjust_lr_fn, fused_adamw):
    ours, ref = Net(), Net()
    opt = MuonAdamW(ours.named_parameters(), lr=0.01, weight_decay=0.1, ns_dtype="bfloat16",
                    adjust_lr_fn=adjust_lr_fn, fused_adamw=fused_adamw)
    _train(ours, [opt], 20)
    _run_reference(ref, 20, 0.01, 0.1, adjust_lr_fn, fused_adamw)
    muon_names = {n for n, _ in split_params(ref.named_parameters())[0]}
    assert muon_names == {"blocks.0.up.weight", "blocks.0.down.weight", "blocks.0.sq.weight", "blocks.1.up.weight",
                          "blocks.1.down.weight", "blocks.1.sq.weight", "stack"}
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        rel = ((a - b).norm() / b.norm()).item()
        if name in muon_names:
            assert rel < 1e-3, name
        else:  # the AdamW part runs torch's own kernel: identical
            assert torch.equal(a, b), name


def test_float32_matches_torch_muon_algorithm(monkeypatch):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _zeropower_float32)
    ours, ref = Net(), Net()
    opt = MuonAdamW(ours.named_parameters(), lr=0.01, weight_decay=0.1, ns_dtype="float32")
    _train(ours, [opt], 20)
    _run_reference(ref, 20, 0.01, 0.1, "match_rms_adamw")
    worst = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    assert worst < 1e-6
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), Net().parameters()))
    assert moved > 1e-2  # the comparison is not vacuous


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of torch's fused AdamW kernel."""
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def test_fused_adamw_is_the_same_adamw(fused_calls):
    runs = {}
    for fused in (False, True):
        model = Net()
        opt = MuonAdamW(model.named_parameters(), lr=0.01, weight_decay=0.1, ns_dtype="float32", fused_adamw=fused)
        _train(model, [opt], 20)
        runs[fused] = dict(model.named_parameters())
        assert len(fused_calls) == (20 if fused else 0)  # one launch per step for the whole group
    worst = max(((runs[True][n] - p).norm() / p.norm()).item() for n, p in runs[False].items())
    assert worst < 1e-5  # fp32 round-off: the fused kernel orders its arithmetic differently
    moved = max((a - b).abs().max().item() for a, b in zip(runs[True].values(), Net().parameters()))
    assert moved > 1e-2


@pytest.mark.parametrize("optimizer", ["muon_adamw", "adamw"])
def test_fused_adamw_setting_survives_resume_across_settings(optimizer, fused_calls):
    cfg = OmegaConf.structured(TrainingConfig)
    cfg.optimizer, cfg.learning_rate, cfg.muon.ns_dtype = optimizer, 0.01, "float32"
    straight = Net()
    opt = build_optimizer(straight.named_parameters(), cfg, world_size=1)
    _train(straight, [opt], 5)
    saved_model, saved_opt = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    _train(straight, [opt], 5, start=5)
    resumed = Net()
    resumed.load_state_dict(saved_model)
    fused = build_optimizer(resumed.named_parameters(), cfg, world_size=1, fused_adamw=True)
    fused.load_state_dict(saved_opt)  # written without the fused kernel
    _train(resumed, [fused], 5, start=5)
    assert len(fused_calls) == 5  # the run's setting, not the checkpoint's, picks the kernel
    assert all(g.get("fused", True) for g in fused.param_groups if g["name"] == "adamw")
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(resumed.parameters(), straight.parameters()))
    assert worst < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_on_cuda_keeps_the_step_counter_on_the_device():
    runs = {}
    for fused in (False, True):
        model = Net().cuda()
        opt = MuonAdamW(model.named_parameters(), lr=0.01, ns_dtype="float32", fused_adamw=fused)
        for s in range(5):
            x, y = (t.cuda() for t in _batch(s))
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        steps = [st["step"] for st in opt.state.values() if "step" in st]
        assert all(t.device.type == ("cuda" if fused else "cpu") and t.dtype == torch.float32 for t in steps)
        runs[fused] = (model, opt)
    (model, unfused), (fused_model, fused) = runs[False], runs[True]
    fused_model.load_state_dict(model.state_dict())
    # a copy, as from a checkpoint file: torch's load_state_dict keeps an unfused step counter as the
    # very tensor it is given, so loading the live dict would share (and double-count) the counters
    fused.load_state_dict(copy.deepcopy(unfused.state_dict()))  # step counters arrive on the CPU
    x, y = (t.cuda() for t in _batch(5))
    for m, opt in ((model, unfused), (fused_model, fused)):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    assert all(st["step"].device.type == "cuda" and st["step"].item() == 6 for st in fused.state.values()
               if "step" in st)
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(fused_model.parameters(), model.parameters()))
    assert worst < 1e-5  # the same step from the same state, within fp32 round-off


def test_gram_method_matches_standard():
    torch.manual_seed(1)
    for shape in [(4, 16, 48), (2, 48, 16), (3, 20, 20)]:
        x = torch.randn(*shape)
        std = orthogonalize(x, (3.4445, -4.7750, 2.0315), 5, torch.float32, "standard")
        gram = orthogonalize(x, (3.4445, -4.7750, 2.0315), 5, torch.float32, "gram")
        assert (gram - std).abs().max().item() < 1e-4
        sv = torch.linalg.svdvals(std)
        assert sv.min() > 0.3 and sv.max() < 1.3  # approximately orthogonal


def test_routing_presets_and_patterns():
    shapes = {
        "video.patch_embedding.weight": (64, 16, 1, 2, 2), "video.condition_embedder.time_proj.weight": (384, 64),
        "video.blocks.0.attn1.to_q.weight": (64, 64), "video.blocks.0.attn1.norm_q.weight": (64,),
        "video.blocks.0.ffn.net.0.proj.weight": (256, 64), "video.blocks.0.scale_shift_table": (1, 6, 64),
        "video.proj_out.weight": (8, 64), "action_expert.blocks.0.qkv": (3, 64, 32),
        "action_expert.blocks.0.o.weight": (32, 64), "action_expert.blocks.0.modulation": (1, 6, 32),
        "action_expert.blocks.0.o.bias": (32,), "action_expert.registers": (1, 4, 32),
        "action_expert.decoder.linear.weight": (14, 32), "und_expert.layers.0.ffn.w1.weight": (64, 16),
        "action_expert.time_proj.1.weight": (192, 32),
        "und_expert.conv.weight": (16, 8, 3, 3),
    }
    named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]
    muon = [n for n, _ in split_params(named)[0]]
    assert muon == ["video.blocks.0.attn1.to_q.weight", "video.blocks.0.ffn.net.0.proj.weight",
                    "action_expert.blocks.0.qkv", "action_expert.blocks.0.o.weight",
                    "und_expert.layers.0.ffn.w1.weight", "und_expert.conv.weight"]
    assert [n for n, _ in split_params(named, "action_expert_only")[0]] == ["action_expert.blocks.0.o.weight"]
    forced = split_params(named, "action_expert_only", include=[r"proj_out"], exclude=[r"conv"])[0]
    assert [n for n, _ in forced] == ["video.proj_out.weight", "action_expert.blocks.0.o.weight"]
    assert [n for n, _ in split_params(named, exclude=[r"^und_expert"])[0]] == muon[:4]  # adds to defaults
    with pytest.raises(ValueError, match="not a matrix"):
        split_params(named, include=[r"o\.bias"])
    with pytest.raises(ValueError, match="not a valid regex"):
        split_params(named, exclude=["("])
    frozen = [("w", torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False))]
    assert split_params(frozen) == ([], [])


def test_moe_expert_matrices_get_scaled_lr():
    torch.manual_seed(0)
    experts = torch.nn.Linear(16, 16, bias=False)
    base = copy.deepcopy(experts)
    moe = MuonAdamW([("moe.experts.0.weight", experts.weight)], lr=0.01, ns_dtype="float32",
                    moe_num_experts=8, moe_top_k=2)
    scaled = MuonAdamW([("dense.weight", base.weight)], lr=0.01, ns_dtype="float32", muon_lr_scale=2.0)
    assert [g["name"] for g in moe.param_groups] == ["muon_experts"] and moe.param_groups[0]["lr_scale"] == 2.0
    for opt, lin in ((moe, experts), (scaled, base)):
        lin(torch.ones(2, 16)).square().sum().backward()
        opt.step()
    assert torch.equal(experts.weight, base.weight)


def test_ownership_plan_covers_every_matrix_once_and_balances():
    shapes = []
    for _ in range(30):  # Motus-like: video, action and understanding experts in one Muon group
        shapes += [(3072, 3072)] * 4 + [(14336, 3072), (3072, 14336)] + [(3072, 1024)] * 3 + [(1024, 3072)]
        shapes += [(4096, 1024), (1024, 4096)] + [(3072, 512)] * 3 + [(512, 3072), (2048, 512), (512, 2048)]
    numels = [a * b for a, b in shapes]
    costs = [ns_flops(a, b) for a, b in shapes]
    for world in (2, 3, 4, 8, 16):
        order = balanced_order(numels, costs, world)
        assert sorted(order) == list(range(len(shapes)))
        pieces = predicted_pieces([numels[k] for k in order], world)
        owners, loads = assign_owners(pieces, [costs[k] for k in order], world)
        size = partition_size(sum(numels), world)
        for k, own in zip(order, pieces):
            assert sum(pc.numel for pc in own) == numels[k]
            assert all(0 <= pc.offset and pc.offset + pc.numel <= size for pc in own)
        for own, owner in zip(pieces, owners):
            assert owner in [pc.rank for pc in own]  # the owner holds a piece of the matrix
        assert sum(loads) == sum(costs)  # every matrix counted exactly once
        assert max(loads) / (sum(costs) / world) < 1.03, world
        assert sum(pc.numel for own in pieces for pc in own) <= size * world


def test_straddler_goes_to_least_loaded_holder():
    # rank 0 holds a big local matrix; the straddler between 0 and 1 must go to rank 1
    pieces = [[Piece(0, 0, 90, 0)], [Piece(0, 0, 10, 90), Piece(1, 10, 10, 0)], [Piece(1, 0, 80, 10)]]
    owners, loads = assign_owners(pieces, [900, 200, 100], 2)
    assert owners == [0, 1, 1] and loads == [900, 300]


def test_state_dict_round_trip_resumes_exactly():
    model = Net()
    opt = MuonAdamW(model.named_parameters(), lr=0.01, ns_dtype="float32")
    _train(model, [opt], 5)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert {k for s in saved_opt["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg",
                                                                    "exp_avg_sq"}
    _train(model, [opt], 5, start=5)
    resumed = Net()
    resumed.load_state_dict(saved_model)
    opt2 = MuonAdamW(resumed.named_parameters(), lr=0.01, ns_dtype="float32")
    opt2.load_state_dict(saved_opt)
    _train(resumed, [opt2], 5, start=5)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_build_optimizer_from_config(caplog):
    cfg = OmegaConf.structured(TrainingConfig)
    with caplog.at_level(logging.INFO, logger="optim.build"):
        opt = build_optimizer(Net().named_parameters(), cfg, world_size=2)
    assert isinstance(opt, MuonAdamW)
    assert [(g["name"], g["initial_lr"]) for g in opt.param_groups] == [("muon", 1e-4), ("adamw", 1e-4)]
    assert "muon: 7 tensors, 7,104 parameters" in caplog.text and "adamw: 12 tensors" in caplog.text
    assert not any(hasattr(p, "use_muon") for g in opt.param_groups for p in g["params"])
    assert not any("use_muon" in g for g in opt.param_groups)
    cfg.optimizer = "adamw"
    adam = build_optimizer(Net().named_parameters(), cfg, world_size=1)
    assert type(adam) is torch.optim.AdamW and adam.param_groups[0]["name"] == "adamw"
    assert adam.param_groups[0]["initial_lr"] == 1e-4 and len(adam.param_groups[0]["params"]) == 19
    cfg.optimizer = "sgd"
    with pytest.raises(ValueError, match="training.optimizer is 'sgd'"):
        build_optimizer(Net().named_parameters(), cfg, world_size=1)


def _muon_loads(optimizer, world):
    """Predicted Newton-Schulz flops per rank of the optimizer's Muon order at `world` ranks."""
    members = optimizer.members("muon")
    pieces = predicted_pieces([p.numel() for _, p in members], world)
    return assign_owners(pieces, [ns_flops(*p.shape[-2:]) * (p.shape[0] if p.ndim == 3 else 1)
                                  for _, p in members], world)[1]


def test_order_inside_group_follows_world_size():
    model = Net()
    one = [n for n, _ in MuonAdamW(model.named_parameters(), world_size=1).members("muon")]
    assert one == [n for n, _ in split_params(model.named_parameters())[0]]
    two = [n for n, _ in MuonAdamW(model.named_parameters(), world_size=2).members("muon")]
    assert sorted(two) == sorted(one)


class Skewed(torch.nn.Module):
    """Four expensive square matrices first, then four cheap thin ones of the same size: in model
    order rank 0 of 2 holds all the expensive ones."""

    def __init__(self):
        super().__init__()
        self.square = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(32, 32)) for _ in range(4))
        self.thin = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(2, 512)) for _ in range(4))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_order_beats_model_order(world):
    model = Skewed()
    model_order = _muon_loads(MuonAdamW(model.named_parameters(), world_size=1), world)
    balanced = _muon_loads(MuonAdamW(model.named_parameters(), world_size=world), world)
    assert sum(balanced) == sum(model_order)
    assert max(balanced) < max(model_order)
    if world == 3:  # four equal squares on three ranks: two on one rank is the floor
        assert max(balanced) == 2 * ns_flops(32, 32)
    else:  # the squares split evenly; only the cheap thin matrices are left to even out
        assert max(balanced) <= sum(balanced) / world + ns_flops(2, 512)


def test_each_world_size_gets_its_own_balanced_order():
    shapes = [(96, 96)] * 3 + [(96, 24)] * 6 + [(24, 96)] * 6 + [(8, 288)] * 6
    named = [(f"blocks.{k}.w", torch.nn.Parameter(torch.zeros(s))) for k, s in enumerate(shapes)]
    worlds = (1, 2, 3, 4, 6)
    optimizers = {w: MuonAdamW(named, world_size=w) for w in worlds}
    floor = ns_flops(96, 96)  # one tensor has one owner: no rank can do less than the largest
    for world in worlds[1:]:
        peak = {w: max(_muon_loads(opt, world)) for w, opt in optimizers.items()}  # every order, at this W
        own = _muon_loads(optimizers[world], world)
        assert max(own) <= 1.25 * max(floor, sum(own) / world), (world, own)
        assert peak[world] == min(peak.values()), (world, peak)  # its own order is the best of them all
        assert peak[world] < max(peak.values()), (world, peak)  # and strictly better than some other W's


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="ns_dtype is 'float16'"):
        MuonAdamW(Net().named_parameters(), ns_dtype="float16")
    with pytest.raises(ValueError, match="ns_method is 'fast'"):
        MuonAdamW(Net().named_parameters(), ns_method="fast")
    with pytest.raises(ValueError, match="moe_top_k"):
        MuonAdamW(Net().named_parameters(), moe_num_experts=4, moe_top_k=8)
    assert math.isclose(MuonAdamW(Net().named_parameters(), moe_num_experts=4).param_groups[0]["lr_scale"], 1.0)
