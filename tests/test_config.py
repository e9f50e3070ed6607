import os
import re

import pytest

from recipe.config import load_config
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


def test_resume_and_finetune_together(tmp_path):
    """The requeue-safe fine-tune recipe: start from finetune weights, continue from the run's own
    checkpoint once it has one (tests/test_resume_edits.py runs it)."""
    cfg = load_config(write(tmp_path, "resume:\n  checkpoint_path: auto\nfinetune:\n  checkpoint_path: x\n"))
    assert cfg.resume.checkpoint_path == "auto" and cfg.finetune.checkpoint_path == "x"


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "training: [\n"))


# Keys the tiny recipe's runs below cannot read, and the setting under which code reads them.
CONDITIONAL = {
    "dataset.data_mode": "dataset.type robotwin",
    "dataset.task_mode": "dataset.type robotwin",
    "dataset.task_name": "dataset.type robotwin with task_mode single",
    "dataset.cache_stride": "python -m data.build_cache",
    "training.global_batch_size": "a guard: check_launch compares it with the launch's batch",
    "finetune.allow_shape_mismatch": "finetune.checkpoint_path set",
    "system.speed.cuda_graphs_token_multiple": "system.speed.cuda_graphs on (a GPU switch)",
}
# Sections that training never reads, and the command that does.
CONDITIONAL_SECTIONS = {"serving.": "python -m inference.serve (tests/test_serve.py)",
                        "evaluation.": "evaluation.task set (tests/test_train_evaluation.py)"}


def test_every_schema_key_is_read_by_code(tmp_path):
    """Run the tiny recipe (fresh, then resumed) with every config read recorded; a schema key that
    neither run reads and that CONDITIONAL does not explain is a dead key."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf
    from tests.helpers import ROOT, prepare_generated
    from recipe.schema import Config
    from utils.config import all_keys

    prepare_generated("configs/tiny.yaml")  # the VAE fit, on a loaded machine, outside the runs' timeout

    runs = [["training.max_steps=2", "system.save_interval=1", "system.val_interval=1", "system.val_batches=1",
             "training.scheduler_type=cosine", "logging.report_to=all", "logging.wandb_mode=offline",
             "training.ema.enabled=true", "training.ema.start_step=1"],
            ["training.max_steps=3", "resume.checkpoint_path=auto", "resume.reset_scheduler=true",
             "logging.report_to=none"]]
    read = set()
    for i, overrides in enumerate(runs):
        out = tmp_path / f"reads{i}.json"
        args = [sys.executable, os.path.join(ROOT, "tests", "config_reads.py"), str(out), "--config",
                "configs/tiny.yaml", "--checkpoint_dir", str(tmp_path), "--run_name", "reads",
                "system.num_workers=0", *overrides]
        result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        read |= set(json.loads(out.read_text()))
    schema = OmegaConf.structured(Config)
    leaves = [k for k in all_keys(schema) if not OmegaConf.is_dict(OmegaConf.select(schema, k))]
    assert set(CONDITIONAL) <= set(leaves), f"CONDITIONAL names keys the schema lacks: {set(CONDITIONAL) - set(leaves)}"
    dead = [k for k in leaves if k not in read and k not in CONDITIONAL
            and not any(k.startswith(section) for section in CONDITIONAL_SECTIONS)]
    assert not dead, f"config keys no code reads: {dead}"


@pytest.mark.parametrize("override, message", [
    ("training.learning_rate=-1", "'training.learning_rate' is -1.0; expected a positive number"),
    ("training.warmup_steps=300", "'training.warmup_steps' is 300; expected smaller than training.cycle_length"),
    ("training.betas=[0.9,1.5]", "'training.betas' is [0.9, 1.5]; expected two numbers in [0, 1)"),
    ("model.time_distribution.max_t=1.5", "expected 0 <= min_t <= max_t <= 1"),
    ("model.time_distribution.action_shift=0", "'model.time_distribution.action_shift' is 0.0; expected null (the "
     "shared shift) or a positive number"),
    ("model.time_distribution.marginal_video_fraction=1.5",
     "'model.time_distribution.marginal_video_fraction' is 1.5; expected a number in [0, 1]"),
    ("model.tiny_vae_fit.videos=0", "'model.tiny_vae_fit' is {'frame_steps': 150, 'clip_steps': 120, 'videos': 0, "
     "'min_colour_shown': 0.0, 'max_rounds': 1}; expected steps >= 0 and videos >= 1"),
    ("model.tiny_vae_fit.min_colour_shown=1.5", "'model.tiny_vae_fit.min_colour_shown/max_rounds' is [1.5, 1]; "
     "expected a share in [0, 1] and at least 1 round"),
    ("dataset.weights=[1,2]", "'dataset.weights' is [1.0, 2.0]; expected one non-negative number per dataset_dir"),
    ("system.total_limit=0", "expected null (keep all) or a positive integer"),
    ("system.hang_timeout_minutes=0", "'system.hang_timeout_minutes' is 0.0; expected null (never) or a positive number"),
    ("training.ema.decay=1.0", "'training.ema.decay' is 1.0; expected a number in [0, 1)"),
    ("training.ema.update_every=0", "'training.ema.update_every' is 0; expected a positive integer"),
    ("training.ema.start_step=-1", "'training.ema.start_step' is -1; expected an integer >= 0"),
    ("dataset.relative_action_dims=[1,1]", "'dataset.relative_action_dims' is [1, 1]; expected distinct indices in [0, "),
    ("dataset.relative_action_dims=[-1]", "'dataset.relative_action_dims' is [-1]; expected distinct indices in [0, "),
    ("dataset.relative_action_horizon=8", "'dataset.relative_action_horizon' is 8; expected null without "
     "dataset.relative_action_dims"),
])
def test_cross_field_rules_fail_at_load(override, message):
    """Every rule between fields runs at load, before anything is built, with the same message style."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", [override])


def test_relative_actions_need_a_model_that_reads_the_state():
    with pytest.raises(ConfigError, match=re.escape("'dataset.relative_action_dims' is [0]; expected null with "
                                                    "model.mode pretrain")):
        load_config("configs/tiny.yaml", ["dataset.relative_action_dims=[0]", "model.mode=pretrain"])
    with pytest.raises(ConfigError, match=re.escape("'dataset.relative_action_horizon' is 0; expected a positive")):
        load_config("configs/tiny.yaml", ["dataset.relative_action_dims=[0]", "dataset.relative_action_horizon=0"])


def test_overrides_on_both_sides_of_a_flag():
    from train.train import parse_args

    args = parse_args(["--config", "configs/tiny.yaml", "training.max_steps=5", "--run_name", "x",
                       "training.batch_size=2"])
    assert args.overrides[:2] == ["training.max_steps=5", "training.batch_size=2"]
    assert load_config(args.config, args.overrides).logging.run_name == "x"


@pytest.mark.parametrize("text", ["off", "no", "yes", "true", "1e3", "007", "null", "it's", "a=b", "[x"])
def test_flag_values_arrive_verbatim(text):
    """YAML would read `off` as False and `1e3` as 1000.0: the run folder would be runs/tiny/False."""
    from train.train import parse_args

    args = parse_args(["--run_name", text, "--checkpoint_dir", text])
    cfg = load_config(args.config, args.overrides)
    assert cfg.logging.run_name == text and cfg.system.checkpoint_dir == text


@pytest.mark.parametrize("text,value", [("off", "off"), ("on", "on"), ("1e3", "1e3"), ("007", "007"), ("[x", "[x"),
                                        ("'null'", "null"), ("'it''s'", "it's"), ("null", None), ("~", None), ("", None)])
def test_overrides_of_text_keys_keep_the_text(text, value):
    """A str or Optional[str] key gets the text as typed; a null spelling still means None; quotes
    give the literal text; the keys of other types still read YAML (0 for an int, off for a bool)."""
    cfg = load_config("configs/tiny.yaml", [f"logging.run_name={text}", f"logging.wandb_project={text}",
                                            "training.max_steps=0x10", "system.speed.tf32=off"])
    assert cfg.logging.run_name == value and cfg.logging.wandb_project == value
    assert cfg.training.max_steps == 16 and cfg.system.speed.tf32 is False


def test_a_yaml_boolean_for_a_text_key_is_refused_naming_the_key(tmp_path):
    """`run_name: off` in a file is YAML's false: refused with the file, the key and the fix; quoted, it
    is the text; a boolean key still reads off as false."""
    path = tmp_path / "run.yaml"
    path.write_text("logging:\n  run_name: off\nsystem:\n  speed:\n    tf32: off\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: 'logging.run_name' is text but YAML reads its "
                                                    "value as the boolean False")):
        load_config(str(path))
    path.write_text("logging:\n  run_name: 'off'\nsystem:\n  speed:\n    tf32: off\n")
    cfg = load_config(str(path))
    assert cfg.logging.run_name == "off" and cfg.system.speed.tf32 is False


def test_null_for_a_required_text_key_is_refused():
    with pytest.raises(ConfigError, match="system.checkpoint_dir"):
        load_config("configs/tiny.yaml", ["system.checkpoint_dir=null"])


def test_resuming_another_schedule_kind_is_refused():
    from recipe.schema import TrainingConfig
    from utils.schedule import LRSchedule

    saved = LRSchedule(TrainingConfig(scheduler_type="linear")).state_dict()
    cosine = LRSchedule(TrainingConfig(scheduler_type="cosine"))
    with pytest.raises(ValueError, match="scheduler_type linear, this run's is cosine"):
        cosine.load_state_dict(saved)
    assert cosine.last_step == 0
