"""Normalisation statistics of state and action, and the maps to and from model units.

Statistics per dimension: mean, std (population, ddof=0), min, max, q01, q99 (numpy's
linear quantiles) and count, stored as JSON keyed by feature name:
`{"action": {"mean": [...], ...}, "observation.state": {...}}`.

Modes (dataset.normalization):
- mean_std: (x - mean) / std
- min_max:  (x - (max + min) / 2) / ((max - min) / 2), so [min, max] -> [-1, 1]
- quantile: the same with q01 and q99 (openpi's choice: robust to outliers; no clipping,
            so unnormalize is the exact inverse)
- none:     identity
A dimension whose spread is below 1e-6 (a constant joint) is only shifted, never divided by
~0, so an unseen value at inference cannot explode.

Relative action dimensions (dataset.relative_action_dims, openpi's delta joint actions): each such
action is learned as its distance from the same dimension of the condition frame's state, divided
by the action's spread and not shifted, `(a - s) / scale`; unnormalize adds the state back. The
model then learns where a joint goes from where it is, instead of copying the state into every
action of the chunk. Both maps take that state as the model reads it (normalised).

With a relative horizon k (dataset.relative_action_horizon) the shift fades over the chunk: action i
is learned as `(a_i - w_i s - (1 - w_i) c) / scale` with `w_i = max(0, 1 - i / k)` and c the action's
usual center, so the chunk starts as a distance from the state (no jump where a new chunk joins the
old one) and from action k on is absolute (where a reach ends is set by the picture, not by where the
arm started). Without a horizon every action of the chunk is relative (w_i = 1).
"""
import json
from typing import Any, Optional, Sequence, TypeVar

import numpy as np
import torch

from data.config import NORMALIZATIONS

_EPS = 1e-6
STAT_NAMES = ("mean", "std", "min", "max", "q01", "q99", "count")

Values = TypeVar("Values", torch.Tensor, np.ndarray)
"""What the maps take and give back: a tensor (inference) or an array (the data loader)."""


def compute_feature_stats(values: Any) -> dict[str, Any]:
    """Statistics of a [rows, dim] array (rows pooled over every episode)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or len(values) == 0:
        raise ValueError(f"expected a non-empty [rows, dim] array, got shape {values.shape}")
    q01, q99 = np.quantile(values, [0.01, 0.99], axis=0)
    return {"mean": values.mean(0).tolist(), "std": values.std(0).tolist(), "min": values.min(0).tolist(),
            "max": values.max(0).tolist(), "q01": q01.tolist(), "q99": q99.tolist(), "count": [len(values)]}


class NormStats:
    """Statistics of the action (and state) features plus the mode that uses them."""

    def __init__(self, stats: dict[str, dict[str, Any]], mode: str = "mean_std", action_key: str = "action",
                 state_key: str = "observation.state", relative_dims: Sequence[int] = (),
                 relative_horizon: Optional[int] = None) -> None:
        if mode not in NORMALIZATIONS:
            raise ValueError(f"normalization mode {mode!r}; expected one of {', '.join(NORMALIZATIONS)}")
        self.stats = {k: {n: list(v) for n, v in s.items()} for k, s in stats.items()}
        self.mode, self.action_key, self.state_key = mode, action_key, state_key
        if mode != "none" and action_key not in self.stats:
            raise ValueError(f"statistics have no '{action_key}' entry; they have {sorted(self.stats)}")
        self._affine = {k: self._center_scale(k) for k in self.stats} if mode != "none" else {}
        self.relative_dims = [int(d) for d in relative_dims]
        if relative_horizon is not None and (not self.relative_dims or int(relative_horizon) < 1):
            raise ValueError(f"relative action horizon {relative_horizon}: expected a positive number of actions "
                             "with relative action dims, or None")
        self.relative_horizon = None if relative_horizon is None else int(relative_horizon)
        self._relative_center: np.ndarray = np.zeros(len(self.relative_dims), dtype=np.float32)
        self._fades: dict[tuple[int, str, str], tuple[Any, Any]] = {}  # _fade's, per chunk length, dtype, device
        if self.relative_dims and mode != "none" and state_key not in self.stats:
            raise ValueError(f"relative action dims {self.relative_dims} need statistics of '{state_key}'; "
                             f"they have {sorted(self.stats)}")
        if self.relative_dims and action_key in self._affine:  # a distance from the state: scaled, never shifted
            center, scale = self._affine[action_key]
            self._relative_center = center[self.relative_dims].copy()
            center = center.copy()
            center[self.relative_dims] = 0.0
            self._affine[action_key] = (center, scale)

    def _center_scale(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        s = {n: np.asarray(v, dtype=np.float64) for n, v in self.stats[key].items() if n != "count"}
        missing = [n for n in {"mean_std": ("mean", "std"), "min_max": ("min", "max"),
                               "quantile": ("q01", "q99")}[self.mode] if n not in s]
        if missing:
            raise ValueError(f"statistics of '{key}' lack {missing} needed by normalization {self.mode}")
        if self.mode == "mean_std":
            center, spread = s["mean"], s["std"]
        else:
            lo, hi = (s["min"], s["max"]) if self.mode == "min_max" else (s["q01"], s["q99"])
            center, spread = (hi + lo) / 2, (hi - lo) / 2
        scale = np.where(spread < _EPS, 1.0, spread)
        return center.astype(np.float32), scale.astype(np.float32)

    # ---- maps --------------------------------------------------------------------------------
    def _apply(self, key: str | None, x: Values, inverse: bool) -> Values:
        if self.mode == "none" or key is None:
            return x
        if key not in self._affine:
            raise KeyError(f"no statistics for '{key}'; available: {sorted(self._affine)}")
        center, scale = self._affine[key]
        if x.shape[-1] != center.shape[0]:
            raise ValueError(f"'{key}' has dimension {x.shape[-1]}, its statistics have {center.shape[0]}")
        if isinstance(x, torch.Tensor):
            center = torch.as_tensor(center, dtype=x.dtype, device=x.device)
            scale = torch.as_tensor(scale, dtype=x.dtype, device=x.device)
        return x * scale + center if inverse else (x - center) / scale

    def normalize_action(self, x: Values, state: Optional[Values] = None) -> Values:
        """Robot units -> model units. `state`: the condition frame's state in model units (normalised),
        [..., state_dim] against actions [..., chunk, action_dim]; needed with relative dims."""
        return self._apply(self.action_key, self._shift(x, state, -1), inverse=False)

    def unnormalize_action(self, x: Values, state: Optional[Values] = None) -> Values:
        """Model units -> robot units (inference); `state` as in normalize_action."""
        return self._shift(self._apply(self.action_key, x, inverse=True), state, +1)

    def _shift(self, x: Values, state: Optional[Values], sign: int) -> Values:
        """x with `sign` times the origin of each relative dim added: the state (robot units), faded
        into the action's center over the relative horizon."""
        if not self.relative_dims:
            return x
        if state is None:
            raise ValueError(f"actions relative to the state (dims {self.relative_dims}) need the state")
        raw = self._apply(self._state_entry(), state, inverse=True)
        d = self.relative_dims
        if isinstance(x, torch.Tensor):
            raw = torch.as_tensor(raw, dtype=x.dtype, device=x.device)
            x = x.clone()
        else:
            raw = np.asarray(raw, dtype=x.dtype)
            x = x.copy()
        origin = raw[..., None, d]
        if self.relative_horizon is not None:
            fade, center = self._fade(x)
            origin = fade * origin + (1 - fade) * center
        x[..., d] += sign * origin
        return x

    def _fade(self, like: Values) -> tuple[Any, Any]:
        """(w [chunk, 1] with w_i = max(0, 1 - i/k), the relative dims' action center) as `like`'s type,
        dtype and device: built once per chunk length, so a server does not upload them at every query."""
        assert self.relative_horizon is not None
        key = (like.shape[-2], str(like.dtype), str(getattr(like, "device", "numpy")))
        if key not in self._fades:
            w = np.clip(1.0 - np.arange(like.shape[-2]) / self.relative_horizon, 0.0, 1.0)[:, None]
            center = self._relative_center
            if isinstance(like, torch.Tensor):
                self._fades[key] = (torch.as_tensor(w, dtype=like.dtype, device=like.device),
                                    torch.as_tensor(center, dtype=like.dtype, device=like.device))
            else:
                self._fades[key] = (w.astype(like.dtype), center.astype(like.dtype))
        return self._fades[key]

    def normalize_state(self, x: Values) -> Values:
        return self._apply(self._state_entry(), x, inverse=False)

    def _state_entry(self) -> str | None:
        """The state's statistics key, or None where there are none (the state then passes as it is)."""
        return self.state_key if self.state_key in self.stats else None

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Feature-keyed statistics plus a "normalization" entry (mode and which feature is which)."""
        out: dict[str, Any] = {k: dict(v) for k, v in self.stats.items()}
        out["normalization"] = {"mode": self.mode, "action_key": self.action_key, "state_key": self.state_key,
                                "relative_action_dims": self.relative_dims,
                                "relative_action_horizon": self.relative_horizon}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], mode: str | None = None, action_key: str | None = None,
                  state_key: str | None = None, relative_dims: Sequence[int] | None = None,
                  relative_horizon: int | None = None) -> "NormStats":
        """Read `to_dict()` output or a compute_stats JSON; arguments given here win over the file's
        (the relative dims and horizon as one: given dims come with the given horizon)."""
        meta = d.get("normalization", {})
        stats = {k: v for k, v in d.items() if k != "normalization"}
        if relative_dims is None:
            relative_dims, relative_horizon = (meta.get("relative_action_dims", ()),
                                               meta.get("relative_action_horizon"))
        return cls(stats, mode=mode or meta.get("mode", "mean_std"),
                   action_key=action_key or meta.get("action_key", "action"),
                   state_key=state_key or meta.get("state_key", "observation.state"),
                   relative_dims=relative_dims, relative_horizon=relative_horizon)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: str, mode: str | None = None, action_key: str | None = None,
             state_key: str | None = None, relative_dims: Sequence[int] | None = None,
             relative_horizon: int | None = None) -> "NormStats":
        with open(path) as f:
            return cls.from_dict(json.load(f), mode=mode, action_key=action_key, state_key=state_key,
                                 relative_dims=relative_dims, relative_horizon=relative_horizon)
