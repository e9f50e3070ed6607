"""The batch contract: what the data gives (`DataBatch`), what the world model consumes (`ModelBatch`)
and what it returns (`FlowLosses` from a training forward, `FlowSample` from sampling).

    sample dicts --data.stream.collate--> DataBatch --FrozenEncoders.encode--> ModelBatch --> WorldModel
        WorldModel.forward -> FlowLosses; WorldModel.sample -> FlowSample

Every tensor field's shape and dtype is stated once, in `SHAPES`, and checked when a batch is built
(`__post_init__`): the rank, the dtype, one device for all, and the sizes that must agree between
fields (a symbol such as B binds at its first field and every later field must match it). The model
checks the sizes it fixes when it takes a batch (`ModelBatch.check`). Only shapes, dtypes and devices
are read, never values: building a batch of GPU tensors costs no host synchronisation.

The two types differ on purpose. The data may give frames and instructions (the raw path), any subset
of the frozen encoders' outputs (a latent cache, data/cache.py) or no actions and indices (inference),
so a DataBatch's encoder outputs are optional. The model needs every encoder output, so a ModelBatch
requires them; what stays optional there is optional for the model too (see ModelBatch).

It lives in `utils` (the lowest layer) because both peers of layer 1 build it: `data` (the collated and
cached batches) and `models` (the encoders, the memory model's example inputs, the outputs); `train` and
`inference` read the outputs.
"""
import dataclasses
from typing import Any, Mapping, Optional, Self

import torch

# name: (shape, dtype). A symbol is a size that must agree wherever it appears; a number is fixed.
SHAPES: dict[str, tuple[str, torch.dtype]] = {
    "video": ("B F 3 H W", torch.float32),  # RGB frames in [-1, 1]: the condition frame, then num_video_frames
    "video_latents": ("B z T h w", torch.float32),  # normalised VAE latents; T: latent_frames (1: condition only)
    "text_embeds": ("B Lt Dt", torch.float32),  # umT5 hidden states, zero past the prompt
    "text_mask": ("B Lt", torch.bool),  # True on the prompt's tokens
    "vlm_features": ("B Lv Dv", torch.float32),  # Qwen3-VL last hidden states of the first frame + instruction
    "vlm_mask": ("B Lv", torch.bool),  # True on real tokens; None: no row is padded (unmasked attention)
    "state": ("B S", torch.float32),  # normalised robot state at the condition frame
    "actions": ("B chunk A", torch.float32),  # normalised action chunk (action_chunk_size x action_dim)
    "noise_seeds": ("B",  torch.int64),  # one seed per sample for its training noise (models/flow.py)
    "episode_index": ("B", torch.int64),
    "frame_index": ("B", torch.int64),  # the condition frame of the sample's window
}


class BatchError(ValueError):
    """A batch that breaks the contract; the message names the field, what was expected and what it got."""


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The sizes a model fixes (WorldModel.dims), which `ModelBatch.check` holds a batch to."""
    latent_channels: int
    latent_frames: int
    text_dim: int
    vlm_dim: int
    action_chunk: int
    action_dim: int
    state_dim: Optional[int]
    """None: the model reads no state (model.mode pretrain)."""


def _shape_text(symbols: list[str], sizes: dict[str, int]) -> str:
    return ", ".join(f"{s}={sizes[s]}" if s in sizes and not s.isdigit() else s for s in symbols)


class _Batch:
    """What both batch types share: the checks against SHAPES, device moves and field replacement."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that hold a tensor, by name."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {k: v for k, v in values.items() if torch.is_tensor(v)}

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied, checked again."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Self:
        """Every tensor on `device` (asynchronous from pinned memory)."""
        return self.replace(**{k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()})

    def pin_memory(self) -> Self:
        """Called by the DataLoader with pin_memory: every tensor in page-locked host memory."""
        return self.replace(**{k: v.pin_memory() for k, v in self.tensors().items()})

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> Self:
        """A batch of the named fields; a name the contract does not know is an error."""
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise BatchError(f"{cls.__name__} has no field {', '.join(unknown)}; its fields are {', '.join(known)}")
        return cls(**fields)

    def _check_shapes(self, bound: Mapping[str, int] = {}, origin: str = "") -> dict[str, int]:
        """Rank, dtype, device and the agreement of sizes of every tensor field (`bound`: sizes fixed from
        outside, named `origin` in an error) -> the sizes, by symbol."""
        name = type(self).__name__
        sizes, where = dict(bound), {s: origin for s in bound}
        device_of = None
        for field, value in self.tensors().items():
            symbols, dtype = SHAPES[field][0].split(), SHAPES[field][1]
            fixed = {s: int(s) for s in symbols if s.isdigit()}
            want = {**sizes, **fixed}
            if value.dim() != len(symbols) or any(s in want and want[s] != n for s, n in zip(symbols, value.shape)):
                origins: dict[str, list[str]] = {}
                for s in symbols:
                    if s in where:
                        origins.setdefault(where[s], []).append(s)
                source = "; ".join(f"{', '.join(names)} from {o}" for o, names in origins.items())
                raise BatchError(f"{name}.{field}: expected shape [{_shape_text(symbols, want)}]"
                                 f"{f' ({source})' if source else ''}, got {list(value.shape)}")
            if value.dtype != dtype:
                raise BatchError(f"{name}.{field}: expected dtype {dtype}, got {value.dtype}")
            if device_of is None:
                device_of = (field, value.device)
            elif value.device != device_of[1]:
                raise BatchError(f"{name}.{field}: on {value.device}, but {device_of[0]} is on {device_of[1]}; "
                                 "a batch lives on one device (move it whole with .to(device))")
            for s, n in zip(symbols, value.shape):
                if s not in sizes and s not in fixed:
                    sizes[s], where[s] = n, field
        return sizes


@dataclasses.dataclass(frozen=True)
class DataBatch(_Batch):
    """A batch as the data gives it: the train stream and the validation loader (data/stream.collate of
    data/dataset.py's or data/cache.py's samples, whose keys are these field names) and inference's
    observations (inference/policy.Policy.batch). Shapes and dtypes: SHAPES.

    Raw path: `video` and `instruction`. Latent cache: `video_latents`, `text_embeds` + `text_mask` and
    `vlm_features` (+ `vlm_mask`) instead (a cache without VLM features still needs `video` for them).
    `actions`, `episode_index` and `frame_index` are absent at inference; `state` in data without one."""
    video: Optional[torch.Tensor] = None
    instruction: Optional[list[str]] = None
    video_latents: Optional[torch.Tensor] = None
    text_embeds: Optional[torch.Tensor] = None
    text_mask: Optional[torch.Tensor] = None
    vlm_features: Optional[torch.Tensor] = None
    vlm_mask: Optional[torch.Tensor] = None
    state: Optional[torch.Tensor] = None
    actions: Optional[torch.Tensor] = None
    episode_index: Optional[torch.Tensor] = None
    frame_index: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.video is None and self.video_latents is None:
            raise BatchError("DataBatch: neither video (raw frames) nor video_latents (a latent cache)")
        if self.text_embeds is None and self.instruction is None:
            raise BatchError("DataBatch: neither instruction nor text_embeds (a latent cache)")
        for a, b in (("text_embeds", "text_mask"), ("episode_index", "frame_index")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise BatchError(f"DataBatch: {a} and {b} come together; it has only "
                                 f"{a if getattr(self, a) is not None else b}")
        if self.vlm_mask is not None and self.vlm_features is None:
            raise BatchError("DataBatch: vlm_mask without vlm_features")
        batch = self._check_shapes().get("B")
        got = self.instruction
        if got is not None and (not isinstance(got, list) or not all(isinstance(t, str) for t in got)
                                or (batch is not None and len(got) != batch)):
            what = f"a list of {len(got)}" if isinstance(got, list) else type(got).__name__
            raise BatchError(f"DataBatch.instruction: expected a list of B={batch} strings, got {what}")


@dataclasses.dataclass(frozen=True)
class ModelBatch(_Batch):
    """What the world model consumes (WorldModel.forward and .sample, models/flow.py): built by
    FrozenEncoders.encode from a DataBatch, or directly where no data is read (the memory model's
    example inputs, models/activation_memory.py). Shapes and dtypes: SHAPES; one device, the model's.

    Optional because the model runs without them: `vlm_mask` (None: no row is padded), `state` (a
    pretrain-mode model reads none), `actions` (given only to training and to the modes that condition
    on them; the policy generates them), `noise_seeds` (None: the noise comes from a generator)."""
    video_latents: torch.Tensor
    text_embeds: torch.Tensor
    text_mask: torch.Tensor
    vlm_features: torch.Tensor
    vlm_mask: Optional[torch.Tensor] = None
    state: Optional[torch.Tensor] = None
    actions: Optional[torch.Tensor] = None
    noise_seeds: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for field in ("video_latents", "text_embeds", "text_mask", "vlm_features"):
            if not torch.is_tensor(getattr(self, field)):
                raise BatchError(f"ModelBatch.{field}: expected a tensor [{SHAPES[field][0]}], "
                                 f"got {type(getattr(self, field)).__name__}")
        self._check_shapes()

    def check(self, dims: ModelDims, training: bool) -> None:
        """The batch against the sizes the model fixes; `training`: a forward for the losses, which needs the
        actions and the whole clip of latents."""
        if dims.state_dim is not None and self.state is None:
            raise BatchError(f"ModelBatch.state: the model (model.mode finetune) reads a state "
                             f"[B, S={dims.state_dim}]; the batch has none (use model.mode=pretrain for data "
                             "without robot state)")
        if training and self.actions is None:
            raise BatchError(f"ModelBatch.actions: a training forward needs the action chunk "
                             f"[B, chunk={dims.action_chunk}, A={dims.action_dim}]; the batch has none")
        bound = {"z": dims.latent_channels, "Dt": dims.text_dim, "Dv": dims.vlm_dim, "chunk": dims.action_chunk,
                 "A": dims.action_dim}
        if dims.state_dim is not None:
            bound["S"] = dims.state_dim
        if training:
            bound["T"] = dims.latent_frames
        self._check_shapes(bound, "the model")


@dataclasses.dataclass(frozen=True)
class FlowLosses:
    """A training forward's result (WorldModel.forward, models/flow.py flow_losses): 0-dim fp32 tensors
    on the model's device, never read back here (reading them costs a host synchronisation)."""
    loss: torch.Tensor
    """What backward runs on: video_loss_weight * video_loss + action_loss_weight * action_loss."""
    video_loss: torch.Tensor
    """Detached: the velocity MSE over the noisy latent frames (frame 0, the condition, carries none)."""
    action_loss: torch.Tensor
    """Detached: the velocity MSE over the action chunk."""
    noise_level_video: torch.Tensor
    """Detached: the batch's mean noise level s of the video stream."""
    noise_level_action: torch.Tensor
    """Detached: the batch's mean noise level s of the action stream."""

    def logged(self) -> dict[str, torch.Tensor]:
        """The losses the trainer averages and logs, detached, under their metrics.jsonl names."""
        return {"loss": self.loss.detach(), "video_loss": self.video_loss.detach(),
                "action_loss": self.action_loss.detach()}


@dataclasses.dataclass(frozen=True)
class FlowSample:
    """A sampling result (WorldModel.sample, models/flow.py euler_sample): a stream the mode does not
    generate is the input's, as given (models/flow.py SAMPLE_MODES)."""
    video_latents: torch.Tensor
    """[B, z, T, h, w] normalised latents: T = latent_frames when generated; the input's as given (perhaps
    the condition frame alone) when the mode does not generate video."""
    actions: Optional[torch.Tensor]
    """[B, chunk, A], normalised as the data gives them (inference/policy.Policy.sample: in robot units, on
    the CPU); the input's when the mode does not generate actions, so None for such a mode without them."""
