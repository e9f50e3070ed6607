"""The frozen encoders' per-step costs on the host side: the umT5 embedding cache is bounded in bytes and
holds compact entries (and the memory model counts it), an unpadded VLM batch carries no mask, and under
CUDA graphs the understanding-token length is bucketed."""
import types

import pytest
import torch

from recipe.config import load_config
from utils.batch import DataBatch

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["push the red cube left", "open the drawer", "pick up the blue cup and place it on the shelf"]


@pytest.fixture(scope="module")
def tiny_cfg(tiny_yaml):
    return load_config(tiny_yaml)


@pytest.fixture(scope="module")
def encoders(tiny_cfg):
    from models import build_world_model
    from models.build import ALL_FROZEN_PARTS

    return build_world_model(tiny_cfg, frozen_parts=ALL_FROZEN_PARTS)[1]


def test_text_cache_is_bounded_in_bytes_with_compact_detached_entries(encoders):
    reference, reference_mask = encoders.encode_text(PROMPTS)  # one batch, before any bound
    lengths = reference_mask.sum(1).tolist()
    entry_bytes = [n * reference.shape[2] * 4 + encoders.text_len for n in lengths]  # fp32 rows + bool mask
    encoders.to("cpu")  # empties the cache
    encoders.text_cache_bytes = entry_bytes[1] + entry_bytes[2]  # room for the last two
    embeds, mask = encoders.encode_text(PROMPTS)
    assert torch.equal(embeds, reference) and torch.equal(mask, reference_mask)
    assert list(encoders._text_cache) == PROMPTS[1:]  # the least recently used went first
    assert encoders.text_cache_used == entry_bytes[1] + entry_bytes[2] <= encoders.text_cache_bytes
    for text, (rows, row_mask) in encoders._text_cache.items():
        n = lengths[PROMPTS.index(text)]
        assert rows.shape == (n, reference.shape[2])  # the prompt's tokens only, no zero padding
        assert rows.untyped_storage().nbytes() == rows.numel() * 4  # its own storage, not a view of the batch
        assert not rows.requires_grad and row_mask.sum() == n
    again, _ = encoders.encode_text([PROMPTS[2], PROMPTS[1]])  # from the cache, padded as before
    assert torch.equal(again, reference[[2, 1]])
    encoders.text_cache_bytes = 2 ** 28


def test_memory_model_counts_the_text_cache(tiny_cfg, tmp_path):
    from models import memory_model

    on_gpu = memory_model.frozen_parts_on_gpu(tiny_cfg)
    assert "text_encoder" in on_gpu
    assert memory_model.text_cache_bytes(tiny_cfg, on_gpu) == 256 * 2 ** 20  # model.wan.text_cache_mb's default
    assert memory_model.text_cache_bytes(tiny_cfg, ["vae"]) == 0  # a latent cache provides the embeddings
    counts = {"vae": 10, "text_encoder": 20, "vlm": 30}
    with_cache = memory_model.static_memory(counts, 100, 0, on_gpu, "bf16_mixed", 1, text_cache=1000)
    without = memory_model.static_memory(counts, 100, 0, on_gpu, "bf16_mixed", 1)
    assert sum(with_cache["zero2"].values()) - sum(without["zero2"].values()) == 1000


def frames(n):
    return torch.rand(n, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_an_unpadded_vlm_batch_has_no_mask_and_a_padded_one_keeps_it(encoders):
    same = encoders.encode(DataBatch(video=frames(2)[:, None].expand(2, 5, 3, 64, 64), instruction=[PROMPTS[0]] * 2,
                                     text_embeds=torch.zeros(2, 16, 32), text_mask=torch.ones(2, 16, dtype=torch.bool),
                                     video_latents=torch.zeros(2, 8, 2, 8, 8)))
    assert same.vlm_mask is None  # the joint attention runs unmasked
    features, mask = encoders.encode_vlm(frames(2), PROMPTS[:2])
    assert mask is not None and mask.sum(1).tolist()[0] > mask.sum(1).tolist()[1]
    assert mask.shape == features.shape[:2]


def test_cuda_graphs_bucket_the_understanding_tokens(encoders):
    from train import speed

    flags = types.SimpleNamespace(compile=False, cuda_graphs=True, cuda_graphs_token_multiple=32, fused_adamw=True,
                                  tf32=True, matmul_precision=None, cudnn_benchmark=True)
    precision = torch.get_float32_matmul_precision()
    try:
        speed.apply(None, encoders, flags)
        assert encoders.vlm_len_multiple == 32
        short, mask_short = encoders.encode_vlm(frames(2), [PROMPTS[1]] * 2)
        long, mask_long = encoders.encode_vlm(frames(2), [PROMPTS[2]] * 2)
        assert short.shape[1] == long.shape[1] == 32  # two prompt lengths, one graph shape
        assert mask_short.sum(1).tolist()[0] < mask_long.sum(1).tolist()[0] < 32
        speed.apply(None, encoders, types.SimpleNamespace(**{**vars(flags), "cuda_graphs": False}))
        assert encoders.vlm_len_multiple == 1
        assert encoders.encode_vlm(frames(2), [PROMPTS[1]] * 2)[1] is None  # no graphs: no padding, no mask
    finally:
        torch.set_float32_matmul_precision(precision)
        encoders.vlm_len_multiple = 1
