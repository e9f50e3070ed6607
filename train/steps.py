"""Pieces of the training loop that are not the loop itself."""
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from dataclasses import asdict, dataclass

import numpy as np
import torch
from omegaconf import DictConfig

from train.engine import Engine
from utils import dist
from utils.batch import BatchError, DataBatch, ModelBatch

if TYPE_CHECKING:
    from data.normalize import NormStats
    from models.encoders import FrozenEncoders


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer updates taken."""
    samples_seen: int = 0
    skipped_nonfinite_steps: int = 0
    """Steps whose update was skipped: a non-finite loss or gradient norm on some rank (train/guard.py)."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.skipped_nonfinite_steps = int(sd["skipped_nonfinite_steps"])


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def noise_seeds(seed: int, step: int, batch: DataBatch) -> torch.Tensor:
    """One noise seed per sample (ModelBatch.noise_seeds, int64 [B]) from (seed, step, episode, frame): the
    noise a sample gets is the same whatever the number of processes and after a resume. Computed where the
    batch's indices are (on the GPU after `to_device`), so drawing the noise needs no host round trip."""
    if batch.episode_index is None or batch.frame_index is None:
        raise BatchError("noise_seeds needs DataBatch.episode_index and frame_index (a batch of the data)")
    return (seed * 1_000_003 + step) * 1_000_000_007 + batch.episode_index * 1_000_003 + batch.frame_index


def make_record(*, step: int, loss_sum: Mapping[str, float | torch.Tensor], grad_norm: float | torch.Tensor,
                param_groups: Sequence[dict[str, Any]], lrs: Sequence[float], val: dict[str, float] | None,
                state: TrainerState, samples_per_sec: float, step_time: float, skipped: int) -> dict[str, Any]:
    """One metrics.jsonl record; the losses (device tensors) are averaged over ranks and read back here."""
    record = {"step": step, **dist.mean_across_ranks(loss_sum),
              "grad_norm": float(grad_norm),
              "lr": {g.get("name", str(i)): lr for i, (g, lr) in enumerate(zip(param_groups, lrs))},
              "samples_per_sec": samples_per_sec, "step_time": step_time, "samples_seen": state.samples_seen,
              "skipped_samples": skipped, "skipped_nonfinite_steps": state.skipped_nonfinite_steps}
    record.update({f"val_{k}": v for k, v in (val or {}).items()})
    return record


def to_device(batch: DataBatch, device: torch.device) -> DataBatch:
    """The batch on `device` (asynchronous from the loader's pinned memory). A `vlm_mask` without
    padding is dropped here, on the host: the model then needs no attention mask, and nothing in the
    step reads a GPU tensor back to find that out."""
    mask = batch.vlm_mask
    if mask is not None and mask.device.type == "cpu" and bool(mask.all()):
        batch = batch.replace(vlm_mask=None)
    return batch.to(device)


@torch.no_grad()
def policy_errors(model: Any, inputs: ModelBatch) -> dict[str, float]:
    """Policy-mode action errors against the constant baseline (always the mean action), in
    normalised units: one sampled chunk (the configured Euler steps), and the model's expected chunk
    (one Euler step from pure noise gives E[actions | observation] for a rectified flow)."""
    assert inputs.actions is not None  # a validation batch of the data holds its actions
    truth = inputs.actions.float()

    def mse(num_steps: int | None) -> float:
        return (model.sample(inputs, "policy", num_steps).actions.float() - truth).pow(2).mean().item()

    return {"policy_action_mse": mse(None), "policy_mean_action_mse": mse(1),
            "constant_action_mse": truth.pow(2).mean().item()}


@torch.no_grad()
def prediction_pictures(model: Any, encoders: "FrozenEncoders", batch: DataBatch, inputs: ModelBatch,
                        stats: "NormStats") -> tuple[dict[str, Any], dict[str, Any]]:
    """Ground-truth vs joint-mode frames and actions (robot units), for TensorBoard. With a latent
    cache the batch holds no frames: the true frames are then the decoded true latents. Decoding
    borrows the VAE onto the GPU for the call when training does not keep it there."""
    from models.report import prediction_figures
    joint = model.sample(inputs, "joint")
    true_frames = batch.video if batch.video is not None else encoders.decode_video(inputs.video_latents)
    assert inputs.actions is not None
    grid, fig = prediction_figures(true_frames, encoders.decode_video(joint.video_latents),
                                   stats.unnormalize_action(inputs.actions.float().cpu()),
                                   stats.unnormalize_action(joint.actions.float().cpu()))
    return {"val/frames_true_vs_predicted": grid}, {"val/actions_true_vs_predicted": fig}


@torch.no_grad()
def validate(engine: Engine, encoders: "FrozenEncoders", loader: Iterable[DataBatch], cfg: DictConfig,
             stats: "NormStats") -> tuple[dict[str, float], tuple[dict[str, Any], dict[str, Any]] | None]:
    """Mean losses and policy errors on held-out episodes over `system.val_batches` batches per rank,
    averaged over ranks; rank 0 also returns prediction pictures of the first batch.

    Runs on every rank (the forward may hold collectives) with its own fixed RNG, so it
    neither depends on nor disturbs the training RNG stream.
    """
    engine.eval()
    model = engine.unwrapped_model()
    sums: dict[str, Any] = {}
    count, pictures = 0, None
    with torch.random.fork_rng(devices=[] if engine.device.type == "cpu" else [engine.device]):
        torch.manual_seed(cfg.training.seed + 1000003 * dist.rank())
        for i, batch in enumerate(loader):
            if i >= cfg.system.val_batches:
                break
            on_device = to_device(batch, engine.device)
            inputs = encoders.encode(on_device).replace(  # the same noise every time
                noise_seeds=noise_seeds(cfg.training.seed, 0, on_device))
            out = engine.model(inputs)
            values = {k: v.float().item() for k, v in out.logged().items()}
            values.update(policy_errors(model, inputs))
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + v
            if i == 0 and dist.is_main():
                pictures = prediction_pictures(model, encoders, batch, inputs, stats)
            count += 1
    engine.train()
    return dist.mean_across_ranks({k: v / max(count, 1) for k, v in sums.items()}), pictures
