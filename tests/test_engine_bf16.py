"""Under --deepspeed with bf16, the parameters a bf16_mixed model keeps in fp32 (models/world_model.py
FP32_PATTERNS) get fp32 masters equal to the loaded fp32 values, not to their bf16 rounding; the module
computes with bf16 copies of them (DeepSpeed casts every parameter), which TRAINING.md "Precision" states.
The real engine, two gloo processes on the CPU."""
import json
import textwrap

from tests.helpers import ROOT, torchrun

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, {root!r})
    from omegaconf import OmegaConf
    from train.launch_checks import load_deepspeed_config
    from train.launch import make_accelerator, make_engine
    from recipe.schema import Config
    from optim.deepspeed_adapter import fp32_partitions
    cfg = OmegaConf.structured(Config)
    cfg.model.precision = "bf16_mixed"
    cfg.training.batch_size = 2
    cfg.training.ema.enabled = True
    ds = load_deepspeed_config(sys.argv[1], cfg, int(os.environ["WORLD_SIZE"]))
    acc = make_accelerator(ds, 5)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.time_embedder = torch.nn.Linear(8, 8)   # an FP32_PATTERNS name
            self.modulation = torch.nn.Parameter(torch.zeros(1, 6, 8))
        def forward(self, inputs):
            return {{"loss": self.time_embedder(self.lin(inputs["x"])).float().pow(2).mean() + self.modulation.sum()}}

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # values bf16 cannot hold: 1 + k * 2**-12
        for p in (net.time_embedder.weight, net.time_embedder.bias, net.modulation):
            p.copy_(1 + torch.arange(p.numel()).view(p.shape) % 7 * 2.0 ** -12)
    net.lin.to(torch.bfloat16)   # what WorldModel.apply_precision does to the other parameters
    loaded = {{n: p.detach().clone() for n, p in net.named_parameters()}}
    eng = make_engine(acc, net, torch.optim.AdamW(net.parameters(), lr=0.0), cfg)
    # the whole fp32 masters, gathered by name from every rank's partition
    zero, names = eng.ds.optimizer, {{id(p): n for n, p in eng.ds.module.named_parameters()}}
    masters = {{}}
    for i, params in enumerate(zero.round_robin_bit16_groups):
        parts = [torch.zeros_like(fp32_partitions(eng.ds)[i]) for _ in range(int(os.environ["WORLD_SIZE"]))]
        torch.distributed.all_gather(parts, fp32_partitions(eng.ds)[i])
        flat = torch.cat(parts)
        for p, offset in zip(params, zero.round_robin_bit16_offsets[i]):
            masters[names[id(p)]] = flat[offset:offset + p.numel()].view(p.shape)
    ema = torch.cat([t for t in eng.ema.shadow])
    out = {{"dtypes": {{n: str(p.dtype) for n, p in eng.ds.module.named_parameters()}},
            "masters_equal_loaded": {{n: bool(torch.equal(masters[n], loaded[n].float())) for n in loaded}},
            "module_is_bf16_of_master": {{n: bool(torch.equal(p.data, masters[n].to(torch.bfloat16)))
                                          for n, p in eng.ds.module.named_parameters()}},
            "ema_is_masters": bool(torch.equal(ema, torch.cat(list(fp32_partitions(eng.ds)))))}}
    if torch.distributed.get_rank() == 0:
        print("RESULT", json.dumps(out), flush=True)
    from utils import dist
    dist.barrier()
    dist.shutdown()  # the group goes before the interpreter's teardown, which can otherwise hang
""")


def test_bf16_engine_keeps_the_loaded_fp32_values_as_masters(tmp_path):
    """ZeRO-2 (ZeRO-1's master partitions are the same structure, single_partition_of_fp32_groups)."""
    script = tmp_path / "engine_bf16.py"
    script.write_text(SCRIPT.format(root=ROOT))
    r = torchrun(2, ["configs/zero2.json"], timeout=240, script=str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    # what computes: DeepSpeed's bf16 engine holds every parameter of the module in bf16
    assert set(out["dtypes"].values()) == {"torch.bfloat16"}, out["dtypes"]
    # what the optimizer updates: the loaded fp32 numbers, exactly (bf16 would have rounded 1 + k * 2**-12)
    assert all(out["masters_equal_loaded"].values()), out["masters_equal_loaded"]
    assert all(out["module_is_bf16_of_master"].values()) and out["ema_is_masters"]
