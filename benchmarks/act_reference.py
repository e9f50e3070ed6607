"""LeRobot's own ACT, trained and rolled out on this machine beside our recipe: the same demonstrations,
the same CPU budget, the same evaluation seeds and the same success criterion.

    python benchmarks/act_reference.py setup        # once: .venv-act with lerobot 0.4.4 (~2.3 GB, ~3 min)
    python benchmarks/act_reference.py run --cpu-minutes 90 --marks 15,30,45,60,90 --episodes 50 \
        [--demos assets/aloha_demos50] [--out benchmarks/results/act_reference] [--workers 2] [--steps T]

`run` (in this repository's environment) trains, then evaluates every checkpoint, then prints a table
(CPU-minutes, training steps, success, 95% Wilson interval) and writes OUT.json (by default
benchmarks/results/act_reference.json). An existing OUT/rollout_cpu_M report is read, not run again; an
OUT whose train/train.json holds other marks or demonstrations is refused. DEMOS needs the camera
statistics our writer stores in meta/stats.json (LeRobot's trainer stops without them): a folder written
before it stored them is refused, naming the data.sim_demos command that writes it again.

Training (`train`, run by `run` inside .venv-act) is LeRobot's: its `TrainPipelineConfig` from the flags
`lerobot-train` takes (--policy.type=act, --policy.pretrained_backbone_weights=null: the ResNet-18
backbone starts from random weights, ImageNet's cannot be downloaded here; --dataset.root=DEMOS), its
`make_dataset`, `make_policy`, `make_pre_post_processors` (the dataset's meta/stats.json, with LeRobot's
default `use_imagenet_stats`) and `make_optimizer_and_scheduler` (ACT's preset: AdamW, lr 1e-5); every
step is `lerobot.scripts.lerobot_train.update_policy`, and a checkpoint is the pretrained_model/ folder
LeRobot's `save_checkpoint` writes (without its optimizer state). What this file adds is the clock:
LeRobot counts steps, this loop counts the process's CPU time (user + system, every thread; the data
are read in the same process, `num_workers=0`, so decoding is counted; saving is not) from the first
step, and saves a checkpoint at each --marks CPU-minute, stopping at --cpu-minutes. Run it alone on the
machine, as the recipe's timings were: threads waiting for a core a busy machine does not give them
still spend CPU time (a step at 192x256 cost ~10 CPU-s with the load at 14 on 2 cores), or with
OMP_NUM_THREADS=1 beside other jobs: one thread has no others to wait for (2.7 CPU-s a step, the
TRAINING.md figures). ACT's chunk is 100
actions (`chunk_size` = `n_action_steps` = 100, executed open loop as LeRobot's evaluation does), the
batch 8. ACT reads the frames at the size the demonstrations hold them: LeRobot builds its input
features from meta/info.json, so assets/aloha_demos50's 192x256 is what the ResNet sees, with no
resize; the server asks the rollout for that size, as our recipe's does.

Evaluation: for each checkpoint `serve` (inside .venv-act) loads it with LeRobot's `ACTPolicy.from_pretrained`
and its saved pre/post-processors and serves it with inference.serve's own `BatchingServer` (the
openpi-client websocket protocol our recipe speaks); `python -m inference.rollout --policy ws://...`
then runs the episodes on evaluation seeds 1000000, 1000001, ... (data.sim_env.EVAL_SEEDS), with the
task's own success rule, exactly as for a checkpoint of ours. Each query returns one 100-action chunk.

The other subcommands run inside .venv-act:
    .venv-act/bin/python benchmarks/act_reference.py train --demos DIR --out DIR --cpu-minutes M --marks A,B
    .venv-act/bin/python benchmarks/act_reference.py serve --checkpoint DIR/pretrained_model --port P
    .venv-act/bin/python benchmarks/act_reference.py check DIR    # LeRobot reads our folder (tests use it)

Smoke test (~10 minutes on a busy machine): run --cpu-minutes 2 --marks 1 --episodes 2 --steps 20.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VENV = os.path.join(ROOT, ".venv-act")
VENV_PYTHON = os.path.join(VENV, "bin", "python")
LEROBOT = "lerobot==0.4.4"
# torch stays this project's CPU build; torchvision and torchcodec are the releases built for it
# (lerobot 0.4.4 declares torch<2.11, whose PyPI builds bring CUDA, gigabytes of it)
TORCH_FAMILY = ("torch==2.13.0", "torchvision==0.28.0", "torchcodec==0.13.0")
TORCH_FAMILY_NAMES = ("torch", "torchvision", "torchcodec")
SERVER_REQUIREMENTS = ("omegaconf>=2.3,<2.5", "msgpack>=1.0.5,<2", "websockets>=13,<18")  # as requirements.txt
# torchvision's PyPI wheel is built against CUDA torch: on the CPU build its C++ operators (nms, roi_align...;
# ACT uses none) do not load, and torchvision's import then fails registering fake kernels for two of them.
# Declaring their schemas first lets it import; calling one still fails, as it would without the shim.
TORCHVISION_SHIM = '''"""Written by benchmarks/act_reference.py setup: declares the two torchvision operators that
torchvision 0.28 registers fake kernels for even when its C++ extension (built for CUDA torch) did not load."""
import torch

_library = torch.library.Library("torchvision", "DEF")
_library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
'''
DEFAULT_DEMOS = "assets/aloha_demos50"
DEFAULT_OUT = "benchmarks/results/act_reference"
CHUNK = 100
BATCH_SIZE = 8


# ---- setup (any Python) ------------------------------------------------------------------------------
def pip(*args: str) -> None:
    subprocess.run([VENV_PYTHON, "-m", "pip", "install", "-q", *args], check=True)


def setup(_: argparse.Namespace) -> None:
    import ctypes.util
    import shutil

    if ctypes.util.find_library("avcodec") is None:  # torchcodec, LeRobot's video decoder, uses the system's FFmpeg
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            sys.exit("setup: FFmpeg's shared libraries (libavcodec...) are missing; install them (Debian/Ubuntu: "
                     "apt-get install ffmpeg), then run setup again")
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "ffmpeg"], check=True)
    if not os.path.isfile(VENV_PYTHON):
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", VENV], check=True)
    pip(*TORCH_FAMILY)
    pip("--no-deps", LEROBOT)
    # lerobot's own requirements, less the torch family kept above
    declared = subprocess.run([VENV_PYTHON, "-c", "from importlib.metadata import requires; "
                               "print('\\n'.join(r for r in requires('lerobot') if 'extra ==' not in r))"],
                              check=True, capture_output=True, text=True).stdout.split("\n")
    wanted = [r for r in declared if r and re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] not in TORCH_FAMILY_NAMES]
    pip(*wanted, *TORCH_FAMILY, *SERVER_REQUIREMENTS)
    pip("--no-deps", "openpi-client>=0.1.2,<0.2")  # as scripts/setup.sh: it declares numpy<2
    site = subprocess.run([VENV_PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "act_torchvision_ops.py"), "w") as f:
        f.write(TORCHVISION_SHIM)
    with open(os.path.join(site, "act_torchvision_ops.pth"), "w") as f:
        f.write("import act_torchvision_ops\n")
    versions = subprocess.run([VENV_PYTHON, "-c", "import lerobot, torch, torchvision, torchcodec; "
                               "from lerobot.policies.act.modeling_act import ACTPolicy; "
                               "print('lerobot', lerobot.__version__, 'torch', torch.__version__, 'torchvision', "
                               "torchvision.__version__, 'torchcodec', torchcodec.__version__)"],
                              check=True, capture_output=True, text=True).stdout.strip()
    print(f"setup: {VENV} ready ({versions})")


# ---- train (inside .venv-act) -------------------------------------------------------------------------
def lerobot_flags(demos: str, out: str, seed: int) -> list[str]:
    """The lerobot-train command line of the reference run (no step count: the CPU clock stops it)."""
    return ["--policy.type=act", "--policy.pretrained_backbone_weights=null", "--policy.device=cpu",
            "--policy.push_to_hub=false", f"--policy.chunk_size={CHUNK}", f"--policy.n_action_steps={CHUNK}",
            f"--dataset.root={os.path.abspath(demos)}", f"--dataset.repo_id=local/{os.path.basename(demos)}",
            f"--batch_size={BATCH_SIZE}", "--num_workers=0", f"--seed={seed}", "--wandb.enable=false",
            f"--output_dir={os.path.join(out, 'lerobot')}"]


def train(args: argparse.Namespace) -> None:
    import draccus
    import torch
    from accelerate import Accelerator
    from lerobot.configs.train import TrainPipelineConfig
    from lerobot.datasets.factory import make_dataset
    from lerobot.datasets.utils import cycle
    from lerobot.optim.factory import make_optimizer_and_scheduler
    from lerobot.policies.factory import make_policy, make_pre_post_processors
    from lerobot.scripts.lerobot_train import update_policy
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker
    from lerobot.utils.random_utils import set_seed

    marks = parse_marks(args.marks, args.cpu_minutes)
    os.makedirs(args.out, exist_ok=True)
    setup_cpu = time.process_time()
    flags = lerobot_flags(args.demos, args.out, args.seed)
    cfg = draccus.parse(TrainPipelineConfig, args=flags)
    cfg.validate()
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    set_seed(cfg.seed, accelerator=accelerator)
    dataset = make_dataset(cfg)
    policy = make_policy(cfg=cfg.policy, ds_meta=dataset.meta, rename_map=cfg.rename_map)
    preprocessor, postprocessor = make_pre_post_processors(policy_cfg=cfg.policy, dataset_stats=dataset.meta.stats)
    optimizer, scheduler = make_optimizer_and_scheduler(cfg, policy)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, num_workers=0)
    policy, optimizer, loader, scheduler = accelerator.prepare(policy, optimizer, loader, scheduler)
    batches = cycle(loader)
    meters = {name: AverageMeter(name, ":.3f") for name in ("loss", "grad_norm", "lr", "update_s", "dataloading_s")}
    tracker = MetricsTracker(cfg.batch_size, dataset.num_frames, dataset.num_episodes, meters, accelerator=accelerator)
    camera = dataset.meta.camera_keys[0]
    print(f"train: {dataset.num_episodes} episodes, {dataset.num_frames} frames of {args.demos}, camera {camera} "
          f"{tuple(dataset.meta.shapes[camera])}; marks {marks} CPU-minutes", flush=True)
    saved: list[dict[str, Any]] = []
    losses: list[float] = []
    step, saving_cpu = 0, 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    setup_cpu = cpu0 - setup_cpu
    policy.train()
    while len(saved) < len(marks):
        tracker, _ = update_policy(tracker, policy, preprocessor(next(batches)), optimizer,
                                   cfg.optimizer.grad_clip_norm, accelerator=accelerator, lr_scheduler=scheduler)
        step += 1
        losses.append(tracker.loss.val)
        cpu = time.process_time() - cpu0 - saving_cpu  # the budget is training's: saving is not counted
        if step % 50 == 0:
            print(f"step {step}: loss {sum(losses[-50:]) / 50:.4f}, {cpu / 60:.1f} CPU-min, "
                  f"{(time.perf_counter() - wall0) / 60:.1f} min", flush=True)
        if cpu >= marks[len(saved)] * 60:
            start = time.process_time()
            folder = os.path.join(args.out, "checkpoints", f"cpu_{marks[len(saved)]:g}min", "pretrained_model")
            # what lerobot's save_checkpoint writes into pretrained_model/; no optimizer state (never resumed)
            accelerator.unwrap_model(policy).save_pretrained(Path(folder))
            cfg.save_pretrained(Path(folder))
            preprocessor.save_pretrained(folder)
            postprocessor.save_pretrained(folder)
            saved.append({"cpu_minutes": marks[len(saved)], "cpu_s": cpu, "wall_s": time.perf_counter() - wall0,
                          "steps": step, "loss_last_50": sum(losses[-50:]) / len(losses[-50:]), "checkpoint": folder})
            print(f"saved {folder} at step {step} ({cpu / 60:.2f} CPU-min)", flush=True)
            saving_cpu += time.process_time() - start
    record = {"demos": os.path.abspath(args.demos), "cpu_minutes": args.cpu_minutes, "marks": marks,
              "lerobot_train_flags": flags, "setup_cpu_s": setup_cpu, "checkpoints": saved,
              "image_shape": list(dataset.meta.shapes[camera]), "camera": camera,
              "use_imagenet_stats": cfg.dataset.use_imagenet_stats, "learning_rate": cfg.optimizer.lr,
              "torch_threads": torch.get_num_threads()}
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(record, f, indent=1)


def parse_marks(marks: str, cpu_minutes: float) -> list[float]:
    """--marks 'A,B' -> [A, B, cpu_minutes] sorted (the budget is always a mark); SystemExit on a bad value."""
    try:
        values = sorted({float(m) for m in marks.split(",") if m.strip()} | {float(cpu_minutes)})
    except ValueError:
        sys.exit(f"--marks '{marks}': expected comma-separated CPU-minutes, e.g. 15,30,60")
    if values[0] <= 0 or values[-1] > cpu_minutes:
        sys.exit(f"--marks {marks} and --cpu-minutes {cpu_minutes}: every mark must lie in (0, --cpu-minutes]")
    return values


# ---- serve (inside .venv-act) -------------------------------------------------------------------------
class ActPolicy:
    """A LeRobot ACT checkpoint (pretrained_model/) as inference.serve.BatchingServer serves a policy: it asks
    for each camera (uint8 [H, W, 3] at the size ACT was trained at) and the state, and answers the first
    n_action_steps actions of ACT's chunk, unnormalised by the checkpoint's own post-processor."""

    def __init__(self, checkpoint: str) -> None:
        from types import SimpleNamespace

        from lerobot.policies.act.modeling_act import ACTPolicy
        from lerobot.policies.factory import make_pre_post_processors

        self.policy = ACTPolicy.from_pretrained(checkpoint)
        self.policy.eval()
        config = self.policy.config
        self.preprocessor, self.postprocessor = make_pre_post_processors(config, pretrained_path=checkpoint)
        self.image_keys = list(config.image_features)
        self.state_key = "observation.state"
        if config.robot_state_feature is None:
            raise SystemExit(f"serve: the ACT checkpoint {checkpoint} has no {self.state_key} input")
        self.keys = {k: {"shape": [*config.image_features[k].shape[1:], 3], "dtype": "uint8"} for k in self.image_keys}
        self.keys[self.state_key] = {"shape": list(config.robot_state_feature.shape), "dtype": "float32"}
        self.chunk, self.action_dim = config.n_action_steps, config.action_feature.shape[0]
        self.loaded = SimpleNamespace(checkpoint=checkpoint)  # what BatchingServer logs

    def metadata(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"observation_keys": self.keys, "action_shape": [self.chunk, self.action_dim],
                "action_chunk_size": self.chunk, "action_dim": self.action_dim,
                "action_units": "robot (unnormalised by the checkpoint's post-processor)",
                "image_keys": self.image_keys, "state_key": self.state_key, "prompt_key": None,
                "policy": f"lerobot {version('lerobot')} ACT", "checkpoint": self.loaded.checkpoint,
                "config_hash": None, "weights": None}

    def check(self, obs: Any) -> dict[str, Any]:
        import numpy as np

        if not isinstance(obs, dict):
            raise ValueError(f"expected an observation dict, got {type(obs).__name__}")
        missing = [k for k in self.keys if k not in obs]
        if missing:
            raise ValueError(f"observation lacks {missing}; expected keys {sorted(self.keys)}")
        for key, spec in self.keys.items():
            value = obs[key]
            dtype_ok = isinstance(value, np.ndarray) and (
                value.dtype == np.uint8 if spec["dtype"] == "uint8" else value.dtype.kind == "f")
            if not dtype_ok or list(value.shape) != spec["shape"]:
                got = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
                raise ValueError(f"'{key}' must be {spec['dtype']} of shape {spec['shape']}, got {got}")
        return {key: obs[key] for key in self.keys}

    def infer_checked(self, checked: list[dict[str, Any]]) -> Any:
        import numpy as np
        import torch

        batch = {key: torch.from_numpy(np.stack([o[key] for o in checked])).permute(0, 3, 1, 2).float() / 255
                 for key in self.image_keys}  # LeRobotDataset's frames: float [B, 3, H, W] in [0, 1]
        batch[self.state_key] = torch.from_numpy(np.stack([o[self.state_key] for o in checked]).astype(np.float32))
        with torch.no_grad():
            actions = self.policy.predict_action_chunk(self.preprocessor(batch))[:, :self.chunk]
        return self.postprocessor(actions).numpy().astype(np.float32)


def serve(args: argparse.Namespace) -> None:
    import asyncio
    import logging

    from inference.serve import BatchingServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = BatchingServer(ActPolicy(args.checkpoint), max_batch_size=8, batch_window_ms=5.0)
    asyncio.run(server.serve("127.0.0.1", args.port))


# ---- check (inside .venv-act) -------------------------------------------------------------------------
def check(args: argparse.Namespace) -> None:
    """LeRobot reads a folder our writer wrote: prints a JSON report (stats keys and shapes as LeRobot
    loads them, LeRobot's own aggregation of the episodes' stats against meta/stats.json, its
    normalisation of a frame against our statistics) and saves the frames of --index to --frames-out."""
    import numpy as np
    import pyarrow.parquet as pq
    from lerobot.datasets.compute_stats import DEFAULT_QUANTILES, aggregate_stats
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.datasets.utils import cast_stats_to_numpy, dataset_to_policy_features, unflatten_dict
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.factory import make_pre_post_processors

    dataset = LeRobotDataset("local/check", root=args.root)
    cameras = dataset.meta.camera_keys
    episodes = pq.read_table(os.path.join(args.root, "meta", "episodes", "chunk-000", "file-000.parquet")).to_pylist()
    per_episode = [unflatten_dict({k: v for k, v in row.items() if k.startswith("stats/")})["stats"]
                   for row in episodes]
    # LeRobot's own validation (names, shapes) and pooling of the episodes' statistics
    pooled = aggregate_stats([cast_stats_to_numpy(stats) for stats in per_episode])
    features = dataset_to_policy_features(dataset.meta.features)
    config = ACTConfig(device="cpu", pretrained_backbone_weights=None,
                       input_features={k: f for k, f in features.items() if k != "action"},
                       output_features={"action": features["action"]})
    preprocessor, _ = make_pre_post_processors(config, dataset_stats=dataset.meta.stats)
    item = dataset[args.index]
    normalized = preprocessor({k: v for k, v in item.items() if k in config.input_features})
    report: dict[str, Any] = {"video_backend": dataset.video_backend, "cameras": cameras,
                              "lerobot_stat_names": ["min", "max", "mean", "std", "count"]
                              + [f"q{int(q * 100):02d}" for q in DEFAULT_QUANTILES]}
    for key in cameras:
        stats = dataset.meta.stats[key]
        expected = (item[key] - stats["mean"]) / stats["std"]
        report[key] = {"stat_names": sorted(stats), "shapes": {n: list(np.shape(v)) for n, v in stats.items()},
                       "pooled_minus_stats_json": {n: float(np.max(np.abs(pooled[key][n] - stats[n])))
                                                   for n in ("min", "max", "mean", "std", "count")},
                       "normalized_minus_expected": float((normalized[key][0] - expected).abs().max()),
                       "frame_shape": list(item[key].shape)}
    np.savez(args.frames_out, **{key: item[key].numpy() for key in cameras})
    print(json.dumps(report))


# ---- run (this repository's environment) --------------------------------------------------------------
def act_server(checkpoint: str, log_path: str) -> Any:
    """inference.rollout's ServerProcess, starting this file's `serve` in .venv-act instead of inference.serve."""
    from inference.rollout_server import ServerProcess

    server = ServerProcess(checkpoint, log_path)
    server.cmd = [VENV_PYTHON, os.path.abspath(__file__), "serve", "--checkpoint", checkpoint,
                  "--port", str(server.port)]
    return server


def trained(args: argparse.Namespace, train_dir: str) -> dict[str, Any]:
    """train/train.json of --out, training first when there is none."""
    record_path = os.path.join(train_dir, "train.json")
    marks = parse_marks(args.marks, args.cpu_minutes)
    if not os.path.isfile(record_path):
        if os.path.isdir(train_dir) and os.listdir(train_dir):
            sys.exit(f"act_reference: {train_dir} holds an unfinished training; remove it to train again")
        os.makedirs(train_dir, exist_ok=True)
        cmd = [VENV_PYTHON, os.path.abspath(__file__), "train", "--demos", args.demos, "--out", train_dir,
               "--cpu-minutes", f"{args.cpu_minutes:g}", "--marks", ",".join(f"{m:g}" for m in marks),
               "--seed", str(args.seed)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(record_path) as f:
        record = json.load(f)
    if record["marks"] != marks or record["demos"] != os.path.abspath(args.demos):
        sys.exit(f"act_reference: {record_path} was trained on {record['demos']} with marks {record['marks']}, not "
                 f"{os.path.abspath(args.demos)} with {marks}; choose another --out")
    return record


def run(args: argparse.Namespace) -> None:
    from inference.rollout import main as rollout

    if not os.path.isfile(VENV_PYTHON):
        sys.exit(f"act_reference: {VENV} does not exist; create it with: python benchmarks/act_reference.py setup")
    remake = f"python -m data.sim_demos --task {args.task} --episodes 50 --out {args.demos}"
    if not os.path.isfile(os.path.join(args.demos, "meta", "info.json")):
        sys.exit(f"act_reference: --demos {args.demos} is not a LeRobot dataset (no meta/info.json); make it with: "
                 f"{remake}")
    with open(os.path.join(args.demos, "meta", "info.json")) as f:
        cameras = [k for k, v in json.load(f)["features"].items() if v["dtype"] in ("video", "image")]
    with open(os.path.join(args.demos, "meta", "stats.json")) as f:
        missing = [k for k in cameras if k not in json.load(f)]
    if missing:  # folders our writer wrote before it stored them: LeRobot's trainer stops on a KeyError
        sys.exit(f"act_reference: {args.demos}/meta/stats.json has no statistics of the cameras {missing}, which "
                 f"LeRobot's training needs; write the demonstrations again (same seeds, same episodes): {remake}")
    record = trained(args, os.path.join(args.out, "train"))
    rows = []
    for saved in record["checkpoints"]:
        name = f"cpu_{saved['cpu_minutes']:g}min"
        out = os.path.join(args.out, f"rollout_{name}")
        if not os.path.isfile(os.path.join(out, "report.json")):
            server = act_server(saved["checkpoint"], os.path.join(args.out, f"server_{name}.log"))
            try:
                argv = ["--task", args.task, "--policy", server.start(), "--episodes", str(args.episodes),
                        "--out", out, "--baselines", "", "--videos", "1", "--workers", str(args.workers)]
                rollout(argv + ([] if args.steps is None else ["--steps", str(args.steps)]))
            finally:
                server.stop()
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        policy = report["results"]["policy"]
        rows.append({"cpu_minutes": saved["cpu_minutes"], "cpu_s": saved["cpu_s"], "steps": saved["steps"],
                     "train_wall_s": saved["wall_s"], "loss_last_50": saved["loss_last_50"],
                     "episodes": policy["episodes"], "successes": policy["successes"],
                     "success_rate": policy["success_rate"], "wilson_95": policy["wilson_95"],
                     "seeds": [report["seeds"][0], report["seeds"][-1]], "episode_steps": report["steps"],
                     "report": os.path.join(out, "report.json")})
    print(f"LeRobot ACT on {args.task}: {record['demos']}, camera {record['camera']} {record['image_shape']}, "
          f"chunk {CHUNK}, batch {BATCH_SIZE}, backbone from scratch; {args.episodes} episodes per checkpoint "
          f"(seeds {rows[0]['seeds'][0]}-{rows[0]['seeds'][1]}, {report['success_rule']})")
    print(f"{'CPU-min':>8} {'steps':>7} {'success':>9} {'95% Wilson':>14}")
    for r in rows:
        lo, hi = r["wilson_95"]
        print(f"{r['cpu_minutes']:>8g} {r['steps']:>7} {r['successes']:>4}/{r['episodes']:<4} "
              f"{100 * lo:5.1f}-{100 * hi:5.1f}%")
    path = args.out.rstrip("/") + ".json"
    with open(path, "w") as f:
        json.dump({"task": args.task, "success_rule": report["success_rule"], "train": record, "rows": rows},
                  f, indent=1)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help=f"create {VENV} with {LEROBOT}")
    p = commands.add_parser("run", help="train LeRobot's ACT, roll out every checkpoint, print the table")
    p.add_argument("--demos", default=DEFAULT_DEMOS)
    p.add_argument("--task", default="transfer_cube", help="the data.sim_env task the demonstrations are of")
    p.add_argument("--out", default=DEFAULT_OUT, help="training and rollouts; the table goes to OUT.json")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    p.add_argument("--steps", type=int, default=None, help="episode cap (default: the task's registered cap)")
    for sub in (p, commands.add_parser("train", help="(inside .venv-act) LeRobot's training for a CPU budget")):
        sub.add_argument("--cpu-minutes", type=float, required=True, help="training's CPU budget")
        sub.add_argument("--marks", default="", help="comma-separated CPU-minutes to save a checkpoint at "
                                                     "(and always at --cpu-minutes)")
        sub.add_argument("--seed", type=int, default=1000, help="lerobot-train's default seed")
    train_parser = commands.choices["train"]
    train_parser.add_argument("--demos", required=True)
    train_parser.add_argument("--out", required=True)
    p = commands.add_parser("serve", help="(inside .venv-act) serve an ACT checkpoint over our protocol")
    p.add_argument("--checkpoint", required=True, help="a pretrained_model folder")
    p.add_argument("--port", type=int, required=True)
    p = commands.add_parser("check", help="(inside .venv-act) LeRobot reads a folder our writer wrote")
    p.add_argument("root")
    p.add_argument("--index", type=int, default=0, help="the frame whose pictures are saved")
    p.add_argument("--frames-out", required=True, help="an .npz file for the pictures LeRobot decoded")
    args = parser.parse_args()
    {"setup": setup, "run": run, "train": train, "serve": serve, "check": check}[args.command](args)


if __name__ == "__main__":
    main()
