"""Train a Motus-style world model from a YAML config.

    torchrun --nproc_per_node 2 train/train.py --config configs/tiny.yaml \
        --deepspeed configs/zero2.json training.max_steps=50

Also runs under the `deepspeed` launcher and `accelerate launch`; see TRAINING.md.
"""
import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from checkpoint import disk  # noqa: E402
from checkpoint.checkpointer import Checkpointer  # noqa: E402
from checkpoint.state import Document, PerRank, RandomState, Registry, Shared, Stateful  # noqa: E402
from recipe.config import config_stem, load_config, save_config  # noqa: E402
from train.config import check_launch  # noqa: E402
from train.ema import optimizer_state_report  # noqa: E402
from train.evaluation import Evaluator  # noqa: E402
from train.engine import Engine  # noqa: E402
from train.launch import make_accelerator, make_engine  # noqa: E402
from train.guard import NonFiniteGuard, check_weights_before_save, health, run_guarded  # noqa: E402
from train.preemption import REQUEUE_EXIT_CODE, PreemptionFlag  # noqa: E402
from train.resume_policy import Edits, check as check_edits  # noqa: E402
from train.run_dir import choose_run_dir  # noqa: E402
from train import speed  # noqa: E402
from train.steps import TrainerState, make_record, noise_seeds, seed_everything, to_device, validate  # noqa: E402
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
    from checkpoint.finetune import load_finetune_weights

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
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    checkpointer.remove_interrupted_saves()


def load_resume_weights(model: "torch.nn.Module", path: str) -> None:
    """The trainable weights of checkpoint `path` into `model`, before the engine is built (its fp32
    masters are made from them): the ZeRO fp32 masters where the checkpoint has them, else the
    module weights (DDP, stage 0: fp32)."""
    from checkpoint.finetune import read_weights
    from checkpoint.zero import master_weights

    weights = {**read_weights(path, "resume.checkpoint_path"), **master_weights(os.path.join(path, "engine"))}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(weights))
    if missing:
        raise ValueError(f"resume.checkpoint_path '{path}' lacks the trainable weights {missing[:5]}: "
                         "resume needs the same model")
    model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()}, strict=False)


def checkpoint_parts(cfg: DictConfig, engine: Engine, state: TrainerState, stream: Stateful, schedule: LRSchedule,
                     stats: "NormStats | None") -> Registry:
    """Everything a checkpoint holds, each part registered once, restored in this order on resume.
    The engine (weights, optimizer, EMA) is not restored with resume.reset_optimizer (the weights were
    loaded at build), the lr schedule not with resume.reset_scheduler (it starts again)."""
    parts = Registry()
    parts.register("engine", engine, restore=not cfg.resume.reset_optimizer)
    parts.register("trainer_state", Shared(state))
    parts.register("data", Shared(stream))
    parts.register("schedule", Shared(schedule), restore=not cfg.resume.reset_scheduler)
    parts.register("rng", PerRank(RandomState()))  # after every part that may draw while it loads
    parts.register("config.yaml", Document(lambda path: disk.fsync_write(path, OmegaConf.to_yaml(cfg))))
    if stats is not None:
        parts.register("norm_stats.json", Document(stats.save))
    return parts


def restore(checkpointer: Checkpointer, path: str, parts: Registry, state: TrainerState, cfg: DictConfig,
            edits: Edits) -> None:
    """Resume every registered part; log what the edits change."""
    checkpointer.load(path, parts)
    log.info("resumed from %s at step %d", path, state.step)
    log.info(edits.line())
    for note in edits.notes:
        log.info("resume: %s", note)
    if cfg.finetune.checkpoint_path:
        log.info("resume: finetune.checkpoint_path %s is not read: a resumed run keeps its own weights",
                 cfg.finetune.checkpoint_path)


def validate_raw_and_ema(engine: Engine, encoders: "FrozenEncoders", val_loader: "ValLoader", cfg: DictConfig,
                         stats: "NormStats") -> tuple[dict[str, float], Any]:
    """Validation losses and pictures; with training.ema, the same validation with the EMA weights
    (val_ema_* keys) once the EMA holds an average."""
    val, pictures = validate(engine, encoders, val_loader, cfg, stats)
    if engine.ema is not None and engine.ema.updates:
        with engine.ema.swapped_in():
            ema_val, _ = validate(engine, encoders, val_loader, cfg, stats)
        val.update({f"ema_{k}": v for k, v in ema_val.items()})
    return val, pictures


def print_summary(run_dir: str, cfg: DictConfig, step: int) -> None:
    latest = open(os.path.join(run_dir, "latest")).read().strip()
    print(f"\nTraining finished at step {step}.\n  run directory: {run_dir}\n"
          f"  checkpoint:    {os.path.join(run_dir, latest)}\n"
          f"  metrics:       {os.path.join(run_dir, 'metrics.jsonl')}\n"
          f"  tensorboard:   tensorboard --logdir {os.path.join(run_dir, cfg.logging.tensorboard_log_dir)}",
          flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    preemption = PreemptionFlag()  # from the start: a signal during start-up still ends in a save
    silence_known_warnings()
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        ds_config = check_launch(cfg, dist.world_size(), args.deepspeed)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        dist.die(e)
    logging.basicConfig(level=cfg.system.log_level, format="%(asctime)s %(name)s: %(message)s")
    if not dist.is_main():
        logging.getLogger().setLevel(logging.WARNING)
    quiet_library_bars(cfg.logging.progress)

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

    from data import build_train_stream, build_val_loader

    seed_everything(cfg.training.seed, dist.rank())  # each rank's own stream from here on
    engine = make_engine(accelerator, model, optimizer, cfg)
    encoders.to(engine.device)
    schedule = LRSchedule(cfg.training)
    stream = build_train_stream(train_set, cfg, dist.rank(), world_size)
    val_loader = build_val_loader(val_set, cfg, dist.rank(), world_size)
    state = TrainerState()
    parts = checkpoint_parts(cfg, engine, state, stream, schedule, stats)
    checkpointer = Checkpointer(run_dir, cfg)

    try:  # rank 0 writes here: a full disk or a read-only folder must stop every rank, not hang them
        dist.fail_together(open_run_dir, run_dir, cfg, checkpointer)
        if resume_from:
            assert edits is not None  # checked above whenever the run resumes
            restore(checkpointer, resume_from, parts, state, cfg, edits)
        metrics = dist.fail_together(Metrics, cfg, run_dir, dist.is_main(), state.step, cfg.logging.report_to)
        evaluator = dist.fail_together(Evaluator, cfg, run_dir, metrics, dist.is_main())  # closed-loop, rank 0
    except dist.StartupError as e:
        dist.die(e)
    ga, micro_batch = cfg.training.gradient_accumulation_steps, cfg.training.batch_size
    samples_per_step = micro_batch * ga * world_size
    log.info("run directory: %s", run_dir)

    guard = NonFiniteGuard(state, cfg.training.max_nonfinite_steps, engine.device)

    def save(step: int) -> str:
        check_weights_before_save(engine, step, run_dir)  # never a checkpoint of non-finite weights
        return checkpointer.save(step, parts, health(guard))

    engine.train()
    loss_sum: dict[str, Any] = {}
    window_start, window_steps = time.perf_counter(), 0
    first_step = state.step
    while state.step < cfg.training.max_steps:
        lrs = schedule.apply(engine.param_groups)  # the lr of this update, set before it
        step = state.step + 1
        for micro in range(ga):
            batch = to_device(next(stream), engine.device)
            inputs = encoders.encode(batch).replace(noise_seeds=noise_seeds(cfg.training.seed, step, batch))
            out = engine.micro_step(inputs, is_last=micro == ga - 1)
            for k in ("loss", "video_loss", "action_loss"):
                loss_sum[k] = loss_sum.get(k, 0.0) + out[k].detach() / ga
        grad_norm, skipped = engine.optimizer_step()
        guard.after_step(step, skipped, loss_sum, grad_norm)
        if engine.ema is not None and not skipped:  # a skipped step changed no weight
            engine.ema.update(step)
        if state.step == first_step:  # the optimizer's state exists from its first step
            log.info(optimizer_state_report(engine))
        state.step, state.samples_seen = step, state.samples_seen + samples_per_step
        window_steps += 1

        is_last = step == cfg.training.max_steps
        val = None
        if step % cfg.system.val_interval == 0 and val_loader is not None:  # None: nothing held out
            val, pictures = validate_raw_and_ema(engine, encoders, val_loader, cfg, stats)
            metrics.add_figures(step, *(pictures or ({}, {})))
        if step % cfg.system.log_interval == 0 or val is not None or is_last:
            elapsed = time.perf_counter() - window_start
            record = make_record(step=step, loss_sum=loss_sum, grad_norm=grad_norm, param_groups=engine.param_groups,
                                 lrs=lrs, val=val, state=state, samples_per_sec=samples_per_step * window_steps / elapsed,
                                 step_time=elapsed / window_steps, skipped=stream.skipped)
            metrics.log(record)
            metrics.progress(step, record)
            evaluator.poll()  # log the evaluations that ended
            window_start, window_steps = time.perf_counter(), 0
        loss_sum = {}
        guard.check()  # too many non-finite steps in a row: stop without saving
        preempted = step % cfg.system.log_interval == 0 and dist.any_rank(preemption.requested)
        if step % cfg.system.save_interval == 0 or is_last or preempted:
            path = save(step)
            log.info("saved %s", path)
            evaluator.after_save(step, path)  # a due checkpoint's evaluation starts beside training
        if preempted:
            log.warning("preempted (%s): saved step %d, exiting with %d for requeue",
                        preemption.signal, step, REQUEUE_EXIT_CODE)
            evaluator.close(preempted=True)  # stops the running evaluation: the resumed run redoes it
            metrics.close()
            dist.shutdown()
            dist.leave(REQUEUE_EXIT_CODE)
    dist.shutdown()  # first: the other ranks do not wait in its barrier for the last evaluation
    evaluator.close(preempted=False)  # waits for the last evaluation and logs it
    metrics.close()
    if dist.is_main():
        print_summary(run_dir, cfg, state.step)
    dist.leave(0)


if __name__ == "__main__":
    run_guarded(main)
