"""Train a Motus-style world model from a YAML config.

    torchrun --nproc_per_node 2 train/train.py --config configs/tiny.yaml \
        --deepspeed configs/zero2.json training.max_steps=50

Also runs under the `deepspeed` launcher and `accelerate launch`; see TRAINING.md.

Read top-down: `setup` builds the run's named parts (`Training`), `train_step` is one optimizer update
(its micro-batches, the update with the EMA, the non-finite guard), `train` is the loop (validation,
logging, the checkpointer's `maybe_save`, preemption, the hang watchdog) and returns the exit code,
and `finish` is the one way out.
"""
import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from checkpoint import disk  # noqa: E402
from checkpoint.checkpointer import Checkpointer  # noqa: E402
from checkpoint.files import CONFIG_YAML, ENGINE_DIR  # noqa: E402
from models.folder import NORM_STATS  # noqa: E402
from checkpoint.state import Document, PerRank, RandomState, Registry, Shared, Stateful  # noqa: E402
from train.cpu_clock import CpuClock  # noqa: E402
from recipe.config import config_stem, load_config, save_config  # noqa: E402
from train.evaluation import Evaluator  # noqa: E402
from train.launch_checks import check_launch  # noqa: E402
from train.engine import Engine  # noqa: E402
from train.launch import make_accelerator, make_engine  # noqa: E402
from train.guard import NonFiniteGuard, check_weights_before_save, health, run_guarded  # noqa: E402
from train.preemption import REQUEUE_EXIT_CODE, PreemptionFlag  # noqa: E402
from train.resume_policy import Edits, check as check_edits  # noqa: E402
from train.run_dir import choose_run_dir  # noqa: E402
from train import speed  # noqa: E402
from train.record import make_record  # noqa: E402
from train.step_inputs import noise_seeds, seed_everything, to_device  # noqa: E402
from train.trainer_state import TrainerState  # noqa: E402
from train.validation import validate_raw_and_ema  # noqa: E402
from train.watchdog import Watchdog  # noqa: E402
from utils import dist  # noqa: E402
from utils.config import ConfigError, quote  # noqa: E402
from utils.metrics import Metrics, quiet_library_bars  # noqa: E402
from utils.quiet import silence_known_warnings  # noqa: E402
from utils.schedule import LRSchedule  # noqa: E402
from utils.wandb_setup import check_wandb_login  # noqa: E402

if TYPE_CHECKING:
    import torch

    from data.normalize import NormStats
    from data.stream import ValLoader
    from models.encoders import FrozenEncoders
    from models.world_model import WorldModel

log = logging.getLogger("train")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML recipe")
    p.add_argument("--deepspeed", default=None, help="ZeRO JSON (configs/zero1.json, configs/zero2.json)")
    p.add_argument("--run_name", default=None, help="overrides logging.run_name")
    p.add_argument("--report_to", default=None, choices=["tensorboard", "wandb", "all", "none"])
    p.add_argument("--checkpoint_dir", default=None, help="overrides system.checkpoint_dir")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_intermixed_args(argv)  # overrides may stand before, between and after flags
    flags = {"logging.run_name": args.run_name, "logging.report_to": args.report_to,
             "system.checkpoint_dir": args.checkpoint_dir}
    # quoted: a flag's value arrives as typed (`--run_name off` names the run "off", not False)
    args.overrides += [f"{k}={quote(v)}" for k, v in flags.items() if v is not None]
    return args


def make_generated_inputs(cfg: DictConfig) -> None:
    """The default recipe's synthetic dataset and tiny frozen parts, made once by rank 0 on first use
    (run under fail_together, whose agreement step is also the barrier the other ranks wait at)."""
    from recipe.generated import ensure_generated_inputs

    if dist.is_main():
        ensure_generated_inputs(cfg)


def build_everything(cfg: DictConfig, world_size: int, resume_from: str | None = None
                     ) -> "tuple[tuple[Any, Any, NormStats], WorldModel, FrozenEncoders, torch.optim.Optimizer]":
    """Data, model and optimizer: every start-up error surfaces here, on every rank. The weights
    start from finetune.checkpoint_path in a fresh run; a resumed run keeps its own (loaded here
    only with resume.reset_optimizer, else by the engine with the optimizer state)."""
    from data import build_datasets
    from models import build_world_model
    from optim import build_optimizer
    from checkpoint.finetune import load_finetune_weights, load_resume_weights

    datasets = build_datasets(cfg)
    seed_everything(cfg.training.seed, rank=0)  # the same initial weights on every rank, whatever ran before
    model, encoders = build_world_model(cfg)
    if resume_from is None and cfg.finetune.checkpoint_path:
        load_finetune_weights(model, cfg.finetune.checkpoint_path, list(cfg.finetune.allow_shape_mismatch))
    elif resume_from is not None and cfg.resume.reset_optimizer:
        load_resume_weights(model, resume_from)
    speed.apply(model, encoders, cfg.system.speed)
    optimizer = build_optimizer(model.named_parameters(), cfg.training, world_size, cfg.system.speed.fused_adamw)
    return datasets, model, encoders, optimizer


def open_run_dir(run_dir: str, cfg: DictConfig, checkpointer: Checkpointer) -> None:
    """Rank 0 writes the run's config.yaml and clears the saves a kill interrupted."""
    if dist.is_main():
        os.makedirs(run_dir, exist_ok=True)
        save_config(cfg, os.path.join(run_dir, CONFIG_YAML))
    checkpointer.remove_interrupted_saves()


def checkpoint_parts(cfg: DictConfig, engine: Engine, state: TrainerState, stream: Stateful, schedule: LRSchedule,
                     stats: "NormStats | None") -> Registry:
    """Everything a checkpoint holds, each part registered once, restored in this order on resume.
    The engine (weights, optimizer, EMA) is not restored with resume.reset_optimizer (the weights were
    loaded at build), the lr schedule not with resume.reset_scheduler (it starts again)."""
    parts = Registry()
    parts.register(ENGINE_DIR, engine, restore=not cfg.resume.reset_optimizer)
    parts.register("trainer_state", Shared(state))
    parts.register("data", Shared(stream))
    parts.register("schedule", Shared(schedule), restore=not cfg.resume.reset_scheduler)
    parts.register("rng", PerRank(RandomState()))  # after every part that may draw while it loads
    parts.register(CONFIG_YAML, Document(lambda path: disk.fsync_write(path, OmegaConf.to_yaml(cfg))))
    if stats is not None:
        parts.register(NORM_STATS, Document(stats.save))
    return parts


def restore(checkpointer: Checkpointer, path: str, state: TrainerState, cfg: DictConfig, edits: Edits) -> None:
    """Resume every registered part; log what the edits change."""
    checkpointer.load(path)
    log.info("resumed from %s at step %d", path, state.step)
    log.info(edits.line())
    for note in edits.notes:
        log.info("resume: %s", note)
    if cfg.finetune.checkpoint_path:
        log.info("resume: finetune.checkpoint_path %s is not read: a resumed run keeps its own weights",
                 cfg.finetune.checkpoint_path)


def print_summary(run_dir: str, cfg: DictConfig, step: int) -> None:
    latest = open(os.path.join(run_dir, "latest")).read().strip()
    print(f"\nTraining finished at step {step}.\n  run directory: {run_dir}\n"
          f"  checkpoint:    {os.path.join(run_dir, latest)}\n"
          f"  metrics:       {os.path.join(run_dir, 'metrics.jsonl')}\n"
          f"  tensorboard:   tensorboard --logdir {os.path.join(run_dir, cfg.logging.tensorboard_log_dir)}",
          flush=True)


@dataclass
class Training:
    """The named parts of a run, as `setup` returns them."""
    cfg: DictConfig
    run_dir: str
    engine: Engine
    encoders: "FrozenEncoders"
    stream: Any
    """data.stream.TrainStream: `next()` gives this rank's next batch; a checkpoint part."""
    val_loader: "ValLoader | None"
    """None when nothing is held out."""
    stats: "NormStats"
    schedule: LRSchedule
    state: TrainerState
    guard: NonFiniteGuard
    checkpointer: Checkpointer
    metrics: Metrics
    evaluator: Evaluator
    """Closed-loop evaluation of saved checkpoints beside training (rank 0; a no-op without evaluation.task)."""
    samples_per_step: int
    """Samples of one optimizer update over every rank."""
    clock: CpuClock
    """Training's CPU seconds over every rank, into `state` at each record and save."""


@dataclass
class StepOutput:
    """What `train_step` hands to logging: device tensors, read back only when a record is written."""
    losses: dict[str, Any]
    """The loss terms averaged over the micro-batches (this rank's)."""
    grad_norm: Any
    lrs: list[float]


@dataclass
class Window:
    """Steps since the last logged record, for samples/s and step time."""
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0


def configure(args: argparse.Namespace) -> tuple[DictConfig, dict[str, Any] | None]:
    """The recipe and the DeepSpeed config; a bad one ends every rank here, before anything is built."""
    try:
        cfg = load_config(args.config, args.overrides)
        ds_config = check_launch(cfg, dist.world_size(), args.deepspeed)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        dist.die(e)
    logging.basicConfig(level=cfg.system.log_level, format="%(asctime)s %(name)s: %(message)s")
    if not dist.is_main():
        logging.getLogger().setLevel(logging.WARNING)
    quiet_library_bars(cfg.logging.progress)
    return cfg, ds_config


def setup(args: argparse.Namespace) -> Training:
    """Every part of the run, built and (on resume) restored; every start-up error ends every rank here."""
    from data import build_train_stream, build_val_loader

    cfg, ds_config = configure(args)
    accelerator = make_accelerator(ds_config, cfg.system.dist_timeout_minutes, cfg.system.speed)
    world_size = dist.world_size()
    try:
        dist.fail_together(check_wandb_login, cfg.logging)  # before anything is built
        run_dir, resume_from = dist.fail_together(choose_run_dir, cfg, config_stem(args.config))
        # an edit the checkpoint cannot honour stops every rank here, before anything is built
        edits = dist.fail_together(check_edits, cfg, resume_from, world_size) if resume_from else None
        dist.fail_together(make_generated_inputs, cfg)
        (train_set, val_set, stats), model, encoders, optimizer = dist.fail_together(
            build_everything, cfg, world_size, resume_from)
    except dist.StartupError as e:
        dist.die(e)

    seed_everything(cfg.training.seed, dist.rank())  # each rank's own stream from here on
    engine = make_engine(accelerator, model, optimizer, cfg)
    encoders.to(engine.device)
    schedule, state = LRSchedule(cfg.training), TrainerState()
    stream = build_train_stream(train_set, cfg, dist.rank(), world_size)
    guard = NonFiniteGuard(state, cfg.training.max_nonfinite_steps, engine.device)

    def save_health(step: int) -> dict[str, bool]:
        check_weights_before_save(engine, step, run_dir)  # never a checkpoint of non-finite weights
        return health(guard)

    parts = checkpoint_parts(cfg, engine, state, stream, schedule, stats)
    checkpointer = Checkpointer(run_dir, cfg, parts, save_health)
    try:  # rank 0 writes here: a full disk or a read-only folder must stop every rank, not hang them
        dist.fail_together(open_run_dir, run_dir, cfg, checkpointer)
        if resume_from:
            assert edits is not None  # checked above whenever the run resumes
            restore(checkpointer, resume_from, state, cfg, edits)
        metrics = dist.fail_together(Metrics, cfg, run_dir, dist.is_main(), state.step, cfg.logging.report_to)
        evaluator = dist.fail_together(Evaluator, cfg, run_dir, metrics, dist.is_main())
    except dist.StartupError as e:
        dist.die(e)
    log.info("run directory: %s", run_dir)
    t = cfg.training
    return Training(cfg, run_dir, engine, encoders, stream, build_val_loader(val_set, cfg, dist.rank(), world_size),
                    stats, schedule, state, guard, checkpointer, metrics, evaluator,
                    samples_per_step=t.batch_size * t.gradient_accumulation_steps * world_size,
                    clock=CpuClock(state))  # last: start-up and the restore are not training


def train_step(t: Training, step: int) -> StepOutput:
    """Optimizer update `step`: its micro-batches, the update (and the EMA's), the non-finite guard."""
    lrs = t.schedule.apply(t.engine.param_groups)  # the lr of this update, set before it
    ga = t.cfg.training.gradient_accumulation_steps
    losses: dict[str, Any] = {}
    for micro in range(ga):
        batch = to_device(next(t.stream), t.engine.device)
        inputs = t.encoders.encode(batch).replace(noise_seeds=noise_seeds(t.cfg.training.seed, step, batch))
        out = t.engine.micro_step(inputs, is_last=micro == ga - 1)
        for k, v in out.logged().items():
            losses[k] = losses.get(k, 0.0) + v / ga
    grad_norm, skipped = t.engine.optimizer_step(step)
    t.guard.after_step(step, skipped, losses, grad_norm)
    return StepOutput(losses, grad_norm, lrs)


def log_step(t: Training, step: int, out: StepOutput, window: Window, last: bool) -> Window:
    """Validate when due and write a record when due; returns the throughput window to go on with."""
    cfg = t.cfg
    val = None
    if step % cfg.system.val_interval == 0 and t.val_loader is not None:
        val, pictures = validate_raw_and_ema(t.engine, t.encoders, t.val_loader, cfg, t.stats)
        t.metrics.add_figures(step, *(pictures or ({}, {})))
    if not (step % cfg.system.log_interval == 0 or val is not None or last):
        return window
    elapsed = time.perf_counter() - window.start
    t.clock.update()
    record = make_record(step=step, loss_sum=out.losses, grad_norm=out.grad_norm, param_groups=t.engine.param_groups,
                         lrs=out.lrs, val=val, state=t.state,
                         samples_per_sec=t.samples_per_step * window.steps / elapsed,
                         step_time=elapsed / window.steps, skipped=t.stream.skipped)
    t.metrics.log(record)
    t.metrics.progress(step, record)
    t.evaluator.poll()  # log the evaluations that ended, at their checkpoints' steps
    return Window()


def train(t: Training, preemption: PreemptionFlag) -> int:
    """The loop, from the restored step to training.max_steps; returns the exit code (REQUEUE_EXIT_CODE
    when preempted, after a save)."""
    cfg = t.cfg
    t.engine.train()
    window, first_step = Window(), t.state.step
    # a rank that stops progressing writes its stacks to its own file in the run folder and exits
    with Watchdog(cfg.system.hang_timeout_minutes, t.run_dir, dist.rank()) as watchdog:
        while t.state.step < cfg.training.max_steps:
            step = t.state.step + 1
            out = train_step(t, step)
            if step == first_step + 1:  # the optimizer's state exists from its first step
                log.info(t.engine.optimizer_state_report())
            t.state.step, t.state.samples_seen = step, t.state.samples_seen + t.samples_per_step
            window.steps += 1
            last = step == cfg.training.max_steps
            window = log_step(t, step, out, window, last)
            t.guard.check()  # too many non-finite steps in a row: stop without saving
            preempted = step % cfg.system.log_interval == 0 and dist.any_rank(preemption.requested)
            if t.checkpointer.due(step, last, preempted):
                t.clock.update()  # the checkpoint's trainer_state.json holds the CPU seconds up to its step
            saved = t.checkpointer.maybe_save(step, last, preempted)
            watchdog.progress()  # once a step: re-arming starts a thread (~0.2 ms)
            if saved is not None:
                t.evaluator.after_save(step, saved)  # a due checkpoint's evaluation starts beside training
            if preempted:
                log.warning("preempted (%s): saved step %d, exiting with %d for requeue",
                            preemption.signal, step, REQUEUE_EXIT_CODE)
                return REQUEUE_EXIT_CODE
    return 0


def finish(t: Training, code: int) -> NoReturn:
    """The one way out of a run that started: wait for (or, preempted, stop) the running evaluation,
    close the logs, say where everything is, leave."""
    dist.shutdown()  # first: the other ranks do not wait in its barrier for the last evaluation
    t.evaluator.close(preempted=code == REQUEUE_EXIT_CODE)
    t.metrics.close()
    if code == 0 and dist.is_main():
        print_summary(t.run_dir, t.cfg, t.state.step)
    dist.leave(code)


def main(argv: Sequence[str] | None = None) -> None:
    preemption = PreemptionFlag()  # from the start: a signal during start-up still ends in a save
    silence_known_warnings()
    t = setup(parse_args(argv))
    finish(t, train(t, preemption))


if __name__ == "__main__":
    run_guarded(main)
