"""The figures of an evaluation, from predictions gathered over every sample (float64 numpy).

Actions are in robot units. Pixels are in [-1, 1], so PSNR = 10 log10(2^2 / MSE), with the MSE
pooled over every predicted frame of every sample (frame 0, the condition, is never scored).
"""
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from data.episodes import Episode

Errors = dict[str, float | list[float]]
"""Named errors: a pooled value (float) or one per dimension, step or frame (list)."""

PEAK_TO_PEAK = 2.0


def action_errors(pred: np.ndarray, true: np.ndarray) -> Errors:
    """pred, true [N, chunk, dim] -> MSE and MAE overall, per action dimension and per step of the chunk."""
    err = np.asarray(pred, np.float64) - np.asarray(true, np.float64)
    sq, ab = err ** 2, np.abs(err)
    return {"mse": float(sq.mean()), "mae": float(ab.mean()),
            "mse_per_dim": sq.mean(axis=(0, 1)).tolist(), "mae_per_dim": ab.mean(axis=(0, 1)).tolist(),
            "mse_per_step": sq.mean(axis=(0, 2)).tolist(), "mae_per_step": ab.mean(axis=(0, 2)).tolist()}


def psnr(mse: float) -> float:
    return float(10 * np.log10(PEAK_TO_PEAK ** 2 / max(float(mse), 1e-12)))


def video_errors(pred_pixels: np.ndarray, true_pixels: np.ndarray, pred_latents: np.ndarray | None = None,
                 true_latents: np.ndarray | None = None) -> Errors:
    """Pixels [N, T, 3, H, W] and normalised latents [N, z, T', h, w], frame 0 excluded -> PSNR pooled
    and per predicted frame, and the latent MSE."""
    sq = (np.asarray(pred_pixels, np.float64)[:, 1:] - np.asarray(true_pixels, np.float64)[:, 1:]) ** 2
    out: Errors = {"psnr": psnr(sq.mean()), "psnr_per_frame": [psnr(m) for m in sq.mean(axis=(0, 2, 3, 4))]}
    if pred_latents is not None:
        lat = (np.asarray(pred_latents, np.float64)[:, :, 1:] - np.asarray(true_latents, np.float64)[:, :, 1:]) ** 2
        out["latent_mse"] = float(lat.mean())
    return out


def last_action(episode: "Episode", frame: int) -> np.ndarray:
    """The 'repeat the last action' baseline's action for a window whose condition frame is `frame`: the
    action recorded just before the condition frame (frame - 1), or, at the first frame of an episode where
    there is none, the action recorded at frame 0 (for the synthetic robot a zero move)."""
    return episode.action[max(frame - 1, 0)]


def baselines(true: np.ndarray, last: np.ndarray, mean_action: np.ndarray | Sequence[float]) -> dict[str, Errors]:
    """The action baselines on the same samples: the statistics' mean action every step, and each
    sample's last action (see last_action) held for the whole chunk."""
    true = np.asarray(true, np.float64)
    constant = np.broadcast_to(np.asarray(mean_action, np.float64), true.shape)
    repeat = np.broadcast_to(np.asarray(last, np.float64)[:, None, :], true.shape)
    return {"mean_action": action_errors(constant, true), "last_action": action_errors(repeat, true)}
