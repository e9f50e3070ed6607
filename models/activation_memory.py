"""Activation memory of one training forward, counted from the real model on fake tensors.

Autograd keeps, between the forward and the backward, exactly the tensors the forward's ops
save (`torch.autograd.graph.saved_tensors_hooks` sees each one) plus, under gradient
checkpointing, the inputs of every checkpointed block (recomputed from them in the backward).
`trace()` runs `WorldModel.forward` on fake tensors (torch's FakeTensorMode: shapes and dtypes,
no storage) at the real input shapes, so no memory is allocated and no flop is spent, and adds up the bytes of those tensors (each storage once,
parameters excluded). Attention is counted as a fused kernel keeps it (q, k, v, output and
the fp32 log-sum-exp; flash-attn and PyTorch's flash / memory-efficient SDPA all do this),
not as the reference kernel that fake tensors dispatch to, which would keep the S x S probabilities.

`measure()` counts the same on real tensors (by storage), for calibration and tests.
"""
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.function import FunctionCtx

from models import world_model as wm
from models.build import size_table_model
from models.sizes import ModelSize
from utils.batch import ModelBatch

VLM_PROMPT_TOKENS = 40  # chat template (~8 tokens) + an instruction of ~32 tokens, beside the image tokens


@dataclass
class Activations:
    """Bytes a forward of `batch` samples keeps for its backward."""
    batch: int
    kept: int
    """Saved by the ops, plus the inputs of checkpointed blocks (each storage once)."""
    per_layer: int
    """Saved by one layer without checkpointing (layer 1): the most one block's recompute holds."""


def example_inputs(cfg: DictConfig, model: wm.WorldModel, size: ModelSize, batch: int,
                   device: torch.device | str = "cpu") -> ModelBatch:
    """Inputs at the config's real shapes: latents from the VAE's compression, umT5 padded to its
    text length, VLM features of the image tokens of one frame plus a prompt."""
    from models.build import vae_compression

    c, spec = cfg.common, model.spec
    _, spatial = vae_compression(size.vae)
    vision = size.vlm_vision
    cell = vision["patch_size"] * vision["spatial_merge_size"]
    vlm_len = -(-c.video_height // cell) * -(-c.video_width // cell) + VLM_PROMPT_TOKENS
    return ModelBatch(
        video_latents=torch.randn(batch, size.vae["z_dim"], spec["latent_frames"], c.video_height // spatial,
                                  c.video_width // spatial, device=device),
        actions=torch.randn(batch, c.action_chunk_size, c.action_dim, device=device),
        state=torch.randn(batch, c.state_dim, device=device) if model.settings.reads_state else None,
        text_embeds=torch.randn(batch, size.text_len, size.text_encoder["d_model"], device=device),
        text_mask=torch.ones(batch, size.text_len, dtype=torch.bool, device=device),
        vlm_features=torch.randn(batch, vlm_len, spec["vlm_dim"], device=device))


def expert_tokens(cfg: DictConfig, model: wm.WorldModel, size: ModelSize) -> dict[str, int]:
    """Tokens each expert of the joint attention sees per sample: video (Wan patches of the latents),
    action ([state |] chunk | registers) and understanding (VLM features)."""
    inputs = example_inputs(cfg, model, size, 1, device="meta")
    _, frames, h, w = inputs.video_latents.shape[1:]
    p_t, p_h, p_w = model.video.config.patch_size
    action = cfg.common.action_chunk_size + cfg.model.action_expert.num_registers + (inputs.state is not None)
    return {"video": frames // p_t * (h // p_h) * (w // p_w), "action": action, "und": inputs.vlm_features.shape[1]}


def model_flops_per_sample(model: wm.WorldModel, tokens: Mapping[str, int]) -> int:
    """6 x sum(expert parameters x the tokens it processes): forward + backward of the matmuls; the
    attention scores, the text cross-attention's keys/values and checkpointing's recompute are not
    counted (so MFU is the usual model-flops utilisation, not hardware utilisation)."""
    experts = {"video": model.video, "action": model.action_expert, "und": model.und_expert}
    return 6 * sum(p.numel() * tokens[k] for k, e in experts.items() for p in e.parameters() if p.requires_grad)


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward; the forward's values are not computed."""

    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        # [B, H, S, D] over a [B, S, H, D] buffer, as the fused kernels write it: the caller's
        # transpose back to [B, S, H * D] is then a view, not a copy
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> NoReturn:
        raise RuntimeError("_FusedAttention only counts memory")


def _fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    return _FusedAttention.apply(query, key, value, attn_mask)


class _Counter:
    """Adds up saved tensors (each storage once, parameters excluded), split by layer."""

    def __init__(self, model: wm.WorldModel, key: Callable[[torch.Tensor], int]) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.key, self.checkpointing = key, model.gradient_checkpointing
        self.seen: set[int] = set()
        self.keep: list[torch.Tensor] = []
        self.kept = 0
        self.layers: list[int] = []  # bytes saved inside each joint layer, in call order
        self.layer: int | None = None  # the layer running now

    def _add(self, t: torch.Tensor) -> int:
        base = t if t._base is None else t._base
        if id(t) in self.params or id(base) in self.params:
            return 0
        k = self.key(base)
        if k in self.seen:
            return 0
        self.seen.add(k)
        self.keep.append(base)  # keep it alive so that its id is not reused during the trace
        return base.untyped_storage().nbytes() if not isinstance(base, FakeTensor) else base.numel() * base.element_size()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        n = self._add(t)
        self.kept += n
        if self.layer is not None:
            self.layers[self.layer] += n
        return t

    def wrap(self, layer_fn: wm.LayerFn) -> wm.LayerFn:
        def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # joint_layer's arguments
            if self.checkpointing:  # checkpoint() keeps the block's inputs for the recompute
                self.kept += sum(self._add(a) for a in args if torch.is_tensor(a))
            self.layers.append(0)
            self.layer = len(self.layers) - 1
            try:
                return layer_fn(*args)
            finally:
                self.layer = None
        return counted


def _count_once(model: wm.WorldModel, inputs: ModelBatch, key: Callable[[torch.Tensor], int]) -> _Counter:
    counter = _Counter(model, key)
    real_layer = wm.joint_layer
    wm.joint_layer = counter.wrap(real_layer)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            model(inputs)
    finally:
        wm.joint_layer = real_layer
    return counter


def _count(model: wm.WorldModel, inputs: ModelBatch, key: Callable[[torch.Tensor], int]) -> dict[bool, Activations]:
    """{checkpointing: Activations} for both settings (the model's own setting is restored)."""
    checkpointing = model.gradient_checkpointing
    out = {}
    try:
        for setting in (False, True):
            model.gradient_checkpointing = setting
            counter = _count_once(model, inputs, key)
            per_layer = counter.layers[1] if len(counter.layers) > 1 else counter.layers[0]
            out[setting] = Activations(inputs.video_latents.shape[0], counter.kept, per_layer)
    finally:
        model.gradient_checkpointing = checkpointing
    out[True].per_layer = out[False].per_layer  # a checkpointed block saves it again in its recompute
    return out


def trace(model: wm.WorldModel, inputs: ModelBatch) -> dict[bool, Activations]:
    """{checkpointing: Activations} of `model(inputs)` for a model and inputs made under FakeTensorMode
    (shapes and dtypes only: autocast applies as on a real CPU, which the meta device does not support)."""
    with _patched(F, "scaled_dot_product_attention", _fused_sdpa):
        return _count(model, inputs, key=id)


def measure(model: wm.WorldModel, inputs: ModelBatch) -> dict[bool, Activations]:
    """The same count on real tensors, by storage: the reference the trace is checked against."""
    return _count(model, inputs, key=lambda t: t.untyped_storage().data_ptr())


def per_sample(cfg: DictConfig, size: ModelSize) -> dict[bool, Activations]:
    """{checkpointing: Activations} of one sample at the size's depth. Every layer keeps the same
    bytes, so two shallow fakes (2 and 3 layers) fix the line kept(L) = kept(2) + (L - 2) x step,
    which keeps the trace a few seconds whatever the depth."""
    traced = {}
    for depth in (2, 3):
        with FakeTensorMode():
            model = size_table_model(cfg, depth)
            traced[depth] = trace(model, example_inputs(cfg, model, size, 1))
    extra = size.num_layers - 2
    return {c: Activations(1, traced[2][c].kept + extra * (traced[3][c].kept - traced[2][c].kept),
                           traced[3][c].per_layer) for c in (False, True)}


@contextlib.contextmanager
def _patched(module: object, name: str, value: object) -> Iterator[None]:
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)
