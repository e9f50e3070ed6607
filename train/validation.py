"""Validation on held-out episodes: losses, policy errors against the constant baseline, and prediction
pictures, with the raw weights and (training.ema) the EMA's."""
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from train.engine import Engine
from train.step_inputs import noise_seeds, to_device
from utils import dist
from utils.batch import DataBatch, ModelBatch

if TYPE_CHECKING:
    from data.normalize import NormStats
    from data.stream import ValLoader
    from models.encoders import FrozenEncoders


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
                                   stats.unnormalize_action(inputs.actions.float().cpu(), inputs.state),
                                   stats.unnormalize_action(joint.actions.float().cpu(), inputs.state))
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


def validate_raw_and_ema(engine: Engine, encoders: "FrozenEncoders", val_loader: "ValLoader", cfg: DictConfig,
                         stats: "NormStats") -> tuple[dict[str, float], Any]:
    """Validation losses and pictures; with training.ema, the same validation with the EMA weights
    (val_ema_* keys) once the EMA holds an average."""
    val, pictures = validate(engine, encoders, val_loader, cfg, stats)
    if engine.ema is not None and engine.ema.updates:
        with engine.ema_swapped_in():
            ema_val, _ = validate(engine, encoders, val_loader, cfg, stats)
        val.update({f"ema_{k}": v for k, v in ema_val.items()})
    return val, pictures
