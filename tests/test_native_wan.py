"""Wan2.2's own files through the config: a native transformer folder, `Wan2.2_VAE.pth` and the umT5
`.pth` + `google/umt5-xxl` tokenizer, written here at tiny dims in Wan's key names (renamed from
tiny diffusers/transformers models by the tables below, which follow Wan's module layout), load
into modules that compute exactly what the source modules compute; bad files fail naming the key."""
import json
import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from models import ModelLoadError, build_world_model  # noqa: E402
from models.loading import load_text_encoder, load_wan_transformer, load_wan_vae  # noqa: E402
from models.sizes import TINY  # noqa: E402
from train.config import load_config  # noqa: E402

YAML = """
common: {action_dim: 4, state_dim: 4, num_video_frames: 4, video_height: 64, video_width: 64,
         global_downsample_rate: 2, video_action_freq_ratio: 2}
model: {size: tiny, und_expert: {vlm: {input_dim: 32}}}
"""

# diffusers / transformers name -> Wan's name (wan/modules/model.py, vae2_2.py, t5.py), applied in order
TRANSFORMER_TO_WAN = (
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"\.attn1\.", ".self_attn."), (r"\.attn2\.", ".cross_attn."),
    (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."), (r"\.to_out\.0\.", ".o."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."), (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),  # the cross-attention norm is Wan's norm3
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"), (r"^proj_out\.", "head.head."),
)
RESIDUAL_TO_WAN = ((r"\.norm1\.", ".residual.0."), (r"\.conv1\.", ".residual.2."), (r"\.norm2\.", ".residual.3."),
                   (r"\.conv2\.", ".residual.6."), (r"\.conv_shortcut\.", ".shortcut."))
VAE_TO_WAN = (
    (r"^(encoder|decoder)\.conv_in\.", r"\1.conv1."),
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.downsamples.\1.downsamples.\2.|"),
    (r"^encoder\.down_blocks\.(\d+)\.downsampler\.", r"encoder.downsamples.\1.downsamples.2."),  # after 2 resnets
    (r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.upsamples.\1.upsamples.\2.|"),
    (r"^decoder\.up_blocks\.(\d+)\.upsampler\.", r"decoder.upsamples.\1.upsamples.3."),  # after 3 resnets
    (r"\.mid_block\.resnets\.0\.", ".middle.0.|"), (r"\.mid_block\.attentions\.0\.", ".middle.1."),
    (r"\.mid_block\.resnets\.1\.", ".middle.2.|"),
    (r"\.norm_out\.", ".head.0."), (r"\.conv_out\.", ".head.2."),
    (r"^quant_conv\.", "conv1."), (r"^post_quant_conv\.", "conv2."),
)
UMT5_TO_WAN = (
    (r"^shared\.weight$", "token_embedding.weight"),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.",
     r"blocks.\1.pos_embedding.embedding."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.", r"blocks.\1.attn."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"blocks.\1.norm1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.", r"blocks.\1.ffn.gate.0."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.", r"blocks.\1.ffn.fc1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.", r"blocks.\1.ffn.fc2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"blocks.\1.norm2."),
    (r"^encoder\.final_layer_norm\.", "norm."),
)


def to_wan(name, table):
    for pattern, repl in table:
        name = re.sub(pattern, repl, name)
    head, _, residual = name.partition("|")  # "|" marks the start of a residual block's own names
    for pattern, repl in RESIDUAL_TO_WAN:
        residual = re.sub(pattern, repl, "." + residual)[1:]
    return head + residual


def native_state(module, table, skip=()):
    return {to_wan(k, table): v.detach().clone() for k, v in module.state_dict().items() if k not in skip}


def perturbed(module, seed):
    """Every tensor distinct from its init (zeros, ones), so a tensor loaded into the wrong slot shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.eval()


def write_native_transformer(folder, wan):
    from safetensors.torch import save_file

    folder.mkdir()
    c = wan.config
    # Wan's WanModel saves this (model_type ti2v); patch size, text width, q/k norm are not saved
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "_diffusers_version": "0.33.0", "model_type": "ti2v", "text_len": TINY.text_len,
        "dim": c.num_attention_heads * c.attention_head_dim, "num_heads": c.num_attention_heads,
        "num_layers": c.num_layers, "ffn_dim": c.ffn_dim, "freq_dim": c.freq_dim, "in_dim": c.in_channels,
        "out_dim": c.out_channels, "eps": c.eps}))
    state = native_state(wan, TRANSFORMER_TO_WAN)
    names = sorted(state)  # two shards + index, as Wan2.2-TI2V-5B ships them
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fname))
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def sources():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from models.tiny_assets import build_tokenizer

    torch.manual_seed(0)
    return {"wan": perturbed(WanTransformer3DModel(**TINY.wan), 1), "vae": perturbed(AutoencoderKLWan(**TINY.vae), 2),
            "umt5": perturbed(UMT5EncoderModel(UMT5Config(**TINY.text_encoder)), 3), "tokenizer": build_tokenizer()}


@pytest.fixture(scope="module")
def native(sources, tmp_path_factory):
    """A tiny Wan2.2-TI2V-5B folder: transformer shards + config.json, Wan2.2_VAE.pth, umT5 .pth, tokenizer."""
    root = write_native_transformer(tmp_path_factory.mktemp("native") / "Wan2.2-TI2V-5B", sources["wan"])
    torch.save(native_state(sources["vae"], VAE_TO_WAN), root / "Wan2.2_VAE.pth")
    torch.save(native_state(sources["umt5"], UMT5_TO_WAN, skip={"encoder.embed_tokens.weight"}),
               root / "models_t5_umt5-xxl-enc-bf16.pth")
    sources["tokenizer"].save_pretrained(root / "google" / "umt5-xxl")
    yaml = root.parent / "native.yaml"
    yaml.write_text(YAML)
    return root, str(yaml)


def overrides(root):
    return [f"model.wan.checkpoint_path={root}", f"model.wan.vae_path={root}/Wan2.2_VAE.pth",
            f"model.wan.text_encoder_path={root}/models_t5_umt5-xxl-enc-bf16.pth"]


def test_native_files_load_through_the_config_and_compute_what_the_sources_compute(sources, native):
    root, yaml = native
    model, encoders = build_world_model(load_config(yaml, overrides(root)))
    wan, vae, umt5 = sources["wan"], sources["vae"], sources["umt5"]
    for source, loaded in ((wan, model.video), (vae, encoders.vae), (umt5, encoders.text_encoder)):
        want, have = source.state_dict(), loaded.state_dict()
        assert sorted(want) == sorted(have)
        assert all(torch.equal(want[k], have[k]) for k in want), type(source).__name__
    assert model.video.config.text_dim == TINY.wan["text_dim"] and list(model.video.config.patch_size) == [1, 2, 2]
    assert list(encoders.vae.config.latents_std) == TINY.vae["latents_std"]  # the .pth has none: size table's

    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 8, 2, 8, 8, generator=gen), torch.randn(1, TINY.text_len, 32, generator=gen)
    video = torch.rand(1, 3, 5, 64, 64, generator=gen) * 2 - 1
    ids = sources["tokenizer"](["push the red cube left"], padding="max_length", max_length=TINY.text_len,
                               return_tensors="pt")
    with torch.no_grad():
        forward = [m(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text).sample
                   for m in (wan, model.video)]
        encoded = [m.encode(video).latent_dist.mean for m in (vae, encoders.vae)]
        decoded = [m.decode(encoded[0]).sample for m in (vae, encoders.vae)]
        embeds = [m(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).last_hidden_state
                  for m in (umt5, encoders.text_encoder)]
    for name, (want, have) in {"transformer": forward, "vae encode": encoded, "vae decode": decoded,
                               "umt5": embeds}.items():
        assert torch.equal(want, have), (name, float((want - have).abs().max()))
    # the tokenizer came from google/umt5-xxl/ beside the .pth
    assert encoders.tokenizer("open the drawer")["input_ids"] == sources["tokenizer"]("open the drawer")["input_ids"]


def test_a_diffusers_folder_still_loads_as_before(sources, tmp_path):
    sources["wan"].save_pretrained(tmp_path / "transformer")
    loaded = load_wan_transformer(str(tmp_path / "transformer"), TINY, "model.wan.checkpoint_path")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in sources["wan"].state_dict().items())


def test_missing_files_are_errors_naming_key_and_path(native, tmp_path):
    root, yaml = native
    nowhere = tmp_path / "Wan2.2_VAE.pth"
    with pytest.raises(ModelLoadError, match=f"model.wan.vae_path: '{nowhere}' does not exist"):
        build_world_model(load_config(yaml, [f"model.wan.vae_path={nowhere}"]))
    # a shard the index lists is gone
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "diffusion_pytorch_model.safetensors.index.json",
                 "diffusion_pytorch_model-00001-of-00002.safetensors"):
        os.link(root / name, broken / name)
    with pytest.raises(ModelLoadError, match=r"model.wan.checkpoint_path: .* lists shards that are not in .*"
                                             r"diffusion_pytorch_model-00002-of-00002.safetensors"):
        load_wan_transformer(str(broken), TINY, "model.wan.checkpoint_path")
    os.remove(broken / "diffusion_pytorch_model.safetensors.index.json")  # now one shard alone: keys missing
    with pytest.raises(ModelLoadError, match=r"does not fit the WanTransformer3DModel .*missing \["):
        load_wan_transformer(str(broken), TINY, "model.wan.checkpoint_path")
    # the umT5 .pth without the tokenizer folder Wan2.2-TI2V-5B keeps beside it
    alone = tmp_path / "alone"
    alone.mkdir()
    os.link(root / "models_t5_umt5-xxl-enc-bf16.pth", alone / "t5.pth")
    with pytest.raises(ModelLoadError, match=f"tokenizer is expected in '{alone}/google/umt5-xxl'"):
        load_text_encoder(str(alone / "t5.pth"), TINY, "model.wan.text_encoder_path", torch.float32)


def test_files_that_disagree_with_the_config_are_errors_naming_the_tensor(sources, native, tmp_path):
    root, _ = native
    # Wan's config.json says 128 wide where the weights are 64 wide; then one layer more than they have
    folder = tmp_path / "wan"
    folder.mkdir()
    for name in os.listdir(root):
        if name.startswith("diffusion_pytorch_model"):
            os.link(root / name, folder / name)
    config = json.loads((root / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, dim=128)))
    with pytest.raises(ModelLoadError, match=r"shape mismatch \['blocks.0.attn1.norm_k.weight: file \(64,\) vs "
                                             r"model \(128,\)'"):
        load_wan_transformer(str(folder), TINY, "model.wan.checkpoint_path")
    (folder / "config.json").write_text(json.dumps(dict(config, num_layers=3)))
    with pytest.raises(ModelLoadError, match=r"missing \['blocks.2."):
        load_wan_transformer(str(folder), TINY, "model.wan.checkpoint_path")
    # a VAE of another latent width than the size table's (z_dim 8 for tiny)
    from diffusers import AutoencoderKLWan

    other = AutoencoderKLWan(**dict(TINY.vae, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4))
    torch.save(native_state(other, VAE_TO_WAN), tmp_path / "vae.pth")
    with pytest.raises(ModelLoadError, match=r"model.wan.vae_path: .*vae.pth' does not fit the AutoencoderKLWan of "
                                             r"model.size's entry .*shape mismatch \['decoder.conv_in.weight: file "
                                             r"\(16, 4, 3, 3, 3\) vs model \(16, 8, 3, 3, 3\)'"):
        load_wan_vae(str(tmp_path / "vae.pth"), TINY, "model.wan.vae_path", torch.float32)
    # a umT5 .pth lacking a tensor, and a .pth that is not a state dict
    state = torch.load(root / "models_t5_umt5-xxl-enc-bf16.pth")
    del state["norm.weight"]
    os.makedirs(tmp_path / "google" / "umt5-xxl")
    torch.save(state, tmp_path / "t5.pth")
    with pytest.raises(ModelLoadError, match=r"missing \['encoder.final_layer_norm.weight'\]"):
        load_text_encoder(str(tmp_path / "t5.pth"), TINY, "model.wan.text_encoder_path", torch.float32)
    torch.save([1, 2], tmp_path / "t5.pth")
    with pytest.raises(ModelLoadError, match=r"t5.pth. does not hold a plain state dict of tensors"):
        load_text_encoder(str(tmp_path / "t5.pth"), TINY, "model.wan.text_encoder_path", torch.float32)


def test_geometry_and_widths_are_checked_before_any_weight_is_read(native, tmp_path):
    """Wrong frame counts or mismatched parts fail on the config files, not after loading 5B weights:
    a transformer whose weight file is not even readable still gets the geometry error."""
    root, yaml = native
    unreadable = tmp_path / "wan"
    unreadable.mkdir()
    os.link(root / "config.json", unreadable / "config.json")
    (unreadable / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    paths = [f"model.wan.checkpoint_path={unreadable}"] + overrides(root)[1:]
    with pytest.raises(ValueError, match="common.num_video_frames is 3; the VAE needs a multiple of 4"):
        build_world_model(load_config(yaml, paths + ["common.num_video_frames=3"]))
    with pytest.raises(ModelLoadError, match="model.und_expert.vlm.input_dim is 16 but the VLM's hidden size is 32"):
        build_world_model(load_config(yaml, paths + ["model.und_expert.vlm.input_dim=16"]))
    with pytest.raises(ModelLoadError, match=r"model.wan.checkpoint_path: could not read '.*wan/diffusion_pytorch_"
                                             r"model.safetensors' as safetensors"):
        build_world_model(load_config(yaml, paths))  # with the checks passing, the file is read and fails
