"""What a recipe generates on first use instead of downloading: the synthetic dataset
(`dataset.type: synthetic`) and the tiny frozen parts (`model.size: tiny` with the three paths under
one folder, as configs/tiny.yaml has them). Training makes them at start-up; every other command that
reads a recipe's parts (conversion, export, caching, evaluation, serving, the benchmarks) calls
`ensure_generated_inputs` first, so a fresh clone needs no training run before it.
"""
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig


def ensure_generated_inputs(cfg: DictConfig, dataset: bool = True) -> None:
    """Make the recipe's generated inputs where they are missing or outdated, exactly as training does
    (the same files, so neither rebuilds what the other made); a no-op for real data and weights.
    `dataset` False: a command that reads only the model's parts (conversion, export, inference) gets
    the synthetic dataset only when the tiny VAE must be fitted to its videos."""
    from data import build_datasets
    from data.synthetic import ensure_synthetic
    from models.tiny_assets import ensure_tiny_assets, training_videos, vae_fit

    def videos() -> Any:
        ensure_synthetic(cfg)  # the tiny VAE is fitted to the training videos
        return training_videos(build_datasets(cfg)[0], vae_fit(cfg).videos, seed=cfg.training.seed)

    with every_core():
        if dataset:
            ensure_synthetic(cfg)
        ensure_tiny_assets(cfg, videos=videos)


@contextlib.contextmanager
def every_core() -> Iterator[None]:
    """torch on every core this process may run on, for the block. Training makes these inputs in
    one process (rank 0) while the others wait for it, and torchrun's OMP_NUM_THREADS=1 would leave
    their cores idle through the VAE fit (2 min on one core). The same thread count in every
    command also makes them build the same weights on one machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
