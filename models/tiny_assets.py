"""Build the tiny frozen parts locally, so the default recipe needs no download at all.

`python -m models.tiny_assets <dir>` writes, with `save_pretrained`:
  <dir>/text_encoder  UMT5EncoderModel + tokenizer
  <dir>/vlm           Qwen3VLForConditionalGeneration + tokenizer + image processor
  <dir>/vae           AutoencoderKLWan, fitted to the training videos when the caller gives them (the
                      default run fits it to the synthetic squares, so decoded pictures show them),
                      with latents_mean/std measured on those videos
They load through the same `from_pretrained` code as real weights (models/encoders.py).
The tokenizer is a byte-level BPE trained with the `tokenizers` library: any text encodes.
Everything is seeded, so two processes building the same folder write the same files.
"""
import argparse
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from models.config import TinyVAEFitConfig
from models.serialization import ModelLoadError
from models.sizes import TINY, TINY_VOCAB, ModelSize
from models.vae_fit import CLIP_BATCH, fit_vae

if TYPE_CHECKING:  # imported where used: reading a recipe does not load them
    from diffusers import AutoencoderKLWan
    from transformers import (PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration,
                              UMT5EncoderModel)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from utils.window_source import WindowSource

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
WORDS = ("pick up place put push pull move open close lift stack grasp release rotate turn slide press "
         "the a an to on in into onto from of and with left right up down forward back top bottom "
         "red green blue yellow black white orange purple block cube cup bowl box drawer door lid "
         "plate bottle ball object table shelf tray robot arm gripper hand target goal task reach").split()
PARTS = ("text_encoder", "vlm", "vae")
STAMP = "tiny_size.json"
VAE_FIT = "weighted_mse_frames_then_clips_v2"  # in the stamp, with fit.record(): a folder fitted otherwise is rebuilt


def build_tokenizer(texts: Iterable[str] = ()) -> "PreTrainedTokenizerFast":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS[i:i + 8]) for i in range(0, len(WORDS), 4)] + list(texts)
    tok.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_text_encoder(size: ModelSize = TINY, seed: int = 0) -> "UMT5EncoderModel":
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(**size.text_encoder)).eval()


def build_vlm(tokenizer: "PreTrainedTokenizerBase", size: ModelSize = TINY,
              seed: int = 1) -> "Qwen3VLForConditionalGeneration":
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    torch.manual_seed(seed)
    config = Qwen3VLConfig(text_config=dict(size.vlm_text, pad_token_id=tokenizer.pad_token_id),
                           vision_config=size.vlm_vision, **size.vlm_extra, **ids)
    return Qwen3VLForConditionalGeneration(config).eval()


def build_image_processor(size: ModelSize = TINY) -> "Qwen2VLImageProcessorPil":
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vis = size.vlm_vision
    factor = vis["patch_size"] * vis["spatial_merge_size"]
    # small pixel bounds keep a 64x64 frame at a handful of vision tokens (the 2B's default is 256x256+)
    return Qwen2VLImageProcessorPil(patch_size=vis["patch_size"], temporal_patch_size=vis["temporal_patch_size"],
                                    merge_size=vis["spatial_merge_size"],
                                    size={"shortest_edge": factor * factor, "longest_edge": 16 * factor * factor})


def build_vae(size: ModelSize = TINY, seed: int = 2, videos: torch.Tensor | None = None, frames: int = 5,
              height: int = 64, width: int = 64, fit: TinyVAEFitConfig = TinyVAEFitConfig()) -> "AutoencoderKLWan":
    """An AutoencoderKLWan, fitted to `videos` ([N, T, 3, H, W] in [-1, 1]) for `fit`'s steps when given,
    else random (smooth random videos stand in for them), whose latents_mean/std are measured on those
    videos so normalised latents are ~N(0, 1)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**size.vae).eval()
    gen = torch.Generator().manual_seed(seed)
    if videos is None:
        coarse = torch.rand(4, 3, frames, height // 16, width // 16, generator=gen) * 2 - 1
        x = torch.nn.functional.interpolate(coarse, size=(frames, height, width), mode="trilinear")
    else:
        x = videos.float().permute(0, 2, 1, 3, 4).contiguous()  # [N, 3, T, H, W], the VAE's layout
        fit_vae(vae, x, gen, fit)
    with torch.no_grad():
        mu = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in x.split(CLIP_BATCH)])
    mean = mu.mean(dim=(0, 2, 3, 4))
    std = mu.std(dim=(0, 2, 3, 4)).clamp_min(1e-6)
    vae.register_to_config(latents_mean=[round(float(x), 6) for x in mean],
                           latents_std=[round(float(x), 6) for x in std])
    return vae


def training_videos(dataset: "WindowSource[Any]", count: int = TinyVAEFitConfig.videos,
                    seed: int = 0) -> torch.Tensor | None:
    """`count` training windows' videos [count, T, 3, H, W] from a dataset with draw(rng) and load(window)
    (data/dataset.py EpisodeDataset), or None when its samples carry no raw video (a latent cache)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    samples = [dataset.load(dataset.draw(rng)) for _ in range(count)]
    if "video" not in samples[0]:
        return None
    return torch.stack([s["video"] for s in samples])


def _stamp(fitted: bool, fit: TinyVAEFitConfig) -> str:
    vae: dict[str, Any] = {"vae": VAE_FIT if fitted else "random"}
    if fitted and fit.record() is not None:
        vae["fit"] = fit.record()
    return json.dumps({"size": dataclasses.asdict(TINY), **vae}, sort_keys=True)


def vae_fit(cfg: DictConfig) -> TinyVAEFitConfig:
    """The recipe's model.tiny_vae_fit."""
    return TinyVAEFitConfig(**cfg.model.tiny_vae_fit)


def build_tiny_assets(directory: str, texts: Iterable[str] = (),
                      videos: Callable[[], torch.Tensor | None] | None = None,
                      fit: TinyVAEFitConfig = TinyVAEFitConfig()) -> str:
    """Write the three folders under `directory` (atomically: a half-written folder never appears),
    plus a stamp of the tiny size table and VAE recipe they were built from. `videos`: a callable
    returning [N, T, 3, H, W] training videos in [-1, 1] to fit the VAE to for `fit`'s steps; None
    keeps it random.
    A folder whose stamp is from another size table or VAE recipe is rebuilt (it holds only what an
    earlier build wrote); one without a stamp is not ours, and is refused. Commands started together
    on a fresh clone build it once: the others wait on a lock file beside the folder, then find it."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(os.path.abspath(directory))}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        return _build_unlocked(directory, texts, videos, fit)


def _build_unlocked(directory: str, texts: Iterable[str], videos: Callable[[], torch.Tensor | None] | None,
                    fit: TinyVAEFitConfig) -> str:
    stamp = os.path.join(directory, STAMP)
    if all(os.path.isdir(os.path.join(directory, p)) for p in PARTS):
        if not os.path.isfile(stamp):
            raise ModelLoadError(f"'{directory}' holds text_encoder/, vlm/ and vae/ but no {STAMP}: not built by "
                                 "models/tiny_assets.py; point the model paths elsewhere or delete the folder")
        found = open(stamp).read()
        if found in (_stamp(True, fit), _stamp(False, fit)) and (found == _stamp(True, fit) or videos is None):
            return directory
        log.warning("rebuilding the tiny frozen parts under %s: built for another tiny size table or VAE recipe",
                    directory)
        _remove_parts(directory)
    tmp = tempfile.mkdtemp(prefix=".tiny_assets_", dir=os.path.dirname(os.path.abspath(directory)))
    try:
        tokenizer = build_tokenizer(texts)
        build_text_encoder().save_pretrained(os.path.join(tmp, "text_encoder"))
        tokenizer.save_pretrained(os.path.join(tmp, "text_encoder"))
        build_vlm(tokenizer).save_pretrained(os.path.join(tmp, "vlm"))
        tokenizer.save_pretrained(os.path.join(tmp, "vlm"))
        build_image_processor().save_pretrained(os.path.join(tmp, "vlm"))
        clips = None if videos is None else videos()
        build_vae(videos=clips, fit=fit).save_pretrained(os.path.join(tmp, "vae"))
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(tmp, STAMP), "w") as f:
            f.write(_stamp(clips is not None, fit))
        os.replace(os.path.join(tmp, STAMP), stamp)  # identical content from every builder
        for part in PARTS:
            try:
                os.rename(os.path.join(tmp, part), os.path.join(directory, part))
            except OSError:  # another process finished this part first; its files are identical
                if not os.path.isdir(os.path.join(directory, part)):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny frozen parts (tokenizer, UMT5, Qwen3-VL, VAE) under %s", directory)
    return directory


def _remove_parts(directory: str) -> None:
    """Move an outdated build aside, then delete it: a reader never sees half a folder."""
    for part in PARTS:
        path = os.path.join(directory, part)
        if os.path.isdir(path):
            aside = tempfile.mkdtemp(prefix=f".old_{part}_", dir=directory)
            os.rename(path, os.path.join(aside, part))
            shutil.rmtree(aside, ignore_errors=True)
    os.remove(os.path.join(directory, STAMP))


def tiny_assets_dir(cfg: DictConfig) -> str | None:
    """The <dir> that model.wan.text_encoder_path, model.wan.vae_path and model.vlm.checkpoint_path
    share as <dir>/text_encoder, <dir>/vae and <dir>/vlm; None if they do not follow that layout."""
    paths = (cfg.model.wan.text_encoder_path, cfg.model.vlm.checkpoint_path, cfg.model.wan.vae_path)
    if any(p is None for p in paths):
        return None
    parents = {os.path.dirname(os.path.normpath(p)) for p in paths}
    names = tuple(os.path.basename(os.path.normpath(p)) for p in paths)
    return parents.pop() if len(parents) == 1 and names == PARTS else None


def ensure_tiny_assets(cfg: DictConfig, videos: Callable[[], torch.Tensor | None] | None = None) -> str | None:
    """For model.size tiny, build the frozen parts where the config points if they are missing or
    outdated; `videos` (see build_tiny_assets) fits the VAE to the training data as model.tiny_vae_fit says."""
    directory = tiny_assets_dir(cfg)
    if cfg.model.size != "tiny" or directory is None:
        return None
    return build_tiny_assets(directory, videos=videos, fit=vae_fit(cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write text_encoder/, vlm/ and vae/")
    parser.add_argument("--config", default=None,
                        help="fit the VAE to this recipe's training videos (read raw: dataset.cache_dir is ignored)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.INFO)
    videos, fit = None, TinyVAEFitConfig()
    if args.config:
        from data import build_datasets
        from recipe.config import load_config

        cfg = load_config(args.config, list(args.overrides) + ["dataset.cache_dir=null"])
        fit = vae_fit(cfg)
        videos = lambda: training_videos(build_datasets(cfg)[0], fit.videos, seed=cfg.training.seed)  # noqa: E731
    print(build_tiny_assets(args.directory, videos=videos, fit=fit))


if __name__ == "__main__":
    main()
