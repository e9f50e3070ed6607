"""The batch contract (utils/batch.py): a malformed batch is refused where it is built or where the model
takes it, with the field, the expected and the actual shape or dtype; the checks read no value; the
contract's fields are exactly what the model reads."""
import dataclasses
import os
import sys

import pytest
import torch

from data.stream import collate
from models.config import ModelConfig
from utils.batch import SHAPES, BatchError, DataBatch, ModelBatch

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(tmp_path, mode="finetune"):
    from tests.helpers import config_from

    return config_from(tmp_path, {
        "common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 4, "video_height": 64, "video_width": 64,
                   "global_downsample_rate": 2, "video_action_freq_ratio": 2},
        "model": {"size": "tiny", "mode": mode, "wan": {"vae_path": None, "text_encoder_path": None},
                  "vlm": {"checkpoint_path": None}, "und_expert": {"vlm": {"input_dim": 32}}}})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny world model with one layer, random init (no frozen part: batches are built here)."""
    from models.build import size_table_model

    torch.manual_seed(0)
    return size_table_model(tiny_config(tmp_path_factory.mktemp("batch")), num_layers=1)


def test_the_model_mode_alone_says_whether_the_model_reads_a_state(tmp_path):
    """ModelConfig.reads_state is the one rule: the sizes a batch is held to and the action expert's
    tokens follow it."""
    from models.build import size_table_model

    assert ModelConfig(mode="finetune").reads_state and not ModelConfig(mode="pretrain").reads_state
    for mode, state_dim, tokens in (("finetune", 4, 1 + 8 + 4), ("pretrain", None, 8)):
        (tmp_path / mode).mkdir()
        with torch.device("meta"):
            model = size_table_model(tiny_config(tmp_path / mode, mode), num_layers=1)
        assert model.settings.reads_state == (mode == "finetune")
        assert model.dims.state_dim == state_dim
        assert model.action_expert.positions.shape[1] == tokens  # [state | chunk of 8 | 4 registers], or the chunk
        assert (model.action_expert.state_encoder is None) == (state_dim is None)


def batch_for(model, b=2, device="cpu", **changes):
    """A well-formed training batch at the model's sizes (every optional field given)."""
    d, g = model.dims, torch.Generator().manual_seed(0)
    fields = dict(
        video_latents=torch.randn(b, d.latent_channels, d.latent_frames, 8, 8, generator=g),
        text_embeds=torch.randn(b, 16, d.text_dim, generator=g), text_mask=torch.ones(b, 16, dtype=torch.bool),
        vlm_features=torch.randn(b, 6, d.vlm_dim, generator=g), vlm_mask=torch.arange(6).expand(b, 6) < 5,
        state=torch.randn(b, d.state_dim, generator=g), actions=torch.randn(b, d.action_chunk, d.action_dim, generator=g),
        noise_seeds=torch.arange(b) + 7)
    return ModelBatch(**{k: v.to(device) for k, v in fields.items()}).replace(**changes)


def test_the_model_refuses_a_batch_of_other_sizes_naming_the_field(model):
    good = batch_for(model)
    assert model(good).loss.dim() == 0
    with pytest.raises(BatchError, match=r"^ModelBatch\.state: expected shape \[B=2, S=4\] \(B from video_latents; "
                                         r"S from the model\), got \[2, 5\]$"):
        model(good.replace(state=torch.zeros(2, 5)))
    with pytest.raises(BatchError, match=r"^ModelBatch\.actions: expected shape \[B=2, chunk=8, A=4\] .*got \[2, 6, 4\]"):
        model(good.replace(actions=torch.zeros(2, 6, 4)))
    with pytest.raises(BatchError, match=r"^ModelBatch\.video_latents: expected shape \[B, z=8, T=2, h, w\] "
                                         r"\(z, T from the model\), got \[2, 8, 1, 8, 8\]$"):
        model(good.replace(video_latents=good.video_latents[:, :, :1]))  # training needs the whole clip...
    policy = model.sample(good.replace(video_latents=good.video_latents[:, :, :1], actions=None), "policy", 1)
    assert policy.actions.shape == (2, 8, 4)  # ...sampling a policy needs the condition frame only
    with pytest.raises(BatchError, match=r"ModelBatch\.state: the model \(model.mode finetune\) reads a state "
                                         r"\[B, S=4\]; the batch has none"):
        model(good.replace(state=None))
    with pytest.raises(BatchError, match=r"ModelBatch\.actions: a training forward needs the action chunk"):
        model(good.replace(actions=None))


def test_mismatched_batch_sizes_are_refused_where_the_batch_is_built(model):
    good = batch_for(model)
    with pytest.raises(BatchError, match=r"^ModelBatch\.text_embeds: expected shape \[B=2, Lt, Dt\] "
                                         r"\(B from video_latents\), got \[3, 16, 32\]$"):
        good.replace(text_embeds=torch.zeros(3, 16, 32))
    with pytest.raises(BatchError, match=r"^ModelBatch\.text_mask: expected shape \[B=2, Lt=16\] "
                                         r"\(B from video_latents; Lt from text_embeds\), got \[2, 12\]$"):
        good.replace(text_mask=torch.ones(2, 12, dtype=torch.bool))
    with pytest.raises(BatchError, match=r"^ModelBatch\.noise_seeds: expected shape \[B=2\] .*got \[1\]$"):
        good.replace(noise_seeds=torch.tensor([1]))
    frames = torch.zeros(2, 5, 3, 64, 64)
    with pytest.raises(BatchError, match=r"^DataBatch\.instruction: expected a list of B=2 strings, got a list of 3$"):
        DataBatch(video=frames, instruction=["a", "b", "c"])
    with pytest.raises(BatchError, match=r"^DataBatch\.video: expected shape \[B, F, 3, H, W\], got \[2, 5, 64, 64\]$"):
        DataBatch(video=frames[:, :, 0], instruction=["a", "b"])
    with pytest.raises(BatchError, match=r"^DataBatch\.actions: expected shape \[B=2, chunk, A\] \(B from video\), "
                                         r"got \[1, 8, 4\]$"):
        DataBatch(video=frames, instruction=["a", "b"], actions=torch.zeros(1, 8, 4))


def test_a_wrong_dtype_or_a_second_device_is_refused(model):
    good = batch_for(model)
    with pytest.raises(BatchError, match=r"^ModelBatch\.actions: expected dtype torch\.float32, got torch\.float64$"):
        good.replace(actions=good.actions.double())
    with pytest.raises(BatchError, match=r"^ModelBatch\.text_mask: expected dtype torch\.bool, got torch\.int64$"):
        good.replace(text_mask=good.text_mask.long())
    with pytest.raises(BatchError, match=r"^ModelBatch\.noise_seeds: expected dtype torch\.int64, got torch\.int32$"):
        good.replace(noise_seeds=good.noise_seeds.int())
    with pytest.raises(BatchError, match=r"^DataBatch\.video: expected dtype torch\.float32, got torch\.uint8$"):
        DataBatch(video=torch.zeros(2, 5, 3, 64, 64, dtype=torch.uint8), instruction=["a", "b"])
    with pytest.raises(BatchError, match=r"^ModelBatch\.state: on meta, but video_latents is on cpu; a batch lives "
                                         r"on one device"):
        good.replace(state=good.state.to("meta"))


def test_a_data_batch_says_what_it_lacks_and_collate_names_an_unknown_key():
    frames = torch.zeros(2, 5, 3, 64, 64)
    with pytest.raises(BatchError, match="neither video .* nor video_latents"):
        DataBatch(instruction=["a", "b"])
    with pytest.raises(BatchError, match="neither instruction nor text_embeds"):
        DataBatch(video=frames)
    with pytest.raises(BatchError, match="text_embeds and text_mask come together; it has only text_embeds"):
        DataBatch(video=frames, text_embeds=torch.zeros(2, 16, 32))
    sample = {"video": frames[0], "instruction": "a", "episode_index": 3, "frame_index": 0}
    batch = collate([sample, dict(sample, frame_index=2)])
    assert batch.frame_index.tolist() == [0, 2] and batch.episode_index.dtype == torch.int64
    assert batch.instruction == ["a", "a"] and batch.video.shape == (2, 5, 3, 64, 64)
    with pytest.raises(BatchError, match=r"^DataBatch has no field colour; its fields are video, instruction, "):
        collate([dict(sample, colour=1)])


def test_the_checks_read_no_value(model):
    """Every tensor on `meta` (shapes and dtypes, no storage: reading a value raises): building both batches,
    moving them and checking against the model's sizes go through."""
    batch = batch_for(model, device="meta")
    batch.check(model.dims, training=True)
    data = DataBatch(video=torch.zeros(2, 5, 3, 64, 64, device="meta"), instruction=["a", "b"],
                     actions=batch.actions, state=batch.state, episode_index=torch.zeros(2, dtype=torch.long,
                                                                                       device="meta"),
                     frame_index=torch.zeros(2, dtype=torch.long, device="meta"))
    assert data.to("meta").replace(state=None).state is None
    with pytest.raises(BatchError):  # and a check fails on meta as it does on real tensors
        batch.replace(state=torch.zeros(2, 5, device="meta")).check(model.dims, training=True)


def test_the_contract_is_what_the_model_reads(model, monkeypatch):
    """The model's reads of a batch's fields (outside the contract's own checks) during a training forward
    are every field of ModelBatch, and a sampling call reads no field outside it; every field of both
    types has its shape and dtype stated in SHAPES."""
    fields = {f.name for f in dataclasses.fields(ModelBatch)}
    reads = set()
    contract = os.path.abspath(sys.modules[ModelBatch.__module__].__file__)
    plain = ModelBatch.__getattribute__

    def recording(self, name):
        if name in fields and os.path.abspath(sys._getframe(1).f_code.co_filename) != contract:
            reads.add(name)
        return plain(self, name)

    batch = batch_for(model)  # built before recording: building reads every field
    monkeypatch.setattr(ModelBatch, "__getattribute__", recording)
    model(batch).loss.backward()
    assert reads == fields
    reads.clear()
    for mode in ("policy", "forward_dynamics"):
        model.sample(batch, mode, 1)
    assert reads == fields - {"noise_seeds"}  # sampling draws its own noise
    data_fields = {f.name for f in dataclasses.fields(DataBatch)}
    assert set(SHAPES) == (fields | data_fields) - {"instruction"}
