"""Pieces of the training loop that are not the loop itself."""
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from utils import dist


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer updates taken."""
    samples_seen: int = 0
    skipped_nonfinite_steps: int = 0
    """Steps whose update was skipped: a non-finite loss or gradient norm on some rank (train/guard.py)."""

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, sd):
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.skipped_nonfinite_steps = int(sd.get("skipped_nonfinite_steps", 0))  # older checkpoints: none


def seed_everything(seed, rank):
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def noise_seeds(seed, step, batch):
    """One noise seed per sample from (seed, step, episode, frame): the noise a sample gets is the
    same whatever the number of processes and after a resume."""
    ep, frame = batch["episode_index"].long().cpu(), batch["frame_index"].long().cpu()
    return (seed * 1_000_003 + step) * 1_000_000_007 + ep * 1_000_003 + frame


def make_record(step, loss_sum, grad_norm, param_groups, lrs, val, state, samples_per_sec, step_time, skipped):
    """One metrics.jsonl record; the losses (device tensors) are read back and averaged over ranks here."""
    record = {"step": step, **dist.mean_across_ranks({k: v.item() for k, v in loss_sum.items()}),
              "grad_norm": float(grad_norm),
              "lr": {g.get("name", str(i)): lr for i, (g, lr) in enumerate(zip(param_groups, lrs))},
              "samples_per_sec": samples_per_sec, "step_time": step_time, "samples_seen": state.samples_seen,
              "skipped_samples": skipped, "skipped_nonfinite_steps": state.skipped_nonfinite_steps}
    record.update({f"val_{k}": v for k, v in (val or {}).items()})
    return record


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.no_grad()
def policy_errors(model, inputs):
    """Policy-mode action errors against the constant baseline (always the mean action), in
    normalised units: one sampled chunk (the configured Euler steps), and the model's expected chunk
    (one Euler step from pure noise gives E[actions | observation] for a rectified flow)."""
    truth = inputs["actions"].float()

    def mse(num_steps):
        return (model.sample(inputs, "policy", num_steps)["actions"].float() - truth).pow(2).mean().item()

    return {"policy_action_mse": mse(None), "policy_mean_action_mse": mse(1),
            "constant_action_mse": truth.pow(2).mean().item()}


@torch.no_grad()
def prediction_pictures(model, encoders, batch, inputs, stats):
    """Ground-truth vs joint-mode frames and actions (robot units), for TensorBoard."""
    from models.report import prediction_figures
    joint = model.sample(inputs, "joint")
    grid, fig = prediction_figures(batch["video"], encoders.decode_video(joint["video_latents"]),
                                   stats.unnormalize_action(inputs["actions"].float().cpu()),
                                   stats.unnormalize_action(joint["actions"].float().cpu()))
    return {"val/frames_true_vs_predicted": grid}, {"val/actions_true_vs_predicted": fig}


@torch.no_grad()
def validate(engine, encoders, loader, cfg, stats):
    """Mean losses and policy errors on held-out episodes over `system.val_batches` batches per rank,
    averaged over ranks; rank 0 also returns prediction pictures of the first batch.

    Runs on every rank (the forward may hold collectives) with its own fixed RNG, so it
    neither depends on nor disturbs the training RNG stream.
    """
    engine.eval()
    model = engine.unwrapped_model()
    sums, count, pictures = {}, 0, None
    with torch.random.fork_rng(devices=[] if engine.device.type == "cpu" else [engine.device]):
        torch.manual_seed(cfg.training.seed + 1000003 * dist.rank())
        for i, batch in enumerate(loader):
            if i >= cfg.system.val_batches:
                break
            inputs = encoders.encode(to_device(batch, engine.device))
            inputs["noise_seeds"] = noise_seeds(cfg.training.seed, 0, batch)  # the same noise every time
            out = engine.model(inputs)
            values = {k: out[k].float().item() for k in ("loss", "video_loss", "action_loss")}
            values.update(policy_errors(model, inputs))
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + v
            if i == 0 and dist.is_main():
                pictures = prediction_pictures(model, encoders, batch, inputs, stats)
            count += 1
    engine.train()
    return dist.mean_across_ranks({k: v / max(count, 1) for k, v in sums.items()}), pictures
