"""Camera frames -> the model's video tensor: size each camera, tile, letterbox, scale to [-1, 1].

The tiled frame is fitted (aspect kept) inside video_height x video_width. Each camera is
resized on its own to its share of that fit before tiling, so a video camera is resized by
the decoder (swscale, in the same pass as its YUV -> RGB conversion) and only image
cameras go through PIL. Done with numpy: per-sample images are small and torch ops in a
busy main process pay more in thread start-up than in arithmetic.
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


def camera_sizes(sizes, height, width):
    """(h, w) of each camera so that, tiled, they fill the fit of the tiled frame in height x width.

    Column edges are rounded once from the tiled width, so the widths add up to the fitted width.
    """
    tall, wide = max(h for h, _ in sizes), sum(w for _, w in sizes)
    new_h, new_w = fit_size(tall, wide, height, width)
    edges = np.round(np.cumsum([0] + [w for _, w in sizes]) * new_w / wide).astype(int)
    return [(max(1, min(new_h, round(h * new_h / tall))), max(1, int(b - a)))
            for (h, _), a, b in zip(sizes, edges[:-1], edges[1:])]


def resize_frames(frames, size):
    """uint8 [T, h, w, 3] -> [T, size, 3]: bilinear (PIL widens the filter when shrinking, so it is
    antialiased); unchanged when already that size."""
    new_h, new_w = size
    if frames.shape[1:3] == (new_h, new_w):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.BILINEAR)) for f in frames])


def letterbox(frames, height, width):
    """uint8 [T, h, w, 3] with h <= height, w <= width -> float32 [T, 3, height, width] in [-1, 1],
    centred with black bars on the sides that fall short."""
    new_h, new_w = frames.shape[1:3]
    if new_h > height or new_w > width:
        raise ValueError(f"frames of {new_h}x{new_w} do not fit in {height}x{width}")
    x = frames.astype(np.float32).transpose(0, 3, 1, 2) / 127.5 - 1.0
    if (new_h, new_w) != (height, width):
        out = np.full((len(frames), 3, height, width), PAD_VALUE, dtype=np.float32)
        top, left = (height - new_h) // 2, (width - new_w) // 2
        out[:, :, top:top + new_h, left:left + new_w] = x
        x = out
    return torch.from_numpy(np.ascontiguousarray(x))


def fit_frames(frames, height, width):
    """uint8 [T, h, w, 3] -> float32 [T, 3, height, width] in [-1, 1]: the aspect-preserving resize
    of `resize_frames` to fit inside height x width, then `letterbox`."""
    return letterbox(resize_frames(frames, fit_size(*frames.shape[1:3], height, width)), height, width)
