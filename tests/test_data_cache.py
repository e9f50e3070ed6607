"""The latent cache with a small fake encoder: contents, padding, fingerprint refusal."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import DataError, build_datasets, build_train_stream
from data.build_cache import build_cache
from tests.helpers import config_from
from utils.batch import ModelBatch


class FakeEncoders:
    """Stands in for models' FrozenEncoders: deterministic functions of the raw batch."""

    def latents(self, video):  # [B, 1 + F, 3, H, W] -> [B, 3, 1 + F, H / 4, W / 4]
        b, t = video.shape[:2]
        pooled = F.avg_pool2d(video.flatten(0, 1), 4)
        return pooled.view(b, t, *pooled.shape[1:]).permute(0, 2, 1, 3, 4)

    def encode(self, batch):
        lengths = [len(t) for t in batch.instruction]
        frames = batch.frame_index.tolist()
        longest = 2 + max(f % 3 for f in frames)  # VLM lengths vary per sample; batches are padded
        features = torch.zeros(len(frames), longest, 3)
        mask = torch.zeros(len(frames), longest, dtype=torch.bool)
        for b, f in enumerate(frames):
            features[b, :2 + f % 3] = float(f)
            mask[b, :2 + f % 3] = True
        return ModelBatch(video_latents=self.latents(batch.video),
                          text_embeds=torch.tensor(lengths, dtype=torch.float32).view(-1, 1, 1).expand(-1, 5, 6).clone(),
                          text_mask=torch.ones(len(lengths), 5, dtype=torch.bool), vlm_features=features,
                          vlm_mask=mask, state=batch.state, actions=batch.actions)


def make_cfg(tmp_path, root, **extra):
    base = {"common": {"action_dim": 4, "state_dim": 8, "num_video_frames": 2, "video_height": 16, "video_width": 16,
                       "global_downsample_rate": 1, "video_action_freq_ratio": 2},
            "dataset": {"type": "synthetic", "dataset_dir": root, "val_fraction": 0.25,
                        "synthetic": {"num_episodes": 4, "episode_length": 12, "image_height": 16,
                                      "image_width": 16, "fps": 10}},
            "training": {"batch_size": 3, "seed": 1}, "system": {"num_workers": 0}}
    for section, values in extra.items():
        base.setdefault(section, {}).update(values)
    return config_from(tmp_path, base)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    cfg = make_cfg(tmp, str(tmp / "synthetic"))
    meta = build_cache(cfg, str(tmp / "cache"), FakeEncoders(), batch_size=5, rows_per_shard=7)
    return tmp, cfg, meta


def test_cache_contents(built):
    tmp, cfg, meta = built
    # 4 episodes x (12 - 4) condition frames at stride r * d = 2 -> 0, 2, 4, 6
    assert meta["num_windows"] == 16 and len(meta["shards"]) == 3 and meta["vlm_len"] == 4
    assert meta["keys"] == ["video_latents", "vlm_features", "vlm_mask"]
    raw_train, raw_val, _ = build_datasets(cfg)
    from omegaconf import OmegaConf
    cached_cfg = OmegaConf.merge(cfg, {"dataset": {"cache_dir": str(tmp / "cache")}})
    train, val, stats = build_datasets(cached_cfg)
    assert len(train) == 12 and len(val) == 4  # episode 3 held out, in the cache as well
    assert {r[3] for r in val.rows} == {3} and {r[3] for r in train.rows} == {0, 1, 2}
    k = next(i for i, r in enumerate(train.rows) if r[3] == 1 and r[4] == 4)
    sample = train.load(k)
    raw = raw_train.load((1, 4))
    want = FakeEncoders().latents(raw["video"][None])[0]
    torch.testing.assert_close(sample["video_latents"], want)
    torch.testing.assert_close(sample["actions"], raw["actions"])  # normalised on read, like the raw path
    torch.testing.assert_close(sample["state"], raw["state"])
    assert sample["vlm_mask"].tolist() == [True, True, True, False]  # 2 + 4 % 3 real tokens, padded to 4
    assert sample["vlm_features"][:3].eq(4.0).all() and sample["vlm_features"][3].eq(0).all()
    assert sample["text_embeds"][0, 0].item() == len(raw["instruction"])
    stream = build_train_stream(train, cached_cfg)
    batches = [next(stream) for _ in range(3)]
    assert batches[0].video_latents.shape == (3, 3, 3, 4, 4) and batches[0].video is None
    resumed = build_train_stream(train, cached_cfg)
    resumed.load_state_dict({**stream.state_dict(), "samples_consumed": batches[0].video_latents.shape[0]})
    torch.testing.assert_close(next(resumed).video_latents, batches[1].video_latents)


def test_mismatching_cache_is_refused(built):
    tmp, cfg, _ = built
    from omegaconf import OmegaConf
    cache = {"dataset": {"cache_dir": str(tmp / "cache")}}
    with pytest.raises(DataError, match="model.precision"):
        build_datasets(OmegaConf.merge(cfg, cache, {"model": {"precision": "bf16_mixed"}}))
    with pytest.raises(DataError, match="dataset.video_height: cache 16, config 32"):
        build_datasets(OmegaConf.merge(cfg, cache, {"common": {"video_height": 32}}))
    # a tiny VAE fitted for other steps sits at the same path with other latents
    with pytest.raises(DataError, match=r"model.tiny_vae_fit: cache None, config \{'frame_steps': 600"):
        build_datasets(OmegaConf.merge(cfg, cache, {"model": {"tiny_vae_fit": {"frame_steps": 600}}}))
    with pytest.raises(DataError, match="build_cache"):
        build_datasets(OmegaConf.merge(cfg, {"dataset": {"cache_dir": str(tmp / "nothing")}}))
    from safetensors.torch import load_file
    texts = load_file(os.path.join(tmp, "cache", "texts.safetensors"))  # one instruction: stored once
    assert texts["text_embeds"].shape == (1, 5, 6) and texts["text_mask"].shape == (1, 5)
    meta = json.load(open(os.path.join(tmp, "cache", "cache_meta.json")))
    assert len(meta["fingerprint"]) == 64 and np.isfinite(meta["seconds"])
