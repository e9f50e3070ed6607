"""The recipe's schema: every section of the YAML as a dataclass, assembled into `Config`.

Each package below the recipe owns its section and the names its keys allow (`data/config.py`,
`models/config.py`, `optim/config.py`); the sections of the packages above it (`train/`,
`inference/`: common, training, system, logging, resume, finetune, serving, evaluation) live here, because
both of them read the recipe and neither may import the other. Nothing here imports torch.
"""
from dataclasses import dataclass, field
from typing import List, Optional

from data.config import DatasetConfig
from models.config import ModelConfig
from optim.config import MuonConfig

MATMUL_PRECISIONS = ("highest", "high", "medium")
"""system.speed.matmul_precision: torch.set_float32_matmul_precision's names."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""system.log_level."""
RUNNERS = ("trainer", "follower")
"""evaluation.runner."""


@dataclass
class CommonConfig:
    action_dim: int = 14
    """Width of one robot action vector (or latent action in pretraining)."""
    state_dim: int = 14
    """Width of the robot state (proprioception) vector."""
    num_video_frames: int = 8
    """Predicted video frames F (the condition frame comes on top)."""
    video_height: int = 384
    """Frames are resized, keeping the aspect ratio and padding, to video_height x video_width."""
    video_width: int = 320
    """See video_height."""
    global_downsample_rate: int = 3
    """Raw frames between two action steps d."""
    video_action_freq_ratio: int = 2
    """Action steps per predicted video frame r."""
    action_chunk_size: Optional[int] = None
    """Derived: num_video_frames * video_action_freq_ratio. Never set by hand."""


@dataclass
class EmaConfig:
    enabled: bool = False
    """Keep an exponential moving average of the trainable weights (fp32) for validation, export and
    sampling. Under ZeRO-1/2 each rank keeps only its own slice (4 bytes per trainable parameter / W)."""
    decay: float = 0.9999
    """Decay d per EMA update: ema = d * ema + (1 - d) * weights, warmed up as min(decay, (1 + n) / (10 + n))
    with n the EMA updates so far; the first update (n = 0) copies the weights. Averages over about
    update_every / (1 - decay) optimizer steps."""
    update_every: int = 1
    """Optimizer steps between EMA updates."""
    start_step: int = 0
    """The EMA is updated after optimizer steps s >= start_step with (s - start_step) % update_every == 0;
    the first of them copies the weights."""


@dataclass
class TrainingConfig:
    batch_size: int = 2
    """Micro batch per process."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer update; gradients are synchronised at the last one only."""
    global_batch_size: Optional[int] = None
    """If set, must equal batch_size * gradient_accumulation_steps * world size."""
    max_steps: int = 100
    """Optimizer steps."""
    learning_rate: float = 1e-4
    """Peak lr of every param group (Muon's is rescaled per shape by training.muon.adjust_lr_fn)."""
    weight_decay: float = 0.01
    """Decoupled weight decay of both halves of the optimizer."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: str = "muon_adamw"
    """adamw or muon_adamw."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    scheduler_type: str = "linear"
    """linear (Motus's), cosine or constant."""
    warmup_steps: int = 10
    """Updates of linear warmup (linear and cosine)."""
    cycle_length: int = 1000
    """linear: the step at which the multiplier reaches f_min."""
    f_start: float = 0.0
    """linear: lr multiplier before the first update (warmup starts here)."""
    f_max: float = 1.0
    """linear: lr multiplier at the end of warmup."""
    f_min: float = 0.1
    """linear: lr multiplier from cycle_length on."""
    min_lr: float = 0.0
    """cosine: the lr reached at max_steps."""
    grad_clip_norm: float = 1.0
    """Global gradient norm clip (DeepSpeed `gradient_clipping`); 0 disables."""
    max_nonfinite_steps: int = 5
    """A step with a non-finite loss or gradient norm on any rank is skipped (counted as
    skipped_nonfinite_steps); after this many in a row the run stops with exit code 76, without saving."""
    seed: int = 42
    """Seeds initialisation, data order and the per-sample noise."""
    ema: EmaConfig = field(default_factory=EmaConfig)


@dataclass
class SpeedConfig:
    """Step-time switches, each on or off alone (TRAINING.md, "Speed switches")."""
    compile: bool = False
    """torch.compile the joint layer function once and reuse it for every layer (inductor on CPU
    and GPU, with or without gradient checkpointing), and the frozen VAE's encoder; off until
    measured on your GPU (TRAINING.md)."""
    fused_adamw: bool = True
    """AdamW (plain, or MuonAdamW's AdamW group) on torch's fused kernel; false: torch's default."""
    tf32: bool = True
    """GPU: TF32 in cuDNN convolutions and, with matmul_precision null, in fp32 matmuls."""
    matmul_precision: Optional[str] = None
    """torch.set_float32_matmul_precision: highest, high (TF32) or medium; null: high with tf32,
    else highest."""
    cudnn_benchmark: bool = True
    """GPU: cuDNN times its convolution algorithms on the first call of each shape, then keeps the fastest."""
    cuda_graphs: bool = False
    """GPU: CUDA graphs of the compiled layer (torch.compile mode reduce-overhead); needs compile."""
    cuda_graphs_token_multiple: int = 32
    """With cuda_graphs: a raw batch's understanding tokens (its longest VLM prompt) are padded up to a multiple
    of this, so a new prompt length reuses the graph of its bucket instead of recording one more."""
    bucket_cap_mb: Optional[int] = None
    """DDP only (no --deepspeed): gradient all-reduce bucket size in MB; null: torch's 25."""
    static_graph: bool = False
    """DDP only (no --deepspeed): DDP's static_graph (the same parameters get gradients every step)."""


@dataclass
class SystemConfig:
    checkpoint_dir: str = "./runs"
    """Runs live in {checkpoint_dir}/{config stem}/{run_name}/."""
    log_level: str = "INFO"
    """Python logging level of rank 0 (other ranks log warnings only)."""
    log_interval: int = 1
    """Steps between metrics records (and preemption checks)."""
    save_interval: int = 1000
    """Steps between checkpoints; the last step is always saved."""
    val_interval: int = 500
    """Steps between validations on the held-out episodes."""
    val_batches: int = 4
    """Batches per rank in each validation."""
    total_limit: Optional[int] = 3
    """Keep the newest N complete checkpoints; null keeps all."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host memory of batches (GPU runs)."""
    dist_timeout_minutes: int = 60
    """Process-group timeout: long enough for large checkpoint saves."""
    hang_timeout_minutes: Optional[float] = 30.0
    """A rank whose step (with its validation and save) lasts this long writes every thread's stack to
    `{run folder}/hang_stacks_rank_R.txt` and exits with code 1 (train/watchdog.py); null: never. Raise it
    above a first step's compile time."""
    speed: SpeedConfig = field(default_factory=SpeedConfig)


@dataclass
class LoggingConfig:
    report_to: str = "tensorboard"
    """tensorboard, wandb, all or none."""
    wandb_mode: Optional[str] = None
    """online, offline or disabled, winning over WANDB_MODE; null: wandb decides (WANDB_MODE, `wandb
    offline`, else online)."""
    wandb_project: Optional[str] = None
    """null: wandb decides (WANDB_PROJECT, else its default project); a value wins over WANDB_PROJECT."""
    wandb_entity: Optional[str] = None
    """null: wandb decides (WANDB_ENTITY, else your default entity); a value wins over WANDB_ENTITY."""
    progress: str = "auto"
    """auto (a bar when stderr is a terminal, else a log line per logging step), bar or lines."""
    tensorboard_log_dir: str = "tensorboard_logs"
    """Relative to the run directory."""
    run_name: Optional[str] = None
    """null: a readable name built from the config."""


@dataclass
class ResumeConfig:
    checkpoint_path: Optional[str] = None
    """A checkpoint_step_N folder, a run folder, or `auto` (newest complete checkpoint of this run)."""
    reset_scheduler: bool = False
    """true: restart the lr schedule from step 0 instead of continuing it (needed to change training.scheduler_type)."""
    reset_optimizer: bool = False
    """true: keep the checkpoint's weights, step, data position and schedule, but start the optimizer
    fresh (needed to change training.optimizer or its param-group split)."""


@dataclass
class FinetuneConfig:
    checkpoint_path: Optional[str] = None
    """Weights only: a checkpoint_step_N folder, an exported folder or a Motus checkpoint folder."""
    allow_shape_mismatch: List[str] = field(default_factory=list)
    """Regex patterns of parameter names that may change shape (skipped, left at init)."""


@dataclass
class ServingConfig:
    image_keys: List[str] = field(default_factory=lambda: ["observation/image"])
    """Observation keys of the camera images, one per recipe camera, in the order the recipe tiles its cameras
    (dataset.image_keys); each a uint8 [H, W, 3] RGB image."""
    image_shape: Optional[List[int]] = None
    """[H, W, 3] every camera image must have; null: [common.video_height, common.video_width, 3]. Images are
    fitted to the model's frame size as in training (aspect kept, black bars)."""
    state_key: str = "observation/state"
    """Observation key of the robot state: float [common.state_dim] in robot units (unused in pretrain mode)."""
    prompt_key: str = "prompt"
    """Observation key of the instruction (a string)."""
    instruction_prefix: str = ""
    """Text put before every instruction, for checkpoints trained on instructions that carry it (Motus's RoboTwin
    data: its converter writes a scene description before each task, configs/robotwin.yaml)."""
    max_batch_size: int = 8
    """Most requests answered by one model call."""
    batch_window_ms: float = 5.0
    """How long the server waits after a request for others to batch with it."""
    seed: int = 0
    """Seeds the noise every request starts from: the same observation gets the same actions, whatever it
    is batched with."""


@dataclass
class EvaluationConfig:
    """Closed-loop evaluation during training (TRAINING.md, "Closed-loop evaluation during training")."""
    task: Optional[str] = None
    """A data.sim_env task (transfer_cube, insertion, pusht) the saved checkpoints are rolled out in; null: no
    evaluation."""
    interval: int = 0
    """Steps between evaluations: a positive multiple of system.save_interval when task is set (an evaluation
    runs on the checkpoint saved at that step)."""
    episodes: int = 50
    """Policy episodes per evaluation, on the seeds seed, seed + 1, ..."""
    seed: Optional[int] = None
    """First evaluation seed; null: the first of data.sim_env.EVAL_SEEDS (every seed must lie in that range,
    never a demonstration seed)."""
    workers: int = 2
    """Rollout worker processes (each runs its own simulator)."""
    videos: int = 1
    """mp4s of the first N policy episodes, kept in the report; the first is logged as eval/video."""
    replan: Optional[int] = None
    """Steps executed per action chunk; null: the whole chunk."""
    episode_steps: Optional[int] = None
    """Episode cap; null: the task's registered cap (inference.rollout --steps)."""
    device: str = "cpu"
    """The device the evaluated checkpoint is served on: cpu, or cuda:N on a GPU node."""
    runner: str = "trainer"
    """trainer: rank 0 starts inference.rollout as a child process after each due save; follower: an external
    `python -m inference.follow RUN_DIR` job evaluates and the trainer only reads and logs its records."""


@dataclass
class Config:
    common: CommonConfig = field(default_factory=CommonConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
