"""The model's frame of a RoboTwin 2.0 robot, exactly as Motus composes it (dataset.frame_layout robotwin).

Motus's RoboTwin policy (inference/robotwin/Motus/deploy_policy.py, `MotusPolicy.update_obs`)
puts the head camera on top and the two wrist cameras, each resized to half the head's size
(160x120 for RoboTwin's 320x240 D435), side by side below it; then its `resize_with_padding`
scales that picture, aspect kept, to the model's frame size and centres it on black. Both
resizes are OpenCV's `cv2.resize` with its default INTER_LINEAR. This module reproduces those
pixels bit for bit in numpy (tests/test_robotwin_eval.py checks it against a fixture made by
Motus's own code), so that training (data/), `inference.serve` and the RoboTwin policy folder
(inference/robotwin/) share one picture without OpenCV or torch.

Motus's preprocessed videos (dataset.type robotwin) already hold the composed picture: for
them only the fit to the frame size is left (one view instead of three).
"""
from collections.abc import Sequence

import numpy as np

CAMERAS = ("head_camera", "left_camera", "right_camera")
"""RoboTwin's camera names, in the order the composition takes them (head, left wrist, right wrist)."""

_COEF_BITS = 11  # OpenCV's INTER_RESIZE_COEF_BITS: bilinear weights in fixed point, 2048 = 1.0
_COEF_SCALE = 1 << _COEF_BITS


def _taps(src: int, dst: int, clamp_weight: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's source index and fixed-point weights (w0, w1) of every output position along one axis."""
    scale = 1.0 / (dst / src)  # OpenCV's scale, in double; the position is rounded to float
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    index = np.floor(f).astype(np.int32)
    f = (f - index.astype(np.float32)).astype(np.float32)
    if clamp_weight:  # columns: outside the image OpenCV takes the edge pixel alone
        outside = (index < 0) | (index >= src - 1)
        f[outside] = 0
        index = np.clip(index, 0, src - 1)
    w1 = np.rint(f * np.float32(_COEF_SCALE)).astype(np.int32)
    w0 = np.rint((np.float32(1) - f) * np.float32(_COEF_SCALE)).astype(np.int32)
    return index, w0, w1


def cv2_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [..., h, w, C] -> uint8 [..., height, width, C], equal to OpenCV's
    `cv2.resize(image, (width, height))` (INTER_LINEAR) for every frame."""
    h, w = image.shape[-3:-1]
    if (h, w) == (height, width):
        return image.copy()
    if h == 2 * height and w == 2 * width:  # OpenCV switches to its area-fast path for an exact halving
        x: np.ndarray = image.astype(np.uint16)  # a 2x2 sum + 2 stays below 1024
        blocks = x[..., 0::2, 0::2, :] + x[..., 0::2, 1::2, :] + x[..., 1::2, 0::2, :] + x[..., 1::2, 1::2, :]
        return ((blocks + 2) >> 2).astype(np.uint8)
    x = image.astype(np.int32)  # 255 * 2048 and 2048 * (255 * 2048 >> 4) both fit
    cols, a0, a1 = _taps(w, width, clamp_weight=True)
    rows, b0, b1 = _taps(h, height, clamp_weight=False)
    right = np.minimum(cols + 1, w - 1)
    horizontal = x[..., :, cols, :] * a0[:, None] + x[..., :, right, :] * a1[:, None]  # [.., h, width, C]
    top, bottom = np.clip(rows, 0, h - 1), np.clip(rows + 1, 0, h - 1)
    s0 = horizontal[..., top, :, :] >> 4
    s1 = horizontal[..., bottom, :, :] >> 4
    out = (((b0[:, None, None] * s0) >> 16) + ((b1[:, None, None] * s1) >> 16) + 2) >> 2
    return out.astype(np.uint8)


def fit_with_padding(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [..., h, w, 3] -> uint8 [..., height, width, 3]: Motus's `resize_with_padding`
    (aspect kept, sizes truncated, centred on black)."""
    h, w = image.shape[-3:-1]
    scale = min(height / h, width / w)
    new_h, new_w = int(h * scale), int(w * scale)
    resized = cv2_resize(image, new_h, new_w)
    out = np.zeros(image.shape[:-3] + (height, width, image.shape[-1]), dtype=image.dtype)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[..., top:top + new_h, left:left + new_w, :] = resized
    return out


def compose_cameras(head: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Three uint8 [..., h, w, 3] cameras -> Motus's T layout: head on top, both wrists at half the
    head's size side by side below it (uint8 [..., h + h // 2, w, 3])."""
    h, w = head.shape[-3:-1]
    if w % 2:
        raise ValueError(f"the RoboTwin frame needs a head camera of even width (two half-width wrist "
                         f"images fill the row below it); got {w}x{h}")
    half_h, half_w = h // 2, w // 2
    bottom = np.concatenate([cv2_resize(left, half_h, half_w), cv2_resize(right, half_h, half_w)], axis=-2)
    return np.concatenate([head, bottom], axis=-3)


def robotwin_frame(views: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """The model's uint8 [..., height, width, 3] picture: from the three cameras (head, left wrist,
    right wrist) or from one view Motus's converter already composed."""
    if len(views) == 3:
        return fit_with_padding(compose_cameras(*views), height, width)
    if len(views) == 1:
        return fit_with_padding(views[0], height, width)
    raise ValueError(f"dataset.frame_layout robotwin composes 3 cameras (head, left wrist, right wrist) or "
                     f"takes 1 already composed view; got {len(views)} cameras")


def to_model_range(frames: np.ndarray) -> np.ndarray:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W] in [-1, 1] (as data/transforms.fit_frames scales)."""
    x: np.ndarray = np.moveaxis(frames, -1, -3).astype(np.float32)
    np.divide(x, 127.5, out=x)
    np.subtract(x, 1.0, out=x)
    return x
