"""Robot data: LeRobot v2.1/v3.0, Motus RoboTwin, synthetic and latent-action datasets -> batches.

    train_set, val_set, stats = build_datasets(cfg)
    stream = build_train_stream(train_set, cfg, rank, world_size)   # next(stream) -> batch
    loader = build_val_loader(val_set, cfg, rank, world_size)       # finite, sharded
"""
from data.build import build_datasets, build_train_stream, build_val_loader
from data.errors import DataError
from data.normalize import NormStats

__all__ = ["build_datasets", "build_train_stream", "build_val_loader", "DataError", "NormStats"]
