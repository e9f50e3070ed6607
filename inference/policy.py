"""A robot observation -> the model's inputs -> an action chunk in robot units (policy mode).

Shared by the server and the offline evaluation. An observation is a dict (the `serving` config
section names its keys):
  serving.image_keys[i]  uint8 [H, W, 3] RGB image of the recipe's i-th camera (serving.image_shape)
  serving.state_key      float [common.state_dim] robot state in robot units (finetune mode only)
  serving.prompt_key     str, the instruction
The images become the model's picture exactly as training data does (data/transforms.compose_frames,
dataset.frame_layout of the checkpoint: tiled, or RoboTwin's composition), the prompt gets serving.instruction_prefix,
the state is normalised with the checkpoint's statistics, and the sampled chunk is unnormalised back
to robot units. Each sample starts from its own noise, drawn from a generator seeded by its seed, so
its actions do not depend on the batch it was computed in.
"""
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from data.transforms import compose_frames
from utils.batch import DataBatch, FlowSample, ModelBatch

if TYPE_CHECKING:
    from inference.load import Loaded
    from models.world_model import WorldModel


class ObservationError(ValueError):
    """An observation the policy cannot use: the message names the key and what was expected."""


class KeySpec(TypedDict):
    """One entry of the metadata's `observation_keys`: what a client must send under that key."""
    shape: list[int]
    dtype: str  # "uint8", "float32" or "str"


Checked = tuple[list[np.ndarray], np.ndarray | None, str]
"""An observation `Policy.check` accepted: (images, state or None, prompt)."""


def sample_noise(model: "WorldModel", latents: torch.Tensor,
                 seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Starting noise (video [B, z, latent_frames, h, w], actions [B, chunk, dim]) on the latents' device,
    drawn on the CPU from one generator per seed (a sample's noise then does not depend on its batch, nor on
    the device's RNG); `latents` are the condition latents [B, z, 1, h, w] (for their shape and device)."""
    z, (h, w) = latents.shape[1], latents.shape[3:]
    videos, actions = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(int(seed))
        videos.append(torch.randn((1, z, model.latent_frames, h, w), generator=g))
        actions.append(torch.randn((1, model.action_chunk_size, model.action_dim), generator=g))
    return torch.cat(videos).to(latents.device), torch.cat(actions).to(latents.device)


class Policy:
    def __init__(self, loaded: "Loaded", num_steps: int | None = None) -> None:
        self.loaded, self.num_steps = loaded, num_steps
        self.model, self.encoders, self.stats = loaded.model, loaded.encoders, loaded.stats
        self.device = loaded.encoders.device  # where the model and its frozen parts compute
        c, self.serving = loaded.cfg.common, loaded.cfg.serving
        self.height, self.width = c.video_height, c.video_width
        self.frame_layout = loaded.cfg.dataset.frame_layout
        self.image_shape = tuple(self.serving.image_shape or (c.video_height, c.video_width, 3))
        self.use_state = self.model.settings.reads_state
        self.state_dim = self.model.spec["state_dim"]
        self.action_shape = (self.model.action_chunk_size, self.model.action_dim)

    # ---- what a client must send --------------------------------------------------------------
    def observation_keys(self) -> dict[str, KeySpec]:
        keys: dict[str, KeySpec] = {k: {"shape": list(self.image_shape), "dtype": "uint8"}
                                    for k in self.serving.image_keys}
        if self.use_state:
            keys[self.serving.state_key] = {"shape": [self.state_dim], "dtype": "float32"}
        keys[self.serving.prompt_key] = {"shape": [], "dtype": "str"}
        return keys

    def metadata(self) -> dict[str, Any]:
        return {"observation_keys": self.observation_keys(), "action_shape": list(self.action_shape),
                "action_chunk_size": self.action_shape[0], "action_dim": self.action_shape[1],
                "action_units": "robot (unnormalised with the checkpoint's statistics)",
                "image_keys": list(self.serving.image_keys), "prompt_key": self.serving.prompt_key,
                "state_key": self.serving.state_key if self.use_state else None, "frame_layout": self.frame_layout,
                "num_inference_timesteps": self.num_steps or self.model.settings.inference.num_inference_timesteps,
                "checkpoint": self.loaded.checkpoint, "config_hash": self.loaded.config_hash,
                "weights": self.loaded.weights}

    def check(self, obs: object) -> Checked:
        """-> (images, state or None, prompt) of a well-formed observation; else ObservationError."""
        if not isinstance(obs, dict):
            raise ObservationError(f"expected an observation dict, got {type(obs).__name__}")
        missing = [k for k in self.observation_keys() if k not in obs]
        if missing:
            raise ObservationError(f"observation lacks {missing}; expected keys {sorted(self.observation_keys())} "
                                   f"(got {sorted(map(str, obs))})")
        images = [self._image(k, obs[k]) for k in self.serving.image_keys]
        state = self._state(obs[self.serving.state_key]) if self.use_state else None
        prompt = obs[self.serving.prompt_key]
        if not isinstance(prompt, str):
            raise ObservationError(f"'{self.serving.prompt_key}' must be a string, got {type(prompt).__name__}")
        return images, state, prompt

    def _image(self, key: str, value: object) -> np.ndarray:
        if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.shape != self.image_shape:
            got = f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
            raise ObservationError(f"'{key}' must be a uint8 array of shape {list(self.image_shape)} (RGB), got {got}")
        return value

    def _state(self, value: object) -> np.ndarray:
        key = self.serving.state_key
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.shape != (self.state_dim,):
            got = f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
            raise ObservationError(f"'{key}' must be a float array of shape [{self.state_dim}], got {got}")
        if not np.isfinite(value).all():
            raise ObservationError(f"'{key}' holds NaN or infinite values")
        return value.astype(np.float32)

    # ---- the model call -------------------------------------------------------------------------
    def batch(self, checked: list[Checked]) -> DataBatch:
        """Checked observations -> a DataBatch as the data gives it (condition frame only, no actions), on the
        model's device: composed, fitted and normalised on the host, then uploaded once."""
        video = torch.stack([compose_frames([im[None] for im in images], self.frame_layout, self.height, self.width)
                             for images, _, _ in checked])
        state = None
        if self.use_state:
            state = np.stack([s for _, s, _ in checked])
            state = torch.from_numpy(np.asarray(self.stats.normalize_state(state), dtype=np.float32)).to(self.device)
        return DataBatch(video=video.to(self.device), state=state,
                         instruction=[self.serving.instruction_prefix + prompt for _, _, prompt in checked])

    @torch.no_grad()
    def sample(self, inputs: ModelBatch, seeds: list[int], mode: str = "policy",
               num_steps: int | None = None) -> FlowSample:
        """Encoded inputs (FrozenEncoders.encode) -> the model's sample, its actions in robot units on the CPU."""
        noise = sample_noise(self.model, inputs.video_latents[:, :, :1], seeds)
        out = self.model.sample(inputs, mode, num_steps or self.num_steps, noise=noise)
        # None only from a mode that does not generate actions, on inputs without them (evaluate's batches hold them)
        assert out.actions is not None, f"sample mode {mode!r} returned no actions: the inputs hold none"
        return FlowSample(video_latents=out.video_latents,
                          actions=self.stats.unnormalize_action(out.actions.float().cpu(), inputs.state))

    def infer(self, observations: Iterable[object], seeds: list[int] | None = None) -> np.ndarray:
        """Observations -> action chunks float32 [B, chunk, action_dim] in robot units (all from
        serving.seed unless `seeds` are given)."""
        return self.infer_checked([self.check(o) for o in observations], seeds)

    def infer_checked(self, checked: list[Checked], seeds: list[int] | None = None) -> np.ndarray:
        """The same, for observations `check` has already accepted."""
        seeds = [self.serving.seed] * len(checked) if seeds is None else seeds
        inputs = self.encoders.encode(self.batch(checked))
        return self.sample(inputs, seeds).actions.numpy().astype(np.float32)
