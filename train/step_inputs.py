"""What a training step feeds the model besides the batch: the seeds of the RNGs and of each sample's
noise, and the batch on the device."""
import random

import numpy as np
import torch

from utils.batch import BatchError, DataBatch


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


def to_device(batch: DataBatch, device: torch.device) -> DataBatch:
    """The batch on `device` (asynchronous from the loader's pinned memory). A `vlm_mask` without
    padding is dropped here, on the host: the model then needs no attention mask, and nothing in the
    step reads a GPU tensor back to find that out."""
    mask = batch.vlm_mask
    if mask is not None and mask.device.type == "cpu" and bool(mask.all()):
        batch = batch.replace(vlm_mask=None)
    return batch.to(device)
