import pytest

from train.config import load_config
from utils.config import ConfigError

CONFIGS = ["configs/tiny.yaml", "configs/robotwin.yaml", "configs/latent_action.yaml", "configs/lerobot.yaml",
           "configs/motus_finetune_lerobot.yaml"]


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.common.action_chunk_size == cfg.common.num_video_frames * cfg.common.video_action_freq_ratio


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_names_file_key_and_closest(tmp_path):
    path = write(tmp_path, "training:\n  batch_sise: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert path in str(e.value) and "training.batch_sise" in str(e.value)
    assert "Did you mean 'training.batch_size'" in str(e.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainig'.*'training'"):
        load_config(write(tmp_path, "trainig:\n  max_steps: 3\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match="training.max_steps"):
        load_config(write(tmp_path, "training:\n  max_steps: many\n"))


def test_overrides_apply_and_are_typed(tmp_path):
    cfg = load_config(write(tmp_path, "training:\n  max_steps: 5\n"), ["training.max_steps=7", "common.num_video_frames=2"])
    assert cfg.training.max_steps == 7 and cfg.common.action_chunk_size == 2 * cfg.common.video_action_freq_ratio


@pytest.mark.parametrize("override,match", [
    ("training.max_step=3", "Did you mean 'training.max_steps'"),
    ("training.max_steps=abc", "training.max_steps"),
    ("max_steps", "not of the form key=value"),
    ("training.optimizer=sgd", "expected one of adamw, muon_adamw"),
    ("common.action_chunk_size=4", "derived"),
    ("training.batch_size=0", "positive"),
])
def test_bad_overrides(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, "{}\n"), [override])


def test_resume_and_finetune_exclusive(tmp_path):
    with pytest.raises(ConfigError, match="pick one"):
        load_config(write(tmp_path, "resume:\n  checkpoint_path: auto\nfinetune:\n  checkpoint_path: x\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "training: [\n"))


def test_every_schema_key_is_read_by_code():
    """A key that no code reads is a dead key: search the sources for each leaf name."""
    import glob
    from omegaconf import OmegaConf
    from train.config import Config
    from utils.config import all_keys as _all_keys
    sources = "".join(open(p).read() for pattern in ("train/*.py", "utils/*.py", "data/*.py", "models/*.py",
                                                     "optim/*.py") for p in glob.glob(pattern)
                      if not p.endswith("config.py"))
    schema = OmegaConf.structured(Config)
    dead = []
    for key in _all_keys(schema):
        node = OmegaConf.select(schema, key)
        if OmegaConf.is_dict(node):
            continue
        leaf = key.rsplit(".", 1)[-1]
        if f".{leaf}" not in sources and f'"{leaf}"' not in sources and f"'{leaf}'" not in sources:
            dead.append(key)
    assert not dead, f"config keys no code reads: {dead}"
