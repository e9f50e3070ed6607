"""The memory model of `python -m models.memory_model`: its activation term against a real CPU forward,
and the frozen parts it counts against what the data provides."""
import pytest

from tests.helpers import config_from
from models.memory_model import budget, calibration, count_components, host_ram

# The trace counts the same tensors autograd keeps; what may differ is the attention kernel's
# layout (fused kernels keep q, k, v, out, log-sum-exp) and the storage sharing of views.
TOLERANCE = 0.02


@pytest.mark.parametrize("overrides", [
    {"model": {"size": "tiny", "precision": "fp32"}},
    {"model": {"size": "tiny", "precision": "bf16_mixed", "mode": "pretrain"}},
], ids=["fp32", "bf16_mixed-pretrain"])
def test_traced_activations_match_a_cpu_measurement(tmp_path, overrides):
    """Traced on fake tensors from 2 and 3 layers and extrapolated to 5, against the saved-tensor bytes
    (plus checkpointed block inputs) of one real forward of a 5-layer tiny model, both settings."""
    cfg = config_from(tmp_path, {"common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 8,
                                            "video_height": 64, "video_width": 64}, **overrides})
    result = calibration(cfg, num_layers=5)
    for setting in ("no_checkpointing", "checkpointing"):
        r = result[setting]
        assert r["traced_bytes"] == pytest.approx(r["measured_bytes"], rel=TOLERANCE), (setting, r)
    # checkpointing keeps far less: block inputs instead of every block's saved tensors
    assert result["checkpointing"]["measured_bytes"] < 0.3 * result["no_checkpointing"]["measured_bytes"]


def test_a_latent_cache_keeps_the_frozen_parts_off_the_gpu(tmp_path):
    sections = {"common": {"action_dim": 14, "state_dim": 14, "num_video_frames": 8},
                "model": {"size": "motus", "precision": "bf16_mixed"}, "training": {"batch_size": 2}}
    cfg = config_from(tmp_path, sections)
    counts, model, size = count_components(cfg)
    online = budget(cfg, counts, model, size, gpus=8, gpu_memory=80.0)
    assert online["frozen_on_gpu"] == ["vae", "text_encoder", "vlm"]
    frozen = counts["vae"] + counts["text_encoder"] + counts["vlm"]  # 8.5B parameters in bf16
    assert online["zero2"]["frozen_weights"] == pytest.approx(frozen * 2 / 1024 ** 3, abs=0.01)
    assert online["zero2"]["frozen_weights"] == pytest.approx(15.86, abs=0.01)
    cached = budget(config_from(tmp_path, {**sections, "dataset": {"cache_dir": str(tmp_path)}}),
                    counts, model, size, gpus=8, gpu_memory=80.0)
    assert cached["frozen_on_gpu"] == [] and cached["zero2"]["frozen_weights"] == 0
    # the umT5 embedding cache (model.wan.text_cache_mb, 256 MiB) sits on the GPU with the text encoder
    assert online["zero2"]["text_cache"] == 0.25 and cached["zero2"]["text_cache"] == 0
    assert cached["zero2"]["static_total"] == pytest.approx(online["zero2"]["static_total"] - 15.86 - 0.25, abs=0.02)
    for setting in ("no_checkpointing", "checkpointing"):
        assert cached["zero2"][f"largest_batch_{setting}"] > online["zero2"][f"largest_batch_{setting}"]


def test_host_ram_of_the_frozen_parts_with_and_without_a_cache(tmp_path):
    """Per process, parameters x bytes of the compute dtype: umT5-XXL + Qwen3-VL + the Wan2.2 VAE
    without a cache, the VAE alone with one (models/build.py builds only that)."""
    sections = {"common": {"action_dim": 14, "state_dim": 14, "num_video_frames": 8},
                "model": {"size": "motus", "precision": "bf16_mixed"}}
    counts, _, _ = count_components(config_from(tmp_path, sections))
    vae = counts["vae"] * 2 / 1024 ** 3
    assert vae == pytest.approx(1.31, abs=0.01)
    online = host_ram(config_from(tmp_path, sections), counts)
    assert online == {"frozen_parts_built": ["vae", "text_encoder", "vlm"], "this_run": 15.86,
                      "without_cache": 15.86, "with_cache": round(vae, 2)}
    cached = host_ram(config_from(tmp_path, {**sections, "dataset": {"cache_dir": str(tmp_path)}}), counts)
    assert cached == {**online, "frozen_parts_built": ["vae"], "this_run": round(vae, 2)}
    fp32 = host_ram(config_from(tmp_path, {**sections, "model": {"size": "motus", "precision": "fp32"}}), counts)
    assert fp32["without_cache"] == pytest.approx(2 * 15.86, abs=0.01)
