"""Config of the world model (the `model` section of the YAML).

Architecture sizes come from the named size table in `models/sizes.py`
(`model.size`); the fields here are what a recipe changes on top of a size.
"""
from dataclasses import asdict, dataclass, field
from typing import Optional

MODEL_MODES = ("finetune", "pretrain")
"""finetune: action tokens [state | chunk | registers]; pretrain: the chunk alone (no robot state)."""
PRECISIONS = ("fp32", "bf16_mixed", "fp32_mixed")
"""fp32; bf16_mixed: bf16 weights, fp32 masters in DeepSpeed; fp32_mixed: fp32 weights, bf16 autocast."""
NOISE_LAWS = ("logit_normal", "uniform")
"""model.time_distribution.timestep_sample_method (models/flow.py)."""
PROJECTOR_TYPES = ("mlp3x_silu",)
"""model.und_expert.vlm.projector_type: the keys of models/experts.py's ADAPTERS."""


@dataclass
class WanConfig:
    """The video expert (diffusers `WanTransformer3DModel`), its VAE and text encoder."""
    checkpoint_path: Optional[str] = None
    """Wan2.2 transformer: a local diffusers folder, or Wan's own folder (its config.json +
    diffusion_pytorch_model*.safetensors, e.g. Wan2.2-TI2V-5B). null: random init from the size table."""
    vae_path: Optional[str] = None
    """A local diffusers folder of `AutoencoderKLWan` or Wan's `Wan2.2_VAE.pth`. null: random init (tiny sizes only)."""
    text_encoder_path: Optional[str] = None
    """umT5: a local folder with `UMT5EncoderModel` weights + tokenizer, or Wan's
    `models_t5_umt5-xxl-enc-bf16.pth` (its tokenizer in google/umt5-xxl/ beside it)."""
    num_layers: Optional[int] = None
    """Depth of a video expert built from the size table (checkpoint_path null), and so of the action and
    understanding experts (one joint attention per layer); null: the size's. A checkpoint has its own."""
    num_attention_heads: Optional[int] = None
    """Heads of every joint attention of a video expert built from the size table, at the size's width
    (head_dim = width / heads, even and at least 6: Wan's RoPE rotates channel pairs over time, rows
    and columns; more heads, more places a layer can look at once); null: the size's. A checkpoint
    has its own."""
    text_cache_mb: float = 256
    """MiB of device memory the umT5 embeddings of recent instructions may hold (raw data: each new
    instruction is encoded once, then read from this cache; least recently used evicted first). An entry is
    its prompt's tokens x text_dim fp32: a 20-token instruction at umT5-XXL's 4096 is 320 KiB."""


@dataclass
class VLMConfig:
    """The frozen understanding backbone (transformers `Qwen3VLForConditionalGeneration`)."""
    checkpoint_path: Optional[str] = None
    """Local transformers folder with the model and its processor."""


@dataclass
class VLMAdapterConfig:
    input_dim: int = 2048
    """Width of the VLM's last hidden states (2048 for Qwen3-VL-2B, 32 for tiny); checked against the VLM."""
    projector_type: str = "mlp3x_silu"
    """Adapter from VLM features to the understanding expert's width (Linear, SiLU, Linear, SiLU, Linear)."""


@dataclass
class ActionExpertConfig:
    hidden_size: Optional[int] = None
    """Width of the action expert; null: the size table's."""
    ffn_dim_multiplier: int = 4
    """FFN width = hidden_size * this."""
    norm_eps: float = 1e-5
    """Epsilon of the expert's LayerNorms and q/k RMSNorms."""
    num_registers: int = 4
    """Learned register tokens appended in fine-tune mode."""
    position_scale: float = 1.0
    """Amplitude of the fixed sin-cos action-token positions when built fresh (1: Motus's); a table
    loaded from a checkpoint (ours or Motus's) is used as saved."""


@dataclass
class UndExpertConfig:
    hidden_size: Optional[int] = None
    """Width of the understanding expert; null: the size table's."""
    ffn_dim_multiplier: int = 4
    """FFN width = hidden_size * this."""
    norm_eps: float = 1e-5
    """Epsilon of the expert's LayerNorms and q/k RMSNorms."""
    vlm: VLMAdapterConfig = field(default_factory=VLMAdapterConfig)


@dataclass
class TimeDistributionConfig:
    """How the flow-matching noise level s in [0, 1] is drawn for each sample and stream."""
    timestep_sample_method: str = "logit_normal"
    """logit_normal: s = sigmoid(sigmoid_scale * N(0,1)); uniform: Motus's discrete shifted schedule."""
    sigmoid_scale: float = 1.0
    """logit_normal: the standard deviation of the normal before the sigmoid."""
    min_t: float = 0.0
    """Lower clamp of the noise level: samples are clamped into [min_t, max_t] after the shift."""
    max_t: float = 1.0
    """Upper clamp of the noise level (after the shift)."""
    shift: float = 1.0
    """Timestep shift s' = shift * s / (1 + (shift - 1) * s); 1.0 leaves s unchanged (Motus: uniform, 5.0)."""
    action_shift: float | None = None
    """The action stream's own timestep shift in place of `shift` (null: `shift` for both streams); below 1
    it moves the actions' mass toward clean, where the last Euler steps settle a grasp."""
    marginal_video_fraction: float = 0.0
    """Share of samples whose video is held at pure noise (s = 1) instead of a drawn level: the state in
    which the `policy` sampling mode reads the video, which the laws above almost never draw."""


@dataclass
class InferenceConfig:
    num_inference_timesteps: int = 10
    """Euler steps from noise level 1 to 0 in WorldModel.sample."""


@dataclass
class LossWeightsConfig:
    video_loss_weight: float = 1.0
    """w_v in loss = w_v * video_loss + w_a * action_loss."""
    action_loss_weight: float = 1.0
    """w_a in loss = w_v * video_loss + w_a * action_loss."""


@dataclass
class TinyVAEFitConfig:
    frame_steps: int = 150
    """Adam steps of the tiny VAE's fit on single frames (its spatial layers), when the tiny frozen parts are generated."""
    clip_steps: int = 120
    """Adam steps on whole clips (its temporal layers), after the frame steps."""
    videos: int = 64
    """Training windows the fit draws its frames and clips from."""
    min_colour_shown: float = 0.0
    """Share of the fitted frames showing a coloured object whose decoded frame must show one too; below
    it the fit runs its frame and clip steps again (models/vae_fit.py). 0: no check."""
    max_rounds: int = 1
    """The most rounds of frame and clip steps the fit runs to reach min_colour_shown; short of it after
    the last, building the tiny frozen parts fails."""

    def record(self) -> dict[str, float] | None:
        """The fit as the tiny folder's stamp and a latent cache's fingerprint name it: None for the default,
        and the check's keys only when set, so folders and caches built before these keys existed stay valid."""
        if self == TinyVAEFitConfig():
            return None
        unchecked = self.min_colour_shown == 0 and self.max_rounds == 1
        return {k: v for k, v in asdict(self).items()
                if not (unchecked and k in ("min_colour_shown", "max_rounds"))}


@dataclass
class ModelConfig:
    size: str = "tiny"
    """A name from the size table: tiny, small or motus."""
    mode: str = "finetune"
    """finetune: action tokens are [state | chunk | registers]; pretrain: the chunk alone."""
    precision: str = "fp32"
    """fp32, bf16_mixed (weights in bf16) or fp32_mixed (fp32 weights, bf16 autocast)."""
    gradient_checkpointing: bool = False
    """Recompute video and action expert blocks in the backward pass."""
    absolute_video_positions: bool = False
    """Add each video token's (row, column) to its patch embedding through a projection that starts at
    zero (models/video_positions.py): RoPE places the tokens for attention weights only, so without it
    the video values an action token reads do not say where they are. Fine-tuned from a checkpoint
    without it (a Motus one), the projection starts at zero (logged as missing), the checkpoint's function."""
    wan: WanConfig = field(default_factory=WanConfig)
    vlm: VLMConfig = field(default_factory=VLMConfig)
    action_expert: ActionExpertConfig = field(default_factory=ActionExpertConfig)
    und_expert: UndExpertConfig = field(default_factory=UndExpertConfig)
    time_distribution: TimeDistributionConfig = field(default_factory=TimeDistributionConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    loss_weights: LossWeightsConfig = field(default_factory=LossWeightsConfig)
    tiny_vae_fit: TinyVAEFitConfig = field(default_factory=TinyVAEFitConfig)

    @property
    def reads_state(self) -> bool:
        """The one rule for whether the model reads a robot state: in finetune mode (its action tokens start
        with it; WorldModel.dims then has a state_dim), never in pretrain mode."""
        return self.mode == "finetune"
