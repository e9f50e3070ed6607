"""The world model: `from models import build_world_model, WorldModel, FrozenEncoders`.

Imports are lazy so that `models.config` (read by train/config.py) stays light.
"""

_EXPORTS = {
    "build_world_model": "models.build",
    "WorldModel": "models.world_model",
    "FrozenEncoders": "models.encoders",
    "ModelLoadError": "models.serialization",
    "ensure_tiny_assets": "models.tiny_assets",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute '{name}'")
