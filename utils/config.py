"""Config machinery shared by every schema: load a YAML file and `key=value` overrides onto a
structured (dataclass) schema, reject unknown keys and wrong types with a message naming the
file, the key and the closest valid key, and check values against the registries that own them.

The recipe's own schema, and every check across its fields, is `train/config.py`.
"""
import difflib
import os

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A config that cannot run: the message says which file and key, and what was expected."""


def all_keys(node, prefix=""):
    keys = []
    for k in node.keys():
        full = f"{prefix}{k}"
        keys.append(full)
        child = node._get_node(k)
        if OmegaConf.is_dict(child) and not child._is_none():
            keys.extend(all_keys(child, full + "."))
    return keys


def closest(key, valid):
    """' Did you mean ...?' for a mistyped key, or ''."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not match:  # a typo in the last part only: compare leaf names within the section
        section, _, leaf = key.rpartition(".")
        siblings = [v for v in valid if v.rpartition(".")[0] == section]
        leaves = difflib.get_close_matches(leaf, [s.rpartition(".")[2] for s in siblings], n=1, cutoff=0.4)
        match = [f"{section}.{leaves[0]}" if section else leaves[0]] if leaves else []
    return f" Did you mean '{match[0]}'?" if match else ""


def merge(schema, data, source):
    valid = all_keys(schema)
    try:
        return OmegaConf.merge(schema, data)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = getattr(e, "msg", str(e)).splitlines()[0]
        if isinstance(e, ConfigKeyError):  # a key the schema does not have
            raise ConfigError(f"{source}: unknown key '{key}'.{closest(key, valid)}") from None
        raise ConfigError(f"{source}: bad value for '{key}': {msg}") from None


def parse_overrides(overrides):
    for item in overrides:
        if "=" not in item or item.startswith("=") or item.startswith("--"):
            raise ConfigError(f"command line: override '{item}' is not of the form key=value "
                              "(for example training.max_steps=50)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"command line: cannot parse overrides {list(overrides)}: {e}") from None


def read_yaml(path):
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error: name the file and the parser's position
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def load_structured(schema_cls, path, overrides=()):
    """The YAML at `path` plus `overrides`, merged onto `schema_cls`'s defaults (not yet checked)."""
    cfg = merge(OmegaConf.structured(schema_cls), read_yaml(path), path)
    return merge(cfg, parse_overrides(overrides), "command line")


def check_choice(source, key, value, allowed):
    if value not in allowed:
        raise ConfigError(f"{source}: '{key}' is {value!r}; expected one of {', '.join(map(str, allowed))}")


def require(source, condition, key, value, expected):
    """Raise the standard message unless `condition`: '<source>: 'key' is value; expected ...'."""
    if not condition:
        raise ConfigError(f"{source}: '{key}' is {value!r}; expected {expected}")
