"""Validation pictures: ground-truth vs predicted frames, and predicted vs true actions.

    inputs = encoders.encode(batch)                       # a DataBatch -> a ModelBatch (utils/batch.py)
    pred = model.sample(inputs, "joint")
    grid, fig = prediction_figures(batch.video, encoders.decode_video(pred.video_latents),
                                   stats.unnormalize_action(batch.actions, batch.state),
                                   stats.unnormalize_action(pred.actions, batch.state))
    writer.add_image("val/frames", grid, step); writer.add_figure("val/actions", fig, step)
"""
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure


def frame_grid(true_video: torch.Tensor, pred_video: torch.Tensor, max_samples: int = 2) -> torch.Tensor:
    """[B, T, 3, H, W] videos in [-1, 1] -> one image [3, rows * H, T * W] in [0, 1]: for each
    sample a row of true frames above a row of predicted frames (frame 0 is the condition)."""
    rows = []
    frames = min(true_video.shape[1], pred_video.shape[1])
    for b in range(min(max_samples, true_video.shape[0])):
        for video in (true_video, pred_video):
            rows.append(torch.cat(list(video[b, :frames].detach().float().cpu()), dim=-1))
    return ((torch.cat(rows, dim=-2) + 1) / 2).clamp(0, 1)


def action_figure(true_actions: torch.Tensor, pred_actions: torch.Tensor, sample: int = 0) -> "Figure":
    """[B, chunk, action_dim] -> a matplotlib figure with one panel per action dimension."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    true_a = true_actions[sample].detach().float().cpu().numpy()
    pred_a = pred_actions[sample].detach().float().cpu().numpy()
    dims = true_a.shape[-1]
    cols = min(dims, 4)
    rows = (dims + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.2 * rows), squeeze=False)
    for d, ax in enumerate(axes.flat):
        if d >= dims:
            ax.axis("off")
            continue
        ax.plot(true_a[:, d], label="true", color="black")
        ax.plot(pred_a[:, d], label="predicted", color="tab:orange", linestyle="--")
        ax.set_title(f"action {d}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def prediction_figures(true_video: torch.Tensor, pred_video: torch.Tensor, true_actions: torch.Tensor,
                       pred_actions: torch.Tensor, max_samples: int = 2) -> tuple[torch.Tensor, "Figure"]:
    """-> (frame grid tensor [3, H', W'] in [0, 1], matplotlib figure of the actions of sample 0)."""
    return frame_grid(true_video, pred_video, max_samples), action_figure(true_actions, pred_actions)


def side_by_side(true_video: torch.Tensor, pred_video: torch.Tensor) -> "np.ndarray":
    """One sample's videos [T, 3, H, W] in [-1, 1] -> uint8 frames [T, H, 2W, 3]: true left, predicted right."""
    frames = min(true_video.shape[0], pred_video.shape[0])
    both = torch.cat([true_video[:frames].float().cpu(), pred_video[:frames].float().cpu()], dim=-1)
    return ((both.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def curve_figure(series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, title: str,
                 log_y: bool = False) -> "Figure":
    """`series` name -> list of values (one line each, x = 0, 1, ...) -> a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for name, values in series.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, label=name)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    if log_y:
        ax.set_yscale("log")
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
