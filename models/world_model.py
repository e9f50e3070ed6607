"""The trainable world model: Wan video expert + action expert + understanding expert.

Every parameter of `WorldModel` is trainable; the frozen VAE, text encoder and VLM
live in `FrozenEncoders` (models/encoders.py) and reach the model only through their
outputs (`video_latents`, `text_embeds`, `vlm_features`), which may come from a cache.
"""
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Self

import torch
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel
from omegaconf import OmegaConf
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import serialization
from models.config import ModelConfig
from models.experts import ActionExpert, UndExpert
from models.flow import MOTUS_NUM_TRAIN_STEPS, euler_sample, flow_losses
from models.joint import joint_layer
from models.video_positions import VideoPositions
from utils.batch import FlowLosses, FlowSample, ModelBatch, ModelDims

log = logging.getLogger(__name__)

# Parameters apply_precision leaves in fp32 under bf16_mixed: time embeddings and modulation tables
# (Wan keeps these in fp32; in bf16 the small gate values lose too many bits). Under DDP they stay fp32
# weights. Under --deepspeed with bf16, DeepSpeed casts every module parameter to bf16, so they compute
# from bf16 copies; their ZeRO-1/2 fp32 masters hold the loaded fp32 values (train/deepspeed_engine.py,
# restore_fp32_masters; TRAINING.md "Precision and memory").
FP32_PATTERNS = ("time_embedder", "time_proj", "scale_shift_table", "modulation")
LayerFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # joint_layer or a wrapper of it


def settings_from_dict(model_section: Mapping[str, Any]) -> ModelConfig:
    """The `model` config section as a typed ModelConfig (validated against the schema)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model_section))


def checkpointed_joint_layer(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # joint_layer's arguments
    """joint_layer under activation checkpointing (its activations are recomputed in backward);
    compiled as a whole, the checkpoint becomes part of the compiled graph."""
    return checkpoint(joint_layer, *args, use_reentrant=False)


class WorldModel(nn.Module):
    """`spec` (a JSON-able dict, saved as config.json) fixes the architecture:
    wan (WanTransformer3DModel kwargs), action_hidden, und_hidden, vlm_dim, action_dim,
    state_dim, action_chunk_size, latent_frames and model (the `model` config section)."""

    def __init__(self, spec: dict[str, Any], video: WanTransformer3DModel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.settings = settings_from_dict(spec["model"])
        s = self.settings
        self.video = video if video is not None else WanTransformer3DModel(**spec["wan"])
        wan = self.video.config
        self.heads = wan.num_attention_heads
        inner = wan.num_attention_heads * wan.attention_head_dim
        self.action_dim, self.action_chunk_size = spec["action_dim"], spec["action_chunk_size"]
        self.latent_frames = spec["latent_frames"]
        self.action_expert = ActionExpert(
            wan.num_layers, spec["action_hidden"], s.action_expert.ffn_dim_multiplier, inner,
            s.action_expert.norm_eps, spec["action_dim"], spec["state_dim"], spec["action_chunk_size"],
            s.action_expert.num_registers, use_state=s.reads_state,
            position_scale=s.action_expert.position_scale)
        self.und_expert = UndExpert(wan.num_layers, spec["und_hidden"], s.und_expert.ffn_dim_multiplier,
                                    inner, s.und_expert.norm_eps, spec["vlm_dim"], s.und_expert.vlm.projector_type)
        self.video_positions = VideoPositions(inner) if s.absolute_video_positions else None
        self.gradient_checkpointing = s.gradient_checkpointing
        self._compiled: tuple[LayerFn, LayerFn] | None = None  # (layer, checkpointed layer) after compile_blocks

    @property
    def dims(self) -> ModelDims:
        """The sizes of a batch this model takes (ModelBatch.check)."""
        wan, spec = self.video.config, self.spec
        return ModelDims(latent_channels=wan.in_channels, latent_frames=self.latent_frames, text_dim=wan.text_dim,
                         vlm_dim=spec["vlm_dim"], action_chunk=self.action_chunk_size, action_dim=self.action_dim,
                         state_dim=spec["state_dim"] if self.settings.reads_state else None)

    def compile_blocks(self, mode: str | None = None) -> Self:
        """Regional torch.compile: one compiled joint layer function (and its checkpointed twin)
        shared by every layer. The layers' modules are inputs of the graph, not constants in it, so
        the layers of one shape reuse one graph and compile time does not grow with depth. `mode`:
        torch.compile's (None: default; "reduce-overhead": CUDA graphs of the compiled layer)."""
        self._compiled = (torch.compile(joint_layer, mode=mode), torch.compile(checkpointed_joint_layer, mode=mode))
        return self

    def _layer_fn(self, recompute: bool) -> LayerFn:
        # eager: the module's functions, looked up at call time (models/activation_memory.py wraps them)
        if self._compiled is not None:
            return self._compiled[recompute]
        return checkpointed_joint_layer if recompute else joint_layer

    # ---- precision -------------------------------------------------------------------------
    def apply_precision(self) -> Self:
        """bf16_mixed: weights in bf16 except FP32_PATTERNS; fp32 and fp32_mixed keep fp32 weights."""
        if self.settings.precision == "bf16_mixed":
            for name, p in self.named_parameters():
                if not any(k in name for k in FP32_PATTERNS):
                    p.data = p.data.to(torch.bfloat16)
        return self

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        if self.settings.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    # ---- the network -----------------------------------------------------------------------
    def _video_time(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ce = self.video.condition_embedder
        freqs = ce.timesteps_proj(s.float() * MOTUS_NUM_TRAIN_STEPS)
        temb = ce.time_embedder(freqs.to(ce.time_embedder.linear_1.weight.dtype))
        return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))

    def _action_io(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        # fp32_mixed keeps the action encoder and decoder out of autocast: actions are few
        # numbers whose precision matters, and those layers are cheap
        if self.settings.precision == "fp32_mixed":
            return torch.autocast(device.type, enabled=False)
        return contextlib.nullcontext()

    def velocity(self, x_video: torch.Tensor, s_video: torch.Tensor, x_action: torch.Tensor, s_action: torch.Tensor,
                 inputs: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted velocities for noisy latents x_video [B, C, T, h, w] at noise levels s_video [B]
        and noisy actions x_action [B, chunk, action_dim] at s_action [B]. Inputs stay fp32: in the
        mixed modes autocast casts them for each matmul."""
        wan, device = self.video, x_video.device
        with torch.autocast(device.type, enabled=False):  # time embeddings and modulation in fp32
            temb_v, mod_v = self._video_time(s_video)
            temb_a, mod_a = self.action_expert.embed_time(s_action * MOTUS_NUM_TRAIN_STEPS)
        state = inputs.state
        with self._autocast(device):
            with self._action_io(device):
                a = self.action_expert.embed_tokens(x_action.float(), None if state is None else state.float())
            rope = wan.rope(x_video)
            v = wan.patch_embedding(x_video.float())
            grid = v.shape[2:]
            v = v.flatten(2).transpose(1, 2).contiguous()
            if self.video_positions is not None:
                v = v + self.video_positions(*grid)
            # Wan zero-pads umT5 embeddings past the prompt and attends over all of them
            text = inputs.text_embeds.float() * inputs.text_mask[..., None].float()
            text = wan.condition_embedder.text_embedder(text)
            u = self.und_expert.adapter(inputs.vlm_features.float())
            mask = self._joint_mask(v.shape[1], a.shape[1], inputs.vlm_mask, device)
            for i, block in enumerate(wan.blocks):
                args = (block, self.action_expert.layers[i], self.und_expert.layers[i], v, a, u,
                        mod_v, mod_a, text, rope, mask, self.heads)
                recompute = self.gradient_checkpointing and torch.is_grad_enabled()
                v, a, u = self._layer_fn(recompute)(*args)
            video_out = self._video_head(v, temb_v, x_video.shape)
            with self._action_io(device):
                action_out = self.action_expert.decode(a.float(), temb_a)
        # The last layer's understanding outputs feed nothing; tie them in with weight zero so
        # every parameter gets a gradient (exactly zero there): DDP and ZeRO see a complete set.
        return video_out.float(), action_out.float() + 0.0 * u.float().sum()

    @staticmethod
    def _joint_mask(num_video: int, num_action: int, vlm_mask: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor | None:
        if vlm_mask is None:  # no padding (train/step_inputs.to_device drops an all-true mask on the host, where
            return None       # checking costs no GPU read-back): SDPA / flash-attn take their fastest path
        keep = torch.ones(vlm_mask.shape[0], num_video + num_action, dtype=torch.bool, device=device)
        return torch.cat([keep, vlm_mask.to(device=device, dtype=torch.bool)], dim=1)[:, None, None, :]

    def _video_head(self, v: torch.Tensor, temb: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        wan = self.video
        batch, _, frames, height, width = shape
        p_t, p_h, p_w = wan.config.patch_size
        shift, scale = (wan.scale_shift_table + temb[:, None].float()).chunk(2, dim=1)
        v = (wan.norm_out(v.float()) * (1 + scale) + shift).to(v.dtype)
        v = wan.proj_out(v).reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return v.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # ---- training and inference ------------------------------------------------------------
    def forward(self, inputs: ModelBatch, generator: torch.Generator | None = None) -> FlowLosses:
        """Rectified-flow losses of a training batch (models/flow.py flow_losses)."""
        inputs.check(self.dims, training=True)
        return flow_losses(self, inputs, generator)

    def sample(self, inputs: ModelBatch, mode: str, num_steps: int | None = None,
               generator: torch.Generator | None = None,
               noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> FlowSample:
        """Euler sampling in one of models/flow.py's SAMPLE_MODES (policy, joint, video, forward_dynamics,
        inverse_dynamics); the actions come back normalised (as the data gives them).
        `noise`: optional starting noise (video [B, z, latent_frames, h, w], actions [B, chunk, dim])."""
        inputs.check(self.dims, training=False)
        steps = num_steps or self.settings.inference.num_inference_timesteps
        return euler_sample(self, inputs, mode, steps, generator, noise)

    # ---- export ----------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike[str],
                        max_shard_bytes: int = serialization.DEFAULT_SHARD_BYTES) -> None:
        """config.json + model.safetensors (sharded with an index above max_shard_bytes)."""
        serialization.save(self, directory, max_shard_bytes)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], device: torch.device | str = "cpu") -> Self:
        spec = serialization.read_config(directory)
        with init_empty_weights():  # parameters on meta (filled from the file), buffers real
            model = cls(spec)
        serialization.load_weights(model, directory, device)
        return model

