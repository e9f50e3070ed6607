"""recipe.generated: the inputs a recipe makes on first use are made on every core."""
import os

import torch

from recipe.config import load_config


def test_the_inputs_are_made_on_every_core_and_the_thread_count_comes_back(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1, and the other ranks wait while rank 0 fits the tiny VAE."""
    from data import synthetic
    from models import tiny_assets
    from recipe.generated import ensure_generated_inputs

    seen = []
    monkeypatch.setattr(synthetic, "ensure_synthetic", lambda cfg: seen.append(("data", torch.get_num_threads())))
    monkeypatch.setattr(tiny_assets, "ensure_tiny_assets",
                        lambda cfg, videos: seen.append(("parts", torch.get_num_threads())))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ensure_generated_inputs(load_config("configs/tiny.yaml"))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0))
    assert seen == [("data", cores), ("parts", cores)] and after == 1
