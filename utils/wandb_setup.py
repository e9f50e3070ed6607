"""wandb the way its users set it up: environment variables and wandb's own settings first.

`logging.wandb_mode`, `wandb_project` and `wandb_entity` are null by default, so WANDB_MODE,
WANDB_PROJECT, WANDB_ENTITY (and wandb's settings files, `wandb login`, `wandb offline`) decide;
a YAML value, when set, wins and is logged. Credentials are looked up the way wandb itself does
(WANDB_API_KEY, an identity token file, ~/.netrc, its settings) without any network request, so an
online run without them stops at start-up with one message instead of a traceback after the
model was built.
"""
import logging
import os
import re
import secrets
from typing import Any

from omegaconf import DictConfig

log = logging.getLogger(__name__)

# logging.wandb_* key -> the wandb setting and environment variable it overrides when set.
KEYS = {"wandb_mode": ("mode", "WANDB_MODE"), "wandb_project": ("project", "WANDB_PROJECT"),
        "wandb_entity": ("entity", "WANDB_ENTITY")}
RUN_ID_FILE = "wandb_run_id"


class WandbLoginError(RuntimeError):
    """An online wandb run was asked for, but this machine has no W&B credentials."""


def uses_wandb(logging_cfg: DictConfig) -> bool:
    return logging_cfg.report_to in ("wandb", "all")


def wandb_settings(logging_cfg: DictConfig) -> Any:
    """wandb's own settings (environment, settings files, defaults) with the YAML's values on top."""
    from wandb.sdk import wandb_setup

    settings = wandb_setup.singleton().settings.model_copy()  # loads them; starts no service process
    for key, (name, _) in KEYS.items():
        value = getattr(logging_cfg, key)
        if value is not None:
            setattr(settings, name, value)
    return settings


def source(logging_cfg: DictConfig, key: str, value: Any) -> str:
    """Where wandb's value for `logging.<key>` comes from: the YAML, its environment variable, or wandb."""
    env = KEYS[key][1]
    if getattr(logging_cfg, key) is not None:
        overridden = os.environ.get(env) not in (None, value)
        return f"logging.{key}" + (f", overriding {env}={os.environ[env]}" if overridden else "")
    return env if os.environ.get(env) else f"wandb's default or settings file; {env} is not set"


def describe(logging_cfg: DictConfig, settings: Any) -> str:
    """One line saying each setting's value and where it came from, e.g. `mode offline (WANDB_MODE),
    project motus (logging.wandb_project), entity None (...)`; None lets wandb choose (its default
    project, your default entity)."""
    return ", ".join(f"{name} {getattr(settings, name)} ({source(logging_cfg, key, getattr(settings, name))})"
                     for key, (name, _) in KEYS.items())


def check_wandb_login(logging_cfg: DictConfig) -> None:
    """Raise WandbLoginError if an online wandb run is asked for and this machine has no credentials.

    Run on every rank (under dist.fail_together): only rank 0 logs to wandb, but whichever rank
    exits first may be the only one whose message reaches the log before the launcher stops the
    others, so each one checks and can say what is wrong. Makes no network request.
    """
    if uses_wandb(logging_cfg):
        require_credentials(logging_cfg)


def require_credentials(logging_cfg: DictConfig) -> None:
    """Raise WandbLoginError if these settings make an online run and no credentials are found."""
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib import wbauth

    settings = wandb_settings(logging_cfg)
    if settings._offline or settings._noop:
        return
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        auth = wbauth.authenticate_session(host=host, source="start-up check", prompt=False, update_session=False)
    except AuthenticationError as e:  # credentials found but malformed, e.g. a truncated key
        raise WandbLoginError(f"wandb: {e}. {HOW_TO_FIX}") from None
    if auth is None:
        raise WandbLoginError(
            f"wandb would log online (mode {settings.mode} from {source(logging_cfg, 'wandb_mode', settings.mode)}) "
            f"but this machine has no W&B credentials for {host.url} (no WANDB_API_KEY, no ~/.netrc entry). "
            f"{HOW_TO_FIX}")


HOW_TO_FIX = ("Log in once with `wandb login` (or export WANDB_API_KEY=...); or log offline with "
              "WANDB_MODE=offline (or logging.wandb_mode=offline) and upload later with "
              "`wandb sync <run folder>/wandb/offline-run-*`; or pass --report_to tensorboard.")


def run_id(run_dir: str, stem: str) -> str:
    """The wandb run id of this run folder: made once (config stem, run name, a random suffix) and
    kept in {run_dir}/wandb_run_id, so resume, requeue and elastic resume continue the same wandb
    run while another folder with the same run name (tiny/run1, robotwin/run1) gets its own."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    os.makedirs(run_dir, exist_ok=True)
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    readable = re.sub(r"[^A-Za-z0-9._-]", "-", f"{stem}-{os.path.basename(run_dir)}")[:64]
    new_id = f"{readable}-{secrets.token_hex(4)}"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new_id + "\n")
    os.replace(tmp, path)
    return new_id


def init_wandb(cfg: DictConfig, run_dir: str) -> Any:
    """Start (or continue) this run folder's wandb run on rank 0; files go under {run_dir}/wandb/."""
    import wandb
    from omegaconf import OmegaConf

    require_credentials(cfg.logging)  # train.py checked at start-up; another command that logs here did not
    stem = os.path.basename(os.path.dirname(os.path.abspath(run_dir)))
    log.info("wandb: %s", describe(cfg.logging, wandb_settings(cfg.logging)))
    return wandb.init(mode=cfg.logging.wandb_mode, project=cfg.logging.wandb_project,
                      entity=cfg.logging.wandb_entity, id=run_id(run_dir, stem), resume="allow",
                      name=f"{stem}/{os.path.basename(run_dir)}", dir=run_dir,
                      config=OmegaConf.to_container(cfg))
