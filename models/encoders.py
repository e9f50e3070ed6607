"""The frozen parts: Wan VAE, umT5 text encoder, Qwen3-VL. No gradients, eval mode, never in
the optimizer. `encode(batch)` turns a DataBatch into the ModelBatch the world model consumes
(utils/batch.py); outputs a latent cache already provides pass through untouched.

Only what the training step needs is held on the GPU: a part moves to the device the first
time `encode` needs it and stays there; a part whose outputs the data already provides (a
latent cache with video latents, text embeddings and VLM features) never moves and costs no
GPU memory. Decoding validation pictures borrows the VAE for the call when it is not resident
(moved to the device, used, moved back to the CPU), so the pictures cost no memory in between.

A part the run never calls is not built at all (models/build.py, `frozen_parts`): training from a
latent cache holds only the VAE. Its slot is None, and an encode that would need it raises
MissingFrozenPart saying why it was not loaded.
"""
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Self

import numpy as np
import torch

from utils.batch import BatchError, DataBatch, ModelBatch

if TYPE_CHECKING:  # built in models/build.py, which imports them where used
    from diffusers import AutoencoderKLWan
    from transformers import (BaseImageProcessor, PreTrainedTokenizerBase, Qwen3VLForConditionalGeneration,
                              UMT5EncoderModel)

log = logging.getLogger(__name__)

TEXT_CACHE_MB = 256  # model.wan.text_cache_mb's default: each entry is [prompt tokens, text_dim] fp32 + a mask
CPU = torch.device("cpu")
# Which frozen part produces which model input; a latent cache holds all three (data/cache.py).
FROZEN_OUTPUTS = {"vae": "video_latents", "text_encoder": "text_embeds", "vlm": "vlm_features"}
PART_NAMES = {"vae": "the VAE", "text_encoder": "the umT5 text encoder", "vlm": "Qwen3-VL"}
OPTIONAL_PARTS = ("text_encoder", "vlm")  # the VAE is always built (models/build.py)
TextEntry = tuple[torch.Tensor, torch.Tensor]  # a cached instruction: (its prompt's embedding rows, its mask)


class MissingFrozenPart(RuntimeError):
    """An encode needs a frozen part that was not built; the message names the batch key and why."""


class FrozenEncoders:
    """Holds vae, text_encoder + tokenizer, vlm + vlm_tokenizer + image_processor (see build.py).
    text_encoder and vlm (with their tokenizers / processor) may be None: `skipped` maps each missing
    part's name to why it was not built."""

    def __init__(self, vae: "AutoencoderKLWan", text_encoder: "UMT5EncoderModel | None",
                 tokenizer: "PreTrainedTokenizerBase | None", text_len: int,
                 vlm: "Qwen3VLForConditionalGeneration | None", vlm_tokenizer: "PreTrainedTokenizerBase | None",
                 image_processor: "BaseImageProcessor | None", dtype: torch.dtype,
                 skipped: Mapping[str, str] | None = None, text_cache_mb: float = TEXT_CACHE_MB) -> None:
        self.vae, self.text_encoder, self.vlm = vae, text_encoder, vlm
        self.tokenizer, self.vlm_tokenizer, self.image_processor = tokenizer, vlm_tokenizer, image_processor
        self.text_len, self.dtype = text_len, dtype
        self.skipped = dict(skipped or {})
        self.device = CPU
        self._text_cache: OrderedDict[str, TextEntry] = OrderedDict()  # instruction -> (embedding rows, mask)
        self._text_cache_used = 0
        self.text_cache_bytes = int(text_cache_mb * 2 ** 20)
        self.vlm_len_multiple = 1  # understanding tokens padded to a multiple of this (train/speed.py, CUDA graphs)
        self._stats_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (mean, std) there
        for module in self.modules():
            module.requires_grad_(False).eval()
        vcfg = vae.config
        self._latents_mean = torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1, 1)
        self._latents_std = torch.tensor(vcfg.latents_std).view(1, -1, 1, 1, 1)

    def parts(self) -> dict[str, torch.nn.Module]:
        """{name: module} of the parts that were built."""
        return {n: getattr(self, n) for n in FROZEN_OUTPUTS if getattr(self, n) is not None}

    def modules(self) -> list[torch.nn.Module]:
        return list(self.parts().values())

    def _require(self, name: str) -> torch.nn.Module:
        module = getattr(self, name)
        if module is None:
            key, what = FROZEN_OUTPUTS[name], PART_NAMES[name]
            why = self.skipped.get(name, "it was not built")
            raise MissingFrozenPart(
                f"the batch has no {key} but {what} was not loaded because {why}; a batch from the latent "
                f"cache (dataset.cache_dir) carries {key}, so a raw batch here means the data did not come from "
                "that cache: point dataset.cache_dir at a complete cache or build every frozen part "
                "(build_world_model(cfg, frozen_parts=ALL_FROZEN_PARTS))")
        return module

    def compile_video_encoder(self) -> Self:
        """torch.compile of the VAE's encoder in place (`system.speed.compile`): the Wan VAE runs it
        once per chunk of frames, and most of its eager time goes to the channel-wise RMS norms of
        its residual blocks, which inductor fuses (2x on the tiny recipe's CPU step). The encoder
        keeps its parameter names; the decoder (validation pictures only) stays eager."""
        self.vae.encoder.compile()
        return self

    def to(self, device: torch.device | str) -> Self:
        """Run on `device` from now on. Parts move there when first needed (see the module docstring);
        on the CPU that is at once, which changes nothing."""
        # with its index ("cuda" -> cuda:0): the parts' devices carry one, and they are compared with it
        self.device = torch.empty(0, device=device).device
        if self.device.type != "cpu":
            log.info("frozen parts stay on the CPU until a batch needs them on %s", self.device)
        for module in self.modules():
            self._place(module, self.device if self.device.type == "cpu" else self._home(module))
        self._text_cache.clear()
        self._text_cache_used = 0
        self._stats_on.clear()
        return self

    def resident(self) -> list[str]:
        """Names of the parts held on the (non-CPU) device."""
        return [n for n, m in self.parts().items() if self.device.type != "cpu" and self._home(m) == self.device]

    @staticmethod
    def _home(module: torch.nn.Module) -> torch.device:
        return next(module.parameters()).device

    def _place(self, module: torch.nn.Module, device: torch.device) -> None:
        module.to(device)
        if next(module.parameters()).dtype != self.dtype:  # skip no-op casts (diffusers warns on them)
            module.to(self.dtype)

    def _need(self, module: torch.nn.Module) -> torch.nn.Module:
        """A part the training inputs need on every step: move it to the device once, keep it there."""
        if self._home(module) != self.device:
            log.info("moving the frozen %s to %s (the data does not provide its outputs)",
                     type(module).__name__, self.device)
            self._place(module, self.device)
        return module

    @contextlib.contextmanager
    def _borrow(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """A part needed now and then (picture decoding): on the device for the call only."""
        home = self._home(module)
        if home != self.device:
            self._place(module, self.device)
        try:
            yield module
        finally:
            if home != self.device:
                module.to(home)

    # ---- video -------------------------------------------------------------------------------
    def _latent_stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent mean and std on `device`, copied there once (a copy per step would be a
        pageable upload, and a stream synchronisation, inside every step)."""
        if device not in self._stats_on:
            self._stats_on[device] = (self._latents_mean.to(device), self._latents_std.to(device))
        return self._stats_on[device]

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """video [B, 1 + F, 3, H, W] in [-1, 1] -> normalised latents [B, z, T, h, w] (posterior mean)."""
        x = video.to(self.device, self.dtype).permute(0, 2, 1, 3, 4)
        mu = self._need(self.vae).encode(x).latent_dist.mean.float()
        mean, std = self._latent_stats(mu.device)
        return (mu - mean) / std

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, z, T, h, w] -> pixels [B, frames, 3, H, W] in [-1, 1] (borrows the VAE
        onto the device when it is not resident)."""
        mean, std = self._latent_stats(self.device)
        z = latents.to(self.device).float() * std + mean
        with self._borrow(self.vae) as vae:
            pixels = vae.decode(z.to(self.dtype)).sample.float().clamp(-1, 1)
        return pixels.permute(0, 2, 1, 3, 4)

    # ---- text (umT5), cached per instruction -------------------------------------------------
    @torch.no_grad()
    def encode_text(self, instructions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> text_embeds [B, text_len, text_dim] (zero past the prompt), text_mask bool [B, text_len]."""
        entries = {t: self._text_cache[t] for t in dict.fromkeys(instructions) if t in self._text_cache}
        missing = [t for t in dict.fromkeys(instructions) if t not in entries]
        if missing:
            text_encoder = self._require("text_encoder")
            assert self.tokenizer is not None  # built with the text encoder (models/build.py)
            tok = self.tokenizer(missing, padding="max_length", max_length=self.text_len, truncation=True,
                                 return_tensors="np")
            lengths = tok["attention_mask"].sum(1).tolist()  # host numbers: no device read
            ids, mask = (torch.from_numpy(tok[k]).to(self.device) for k in ("input_ids", "attention_mask"))
            hidden = self._need(text_encoder)(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            for i, text in enumerate(missing):
                # the prompt's rows only, cloned: an entry holds neither the zero padding nor its batch's output
                entries[text] = (hidden[i, :lengths[i]].clone(), mask[i].bool())
                self._remember_text(text, entries[text])
        for t in entries:
            if t in self._text_cache:
                self._text_cache.move_to_end(t)  # least recently used goes first
        rows = [entries[t][0] for t in instructions]
        embeds = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, self.text_len - embeds.shape[1]))
        return embeds, torch.stack([entries[t][1] for t in instructions])

    @staticmethod
    def _entry_bytes(entry: TextEntry) -> int:
        return sum(t.numel() * t.element_size() for t in entry)

    def _remember_text(self, text: str, entry: TextEntry) -> None:
        """Cache an instruction's embedding, evicting the least recently used beyond text_cache_bytes."""
        size = self._entry_bytes(entry)
        if size > self.text_cache_bytes:
            return
        self._text_cache[text] = entry
        self._text_cache_used += size
        while self._text_cache_used > self.text_cache_bytes:
            _, old = self._text_cache.popitem(last=False)
            self._text_cache_used -= self._entry_bytes(old)

    @property
    def text_cache_used(self) -> int:
        """Bytes the cached text embeddings hold (on the device the text encoder runs on)."""
        return self._text_cache_used

    # ---- VLM (Qwen3-VL) on the first frame + instruction ----------------------------------------
    def _vlm_prompt(self, num_image_tokens: int, instruction: str) -> str:
        # Qwen3-VL's chat template for one user turn holding an image and a text
        return ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * num_image_tokens
                + "<|vision_end|>" + instruction + "<|im_end|>\n")

    @torch.no_grad()
    def encode_vlm(self, frames: torch.Tensor, instructions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """frames [B, 3, H, W] in [-1, 1] -> last hidden states [B, L, vlm_dim] and mask bool [B, L], or None
        for the mask when no prompt is padded (the joint attention then runs unmasked, on its fastest
        kernel). L is padded up to a multiple of `vlm_len_multiple` (CUDA graphs: one graph per bucket)."""
        vlm = self._require("vlm")
        assert self.image_processor is not None and self.vlm_tokenizer is not None  # built with the VLM
        # The HF image processor works on host arrays: one download of the batch's first frames.
        images = list(((frames.float() + 1) / 2).clamp(0, 1).cpu())
        pix = self.image_processor(images=images, do_rescale=False, return_tensors="np")
        grid = np.asarray(pix["image_grid_thw"])
        counts = (grid.prod(-1) // self.image_processor.merge_size ** 2).tolist()  # host numbers
        prompts = [self._vlm_prompt(n, t) for n, t in zip(counts, instructions)]
        pad_id = self.vlm_tokenizer.pad_token_id if self.vlm_tokenizer.pad_token_id is not None else 0
        rows = [self.vlm_tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        longest = max(len(r) for r in rows)
        length = -(-longest // self.vlm_len_multiple) * self.vlm_len_multiple
        ids = torch.tensor([r + [pad_id] * (length - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
        mm_token_type_ids = (ids == vlm.config.image_token_id).long()  # 1 marks image tokens for the multimodal rope
        host = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm_token_type_ids,
                "pixel_values": torch.from_numpy(np.asarray(pix["pixel_values"])),
                "image_grid_thw": torch.from_numpy(grid)}
        on_device = {k: v.to(self.device, self.dtype if k == "pixel_values" else None, non_blocking=True)
                     for k, v in host.items()}
        out = self._need(vlm).model(**on_device, use_cache=False)
        padded = any(len(r) < length for r in rows)  # known on the host: no device read
        return out.last_hidden_state.float(), on_device["attention_mask"].bool() if padded else None

    # ---- a whole batch -------------------------------------------------------------------------
    def encode(self, batch: DataBatch) -> ModelBatch:
        """A DataBatch -> the ModelBatch on the device. Encoder outputs the batch already holds (a latent cache's
        video_latents, text_embeds, vlm_features) are used as given, and every tensor ends on the device: a
        no-op after train/step_inputs.to_device, the one upload for a batch built on the host (inference.evaluate's)."""
        for name in OPTIONAL_PARTS:  # before any part computes
            if getattr(batch, FROZEN_OUTPUTS[name]) is None:
                self._require(name)
        latents = batch.video_latents
        if latents is None:
            latents = self.encode_video(batch.video)
        text_embeds, text_mask = batch.text_embeds, batch.text_mask
        if text_embeds is None:
            text_embeds, text_mask = self.encode_text(list(batch.instruction or []))
        vlm_features, vlm_mask = batch.vlm_features, batch.vlm_mask
        if vlm_features is None:
            if batch.video is None or batch.instruction is None:
                raise BatchError("DataBatch has no vlm_features and no video and instruction to compute them: the VLM "
                                 "needs the raw first frame and the instruction; build the cache with VLM features")
            vlm_features, vlm_mask = self.encode_vlm(batch.video[:, 0], batch.instruction)

        def put(t: torch.Tensor | None) -> torch.Tensor | None:  # state, actions, cached outputs: to the model's device
            return None if t is None else t.to(self.device, non_blocking=True)

        return ModelBatch(video_latents=put(latents), text_embeds=put(text_embeds), text_mask=put(text_mask),
                          vlm_features=put(vlm_features), vlm_mask=put(vlm_mask), state=put(batch.state),
                          actions=put(batch.actions))
