"""Camera frames -> the model's video tensor: tile cameras, fit with padding, scale to [-1, 1].

Done with PIL and numpy: per-sample images are small and torch ops in a busy main process
pay more in thread start-up than in arithmetic.
"""
import numpy as np
import torch
from PIL import Image

PAD_VALUE = -1.0
"""Letterbox bars are black (-1 in model units)."""


def tile_cameras(views):
    """Cameras side by side: a list of uint8 [T, h_i, w_i, 3] -> uint8 [T, max h, sum w, 3].

    A camera shorter than the tallest is padded at the bottom (black), never stretched.
    """
    if len(views) == 1:
        return views[0]
    height = max(v.shape[1] for v in views)
    padded = [np.pad(v, ((0, 0), (0, height - v.shape[1]), (0, 0), (0, 0))) for v in views]
    return np.concatenate(padded, axis=2)


def fit_size(h, w, height, width):
    """Size of an h x w frame scaled, aspect kept, to fit inside height x width."""
    scale = min(height / h, width / w)
    return max(1, min(height, round(h * scale))), max(1, min(width, round(w * scale)))


def fit_frames(frames, height, width):
    """uint8 [T, h, w, 3] -> float32 [T, 3, height, width] in [-1, 1].

    Aspect-preserving resize (bilinear; PIL widens the filter when shrinking, so it is
    antialiased) so the frame fits inside height x width, then centred with black bars on the
    two sides that fall short.
    """
    h, w = frames.shape[1:3]
    new_h, new_w = fit_size(h, w, height, width)
    if (new_h, new_w) != (h, w):
        frames = np.stack([np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.BILINEAR)) for f in frames])
    x = frames.astype(np.float32).transpose(0, 3, 1, 2) / 127.5 - 1.0
    if (new_h, new_w) != (height, width):
        out = np.full((len(frames), 3, height, width), PAD_VALUE, dtype=np.float32)
        top, left = (height - new_h) // 2, (width - new_w) // 2
        out[:, :, top:top + new_h, left:left + new_w] = x
        x = out
    return torch.from_numpy(np.ascontiguousarray(x))
