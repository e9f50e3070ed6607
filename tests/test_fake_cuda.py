"""Device discipline proven on a CPU: the trainable model, the frozen encoders and the optimizer state
live on a *fake* `cuda:0` (torch's FakeTensorMode: tensors with a device, shape and dtype but no data),
and the training step, the served policy, every evaluation mode and the EMA run on it for real.

What fails a test here:
- a CPU tensor meeting a CUDA tensor in an op: FakeTensorMode raises FakeTensorDeviceMismatchError,
  exactly where a GPU run would crash;
- a host read of a device value (`.item()`, `bool(t)`, `.tolist()`, `float(t)`: each a device
  synchronisation) or a device->host copy, unless the chain of project functions that made it holds
  a name of the allow-lists below (the reads the loop is designed to make);
- a host->device upload that no allow-listed function makes (a constant copied again every step).
`DeviceTraffic` records those three kinds of traffic (a read answers 0, so a run goes to its end and
the test names every offender at once).

What cannot run under fake tensors, and how the suite stands in for it:
- The HF image processor of Qwen3-VL (`Qwen2VLImageProcessorPil`; the torchvision one needs torchvision,
  which the recipe does not install) computes on host numpy arrays, which a fake tensor cannot give: the
  suite hands it zero images of the frames' shape (its outputs depend on the shape only). The one
  download of the first frames per batch that feeds it is allow-listed (`FrozenEncoders.encode_vlm`).
- Qwen3-VL's forward: its vision tower sizes tensors by the values of `image_grid_thw` (repeat_interleave
  with a data-dependent output shape: no fake kernel), and reads that grid back to the host itself (a
  synchronisation inside the library that the recipe cannot remove). The suite replaces the VLM's
  language-model call by a stand-in that asserts every input `encode_vlm` hands it is on the GPU and
  returns fake hidden states of the right shape; everything around it runs.
- The backward pass: autograd's engine asks the CUDA accelerator's hooks for its streams, which a CPU-only
  build does not have ("Cannot access accelerator device when none is available"). The forward, where a
  CPU tensor would meet the GPU, runs whole; the stand-in accelerator's backward then gives every parameter
  a fake gradient of its shape on its device, and the Engine's optimizer step (clipping, the non-finite
  check, Muon and AdamW), the guard and the EMA run on those.
- accelerate's DDP wrapper, DeepSpeed and NCCL need a process group on a real device: the step runs the
  Engine's own DDP-branch code (micro_step, optimizer_step) with an accelerator that wraps nothing.
- torch.compile, CUDA graphs and flash-attn: not run (they compile for or call a real GPU).
- A CPU-only torch build has no CUDA device guard, which the Python bindings of indexing,
  `.contiguous()` and `.to("cuda")` take: the suite compiles and loads a two-line C++ file that registers
  PyTorch's own no-op guard for CUDA (what `torch._C._ensureCUDADeviceGuardSet` does on a CUDA build
  without a device). It needs a C++ compiler and ninja (`torch.utils.cpp_extension`).

Run: `.venv/bin/python -m pytest tests/test_fake_cuda.py -q` (about a minute on one core).
"""
import contextlib
import os
import sys
import types

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import ROOT
from utils.batch import BatchError, DataBatch

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
GUARD_SOURCE = ("#include <c10/core/impl/DeviceGuardImplInterface.h>\n"
                "C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);\n")

# Each entry: a project function name (qualified as Python prints it) whose traffic is by design.
TRAIN_READS = {
    "DDPEngine._apply_update": "whether the update runs is host control flow: one agreed flag per step",
    "make_record": "the logged losses and gradient norm, at a logging step",
}
TRAIN_UPLOADS = {"to_device": "the batch, from the loader's pinned memory (non_blocking)"}
TRAIN_DOWNLOADS = {"make_record": "the logged losses, averaged over ranks, read at a logging step"}
FIRST_STEP_UPLOADS = {  # once, at the first step that needs them
    "FrozenEncoders._need": "a frozen part moves to the GPU the first time a batch needs it",
    "FrozenEncoders._latent_stats": "the VAE's latent mean and std, copied to the GPU once",
}
RAW_UPLOADS = {
    "FrozenEncoders.encode_vlm": "the image processor's pixels and the prompt tokens (the processor runs on the host)",
    "FrozenEncoders.encode_text": "an instruction's tokens, the first time it is seen (cached on the device after)",
}
RAW_DOWNLOADS = {"FrozenEncoders.encode_vlm": "the first frames, once per batch, for the host image processor"}
INFER_UPLOADS = {
    "Policy.batch": "the observation (frames and state) once per call",
    "sample_noise": "the starting noise from per-seed CPU generators (a sample's noise does not depend on its batch)",
}
INFER_DOWNLOADS = {"Policy.sample": "the action chunk, once per call, to the robot"}


@pytest.fixture(scope="session")
def fake_cuda_guard(tmp_path_factory):
    """A no-op CUDA device guard in this process (see the module docstring); nothing on a CUDA build."""
    if torch.cuda.is_available() or torch.backends.cuda.is_built():
        return
    from torch.utils.cpp_extension import load

    build = tmp_path_factory.mktemp("fake_cuda_guard")
    source = build / "fake_cuda_guard.cpp"
    source.write_text(GUARD_SOURCE)
    load(name="fake_cuda_guard", sources=[str(source)], build_directory=str(build), is_python_module=False)


def project_chain():
    """Qualified names of the project functions on the stack (outermost first), tests excluded."""
    names, frame = [], sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        path = os.path.abspath(name)
        inside = not name.startswith("<") and path.startswith(ROOT + os.sep) and "site-packages" not in path
        if inside and not path.startswith(os.path.join(ROOT, "tests") + os.sep):
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return names[::-1]


def _device_of(t):
    return t.device if torch.is_tensor(t) else torch.device("cpu")


class DeviceTraffic(TorchDispatchMode):
    """Records host reads of device values, device->host copies and host->device uploads of more than
    one element, each with its `project_chain()`; a read of a device value answers 0 (and so does a read
    of a host copy of one: the copy itself is recorded)."""

    def __init__(self):
        super().__init__()
        self.reads, self.downloads, self.uploads = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if _device_of(args[0]).type == "cuda":
                self.reads.append(project_chain())
                return False if args[0].dtype == torch.bool else 0
            try:  # a host tensor: its value when fake mode knows it (a constant), else that of a download
                return func(*args, **kwargs)
            except DataDependentOutputException:
                return False if args[0].dtype == torch.bool else 0
        if func in (aten._to_copy.default, aten.copy_.default):
            src = args[0] if func is aten._to_copy.default else args[1]
            dst = kwargs.get("device") or _device_of(src) if func is aten._to_copy.default else _device_of(args[0])
            dst = torch.device(dst)
            if _device_of(src).type == "cuda" and dst.type == "cpu":
                self.downloads.append(project_chain())
            elif _device_of(src).type == "cpu" and dst.type == "cuda" and src.numel() > 1:
                self.uploads.append(project_chain())
        return func(*args, **kwargs)

    def clear(self):
        self.reads, self.downloads, self.uploads = [], [], []

    @staticmethod
    def offenders(chains, allowed):
        """The chains that hold none of the allowed names, as 'a > b > c'."""
        return [" > ".join(c) for c in chains if not any(name in c for name in allowed)]

    def check(self, reads=(), downloads=(), uploads=()):
        bad = {"host reads": self.offenders(self.reads, reads),
               "device->host copies": self.offenders(self.downloads, downloads),
               "host->device uploads": self.offenders(self.uploads, uploads)}
        bad = {k: sorted(set(v)) for k, v in bad.items() if v}
        assert not bad, f"device traffic outside the allow-lists: {bad}"


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode + DeviceTraffic (needs the `fake_cuda_guard` fixture); yields the recorder. Real CPU
    tensors made before (a model just built) become fake when an op first meets them."""
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceTraffic() as traffic:
        yield traffic


# tests/helpers.TINY_YAML (conftest's `tiny_yaml`) as a fine-tune with Muon, an EMA and 2 sampling steps
FAKE_CUDA_RECIPE = ["model.mode=finetune", "model.inference.num_inference_timesteps=2", "training.batch_size=2",
                    "training.optimizer=muon_adamw", "training.ema.enabled=true", "training.ema.start_step=1"]


@pytest.fixture(scope="module")
def tiny_cfg(tiny_yaml):
    from recipe.config import load_config

    cfg = load_config(tiny_yaml, FAKE_CUDA_RECIPE)
    build_on_cpu(cfg)  # the tiny frozen parts, written on first use
    return cfg


def build_on_cpu(cfg):
    """(model, encoders with every frozen part) on the CPU, as the trainer and inference build them."""
    from models import build_world_model
    from models.build import ALL_FROZEN_PARTS

    torch.manual_seed(0)
    return build_world_model(cfg, frozen_parts=ALL_FROZEN_PARTS)


class _Processor:
    """The real image processor, fed zero images of the frames' shape (see the module docstring)."""

    def __init__(self, real):
        self.real, self.merge_size = real, real.merge_size

    def __call__(self, images, **kwargs):
        assert all(im.device.type == "cpu" for im in images), "the image processor is handed host frames"
        return self.real(images=[np.zeros(tuple(im.shape), np.float32) for im in images], **kwargs)


def vlm_stand_in(encoders):
    """Replace the VLM's forward (see the module docstring) by a device check of its inputs."""
    vlm = encoders.vlm
    hidden = vlm.config.text_config.hidden_size

    def forward(input_ids, **kwargs):
        off = {k: v.device for k, v in {"input_ids": input_ids, **kwargs}.items()
               if torch.is_tensor(v) and v.device != encoders.device}
        assert not off, f"inputs of the VLM not on {encoders.device}: {off}"
        return types.SimpleNamespace(last_hidden_state=torch.zeros(*input_ids.shape, hidden, device=input_ids.device,
                                                                   dtype=encoders.dtype))

    vlm.model.forward = forward
    encoders.image_processor = _Processor(encoders.image_processor)
    return encoders


def raw_batch(cfg, batch_size=2):
    c, gen = cfg.common, torch.Generator().manual_seed(0)
    chunk = c.video_action_freq_ratio * c.num_video_frames
    return DataBatch(video=torch.rand(batch_size, 1 + c.num_video_frames, 3, c.video_height, c.video_width,
                                      generator=gen) * 2 - 1,
                     state=torch.randn(batch_size, c.state_dim, generator=gen),
                     actions=torch.randn(batch_size, chunk, c.action_dim, generator=gen),
                     instruction=["push the red cube left", "open the drawer"][:batch_size],
                     episode_index=torch.arange(batch_size), frame_index=torch.arange(batch_size) + 3)


class _Accelerator:
    """What Engine asks of accelerate, without a process group: the model is not wrapped, and the backward
    is a gradient of each parameter's shape on its device (see the module docstring)."""
    state = types.SimpleNamespace(deepspeed_plugin=None)
    device = CUDA
    is_main_process = True

    def prepare(self, model, optimizer):
        self.model = model
        return model, optimizer

    def backward(self, loss):
        assert loss.device == CUDA and loss.requires_grad
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    @staticmethod
    def no_sync(model):
        raise AssertionError("one micro-step per update here")


def engine_on_fake_cuda(cfg, model):
    from optim import build_optimizer
    from train.launch import make_engine

    model.to(CUDA)
    optimizer = build_optimizer(model.named_parameters(), cfg.training, 1, cfg.system.speed.fused_adamw)
    return make_engine(_Accelerator(), model, optimizer, cfg)


@contextlib.contextmanager
def training_on_fake_cuda(cfg, model, encoders):
    """Inside fake_cuda(): the engine on the GPU, the encoders moved there and the non-finite guard
    -> (traffic, engine, guard)."""
    from train.guard import NonFiniteGuard

    with fake_cuda() as traffic:
        engine = engine_on_fake_cuda(cfg, model)
        encoders.to(engine.device)
        yield traffic, engine, NonFiniteGuard(types.SimpleNamespace(skipped_nonfinite_steps=0), 3, engine.device)


def train_step(engine, encoders, batch, cfg, step, guard):
    """The body of train/train.py's loop for one update of one micro-batch, and its logging record."""
    from train.record import make_record
    from train.step_inputs import noise_seeds, to_device
    from train.trainer_state import TrainerState

    batch = to_device(batch, engine.device)
    inputs = encoders.encode(batch).replace(noise_seeds=noise_seeds(cfg.training.seed, step, batch))
    out = engine.micro_step(inputs, is_last=True)
    loss_sum = out.logged()
    grad_norm, skipped = engine.optimizer_step(step)
    guard.after_step(step, skipped, loss_sum, grad_norm)
    make_record(step=step, loss_sum=loss_sum, grad_norm=grad_norm, param_groups=engine.param_groups, lrs=[0.0],
                val=None, state=TrainerState(step=step), samples_per_sec=1.0, step_time=1.0, skipped=0)
    return inputs


def assert_on_cuda(tensors, what):
    tensors = tensors if isinstance(tensors, dict) else tensors.tensors()  # a dict or a batch (utils/batch.py)
    off = {k: v.device for k, v in tensors.items() if torch.is_tensor(v) and v.device != CUDA}
    assert not off, f"{what} not on {CUDA}: {off}"


# ---- (a) the training step ---------------------------------------------------------------------------
def test_training_step_from_a_raw_batch_stays_on_the_gpu(tiny_cfg, fake_cuda_guard):
    model, encoders = build_on_cpu(tiny_cfg)
    vlm_stand_in(encoders)
    with training_on_fake_cuda(tiny_cfg, model, encoders) as (traffic, engine, guard):
        for step in (1, 2):
            traffic.clear()
            inputs = train_step(engine, encoders, raw_batch(tiny_cfg), tiny_cfg, step, guard)
            assert_on_cuda(inputs, "the encoded inputs")
            # the second step: every part resident, the instructions' embeddings cached, the constants on the GPU
            uploads = {**TRAIN_UPLOADS, **RAW_UPLOADS, **FIRST_STEP_UPLOADS} if step == 1 else \
                {**TRAIN_UPLOADS, "FrozenEncoders.encode_vlm": RAW_UPLOADS["FrozenEncoders.encode_vlm"]}
            traffic.check(reads=TRAIN_READS, downloads={**TRAIN_DOWNLOADS, **RAW_DOWNLOADS}, uploads=uploads)
        assert traffic.uploads and traffic.reads, "the recorder sees the batch's upload and the designed reads"
    assert_on_cuda(dict(model.named_parameters()), "the parameters")
    assert_on_cuda({f"{i}.{k}": v for i, s in enumerate(engine.base_optimizer.state.values()) for k, v in s.items()
                    if torch.is_tensor(v) and v.dim() > 0}, "the optimizer state")
    assert_on_cuda({str(i): t for i, t in enumerate(engine.ema.shadow)}, "the EMA")
    assert sorted(encoders.resident()) == ["text_encoder", "vae", "vlm"]


def test_training_step_from_a_latent_cache_batch_moves_no_frozen_part(tiny_cfg, fake_cuda_guard):
    """A batch as data/cache.py gives it (latents, text embeddings and VLM features, padded VLM rows) trains
    with no frozen part on the GPU and no upload but the batch's own."""
    from data.stream import collate

    model, encoders = build_on_cpu(tiny_cfg)
    vlm_stand_in(encoders)
    raw = raw_batch(tiny_cfg)
    encoded = encoders.encode(raw)  # on the CPU, for real: the cache's rows
    rows = []
    for b in range(2):
        row = {k: getattr(encoded, k)[b] for k in ("video_latents", "text_embeds", "text_mask", "vlm_features",
                                                   "actions", "state")}
        row["vlm_mask"] = torch.arange(row["vlm_features"].shape[0]) < row["vlm_features"].shape[0] - b
        row["episode_index"], row["frame_index"] = b, 3 + b
        rows.append(row)
    batch = collate(rows)
    with training_on_fake_cuda(tiny_cfg, model, encoders) as (traffic, engine, guard):
        traffic.clear()
        inputs = train_step(engine, encoders, batch, tiny_cfg, 1, guard)
        assert_on_cuda(inputs, "the cached inputs")
        assert inputs.vlm_mask is not None  # padded rows keep their mask
        traffic.check(reads=TRAIN_READS, downloads=TRAIN_DOWNLOADS, uploads=TRAIN_UPLOADS)
    assert encoders.resident() == []


# ---- (b) the served policy, (c) every evaluation mode, (d) the EMA ---------------------------------------
def loaded_on_fake_cuda(cfg, model, encoders):
    """What inference.load.load_checkpoint returns for `--device cuda`, with the tiny model."""
    from data.normalize import NormStats, compute_feature_stats
    from inference.load import Loaded

    rng = np.random.default_rng(0)
    stats = NormStats({"action": compute_feature_stats(rng.normal(size=(32, cfg.common.action_dim))),
                       "observation.state": compute_feature_stats(rng.normal(size=(32, cfg.common.state_dim)))})
    model.to(CUDA).eval()
    encoders.to(CUDA)
    return Loaded(model, encoders, stats, cfg, "fake", CUDA)


class ActionsToHost:
    """Stands in for NormStats.unnormalize_action, the one host step of an inference call: records the chunk it
    is handed (it must be on the host) and answers real zeros, since a fake tensor has no numbers to give."""

    def __init__(self, stats):
        self.stats, self.devices = stats, []

    def __call__(self, actions, state=None):  # state: for relative action dims, which tiny.yaml has none of
        self.devices.append(actions.device)
        with unset_fake_temporarily():
            return torch.zeros(actions.shape)


def observations(policy, count=2):
    rng = np.random.default_rng(1)
    obs = []
    for i in range(count):
        o = {k: rng.integers(0, 255, size=policy.image_shape, dtype=np.uint8) for k in policy.serving.image_keys}
        o[policy.serving.state_key] = rng.normal(size=policy.state_dim).astype(np.float32)
        o[policy.serving.prompt_key] = ["push the red cube left", "open the drawer"][i % 2]
        obs.append(o)
    return obs


def policy_on_fake_cuda(cfg):
    """(model, encoders with the VLM stand-in) on the CPU and the Policy class."""
    from inference.policy import Policy

    model, encoders = build_on_cpu(cfg)
    vlm_stand_in(encoders)
    return model, encoders, Policy


def test_served_policy_runs_on_the_gpu_and_reads_back_once(tiny_cfg, fake_cuda_guard):
    """Policy.infer_checked as inference.serve calls it (a batch of checked observations, in its executor)."""
    model, encoders, Policy = policy_on_fake_cuda(tiny_cfg)
    with fake_cuda() as traffic:
        policy = Policy(loaded_on_fake_cuda(tiny_cfg, model, encoders))
        to_host = ActionsToHost(policy.stats)
        policy.stats.unnormalize_action = to_host
        checked = [policy.check(o) for o in observations(policy)]
        traffic.clear()
        actions = policy.infer_checked(checked)
        traffic.check(downloads={**INFER_DOWNLOADS, **RAW_DOWNLOADS},
                      uploads={**INFER_UPLOADS, **RAW_UPLOADS, **FIRST_STEP_UPLOADS})
        assert traffic.uploads and traffic.downloads
    assert actions.shape == (2, *policy.action_shape) and actions.dtype == np.float32
    assert to_host.devices == [torch.device("cpu")]


def test_a_cpu_tensor_planted_in_the_inference_batch_fails_the_suite(tiny_cfg, fake_cuda_guard, monkeypatch):
    """The checks this suite rests on. A batch that keeps the observation on the host (inference's old bug kept
    its state there): encode uploads it, an upload no allow-listed function makes, and the traffic check fails.
    Host tensors that reach the model itself: the first op that meets the GPU weights raises. One field on the
    host beside the others on the GPU: the batch contract refuses it where the batch is built."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    model, encoders, Policy = policy_on_fake_cuda(tiny_cfg)
    batch, sample = Policy.batch, Policy.sample

    def batch_on_host(self, checked):
        device, self.device = self.device, torch.device("cpu")
        try:
            return batch(self, checked)
        finally:
            self.device = device

    def inputs_on_host(self, inputs, seeds, *args, **kwargs):
        return sample(self, inputs.to("cpu"), seeds, *args, **kwargs)

    with fake_cuda() as traffic:
        policy = Policy(loaded_on_fake_cuda(tiny_cfg, model, encoders))
        policy.stats.unnormalize_action = ActionsToHost(policy.stats)
        checked = [policy.check(o) for o in observations(policy)]
        policy.infer_checked(checked)  # resident parts, cached prompts
        with pytest.raises(BatchError, match=r"DataBatch.state: on cpu, but video is on cuda:0"):
            policy.batch(checked).replace(state=torch.from_numpy(np.stack([s for _, s, _ in checked])))
        monkeypatch.setattr(Policy, "batch", batch_on_host)
        traffic.clear()
        policy.infer_checked(checked)
        with pytest.raises(AssertionError, match=r"host->device uploads.*'Policy.infer_checked > FrozenEncoders.encode > "):
            traffic.check(downloads={**INFER_DOWNLOADS, **RAW_DOWNLOADS}, uploads={**INFER_UPLOADS, **RAW_UPLOADS})
        monkeypatch.setattr(Policy, "batch", batch)
        monkeypatch.setattr(Policy, "sample", inputs_on_host)
        with pytest.raises(FakeTensorDeviceMismatchError):
            policy.infer_checked(checked)


def test_every_evaluation_mode_samples_on_the_gpu(tiny_cfg, fake_cuda_guard):
    """inference.evaluate.run's calls for one batch: encode a collated (host) batch, then sample every mode,
    decoding the video modes' latents; the given actions of inverse_dynamics come from that batch."""
    from models.flow import SAMPLE_MODES, VIDEO_MODES

    model, encoders, Policy = policy_on_fake_cuda(tiny_cfg)
    with fake_cuda() as traffic:
        policy = Policy(loaded_on_fake_cuda(tiny_cfg, model, encoders))
        batch = raw_batch(tiny_cfg)  # as data.stream.collate gives it: on the host
        inputs = policy.encoders.encode(batch)
        assert_on_cuda(inputs, "the evaluation inputs")
        traffic.clear()
        for mode in SAMPLE_MODES:
            out = policy.sample(inputs, [0, 1], mode)
            assert out.actions.device.type == "cpu" and out.video_latents.device == CUDA, mode
            if mode in VIDEO_MODES:
                assert policy.encoders.decode_video(out.video_latents).device == CUDA
        traffic.check(downloads=INFER_DOWNLOADS, uploads=INFER_UPLOADS)
        assert len(traffic.downloads) == len(SAMPLE_MODES)  # one action chunk per mode, nothing else


def test_ema_update_and_swap_stay_on_the_gpu(tiny_cfg, fake_cuda_guard):
    """The EMA's update after a step and its swap into the weights around a validation sample (train/ema.py)."""
    model, encoders = build_on_cpu(tiny_cfg)
    vlm_stand_in(encoders)
    with training_on_fake_cuda(tiny_cfg, model, encoders) as (traffic, engine, guard):
        inputs = train_step(engine, encoders, raw_batch(tiny_cfg), tiny_cfg, 1, guard)
        traffic.clear()
        engine.ema.update(2)
        with engine.ema_swapped_in():
            out = model.sample(inputs, "policy")
        assert out.actions.device == CUDA
        assert engine.ema.updates == 2
        traffic.check()
    assert_on_cuda({str(i): t for i, t in enumerate(engine.ema.shadow)}, "the EMA")
