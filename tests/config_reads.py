"""Run train/train.py in this process and write every config key the run read to a JSON file.

    python tests/config_reads.py OUT.json <train.py arguments>

A key counts as read when code other than the config loader and its checks takes its value: an
attribute or item access on the OmegaConf config (`cfg.training.batch_size`), or on the typed
section objects the model builds from it (`WorldModel.settings`). tests/test_config.py runs this
to find schema keys that nothing uses.
"""
import atexit
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import DictConfig  # noqa: E402

READ = set()
_active = [True]


def _record(key):
    """Called from the patched accessors: frame 2 is whoever asked for the value."""
    caller = sys._getframe(2).f_code.co_filename
    # omegaconf and dataclasses read every field when they copy a config: that is not a use
    if _active[0] and key and "omegaconf" not in caller and not caller.endswith("dataclasses.py"):
        READ.add(key)


def _patch_dictconfig():
    get_attr, get_item, get = DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get

    def getattr_(self, key):
        value = get_attr(self, key)
        if not key.startswith("_"):
            _record(self._get_full_key(key))
        return value

    def getitem_(self, key):
        value = get_item(self, key)
        _record(self._get_full_key(key))
        return value

    def get_(self, key, default_value=None):
        _record(self._get_full_key(key))
        return get(self, key, default_value)

    DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get = getattr_, getitem_, get_


def _patch_sections(cls, prefix):
    """Record reads of the schema's dataclass fields on typed objects (OmegaConf.to_object)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    original = cls.__getattribute__

    def getattribute(self, name):
        if name in fields:
            _record(prefix + name)
        return original(self, name)

    cls.__getattribute__ = getattribute
    for f in fields.values():
        if dataclasses.is_dataclass(f.type):
            _patch_sections(f.type, f"{prefix}{f.name}.")


def _quiet_while(module, name):
    """Reads inside the loader and its checks do not count: checking a key is not using it."""
    fn = getattr(module, name)

    def wrapped(*args, **kwargs):
        _active[0] = False
        try:
            return fn(*args, **kwargs)
        finally:
            _active[0] = True

    setattr(module, name, wrapped)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    import recipe.config as recipe
    import recipe.schema as schema
    import train.launch_checks as launch
    import train.train as trainer

    _patch_dictconfig()
    for f in dataclasses.fields(schema.Config):
        _patch_sections(f.type, f"{f.name}.")
    for module, name in ((recipe, "load_config"), (launch, "check_launch")):
        _quiet_while(module, name)
        _quiet_while(trainer, name)
    def write_reads():
        with open(out, "w") as f:
            json.dump(sorted(READ), f)

    atexit.register(write_reads)  # main() ends the process itself (utils/dist.leave), exit handlers first
    trainer.main(argv)


if __name__ == "__main__":
    main()
