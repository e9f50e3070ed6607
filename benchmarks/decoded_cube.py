"""Does a VAE's latent place transfer_cube's cube? The decoded picture of held-out frames, measured.

    python benchmarks/decoded_cube.py --config configs/aloha_sim.yaml --vae assets/tiny_aloha/vae \
        [--vae OTHER_VAE ...] [--windows 40] [--out benchmarks/results/decoded_cube.json] [--require-shown 0.5]

The policy reads the condition frame through the frozen VAE's latent, so a cube the latent blurs or
shifts is a cube the action expert cannot reach precisely. This script reads windows of the recipe's
validation episodes raw (whatever dataset.cache_dir says), encodes each clip with each VAE (the
posterior mean, as the latent cache does), decodes it, and compares the red cube in the two pictures.
A pixel is the cube's when its red channel exceeds the larger of green and blue by more than
ORIGINAL_RED in the original frame (the cube's ~40 pixels at 192x256, nothing else in the scene) or
DECODED_RED in the decoded one (a decoded cube's colour is diluted by the blur). For every frame whose
original shows the cube (>= MIN_CUBE pixels; a lifted or held cube is partly hidden): whether the
decoded frame shows it (>= MIN_DECODED pixels) and the distance in pixels between the two centroids
(the cube is 4 cm and about 7 pixels wide at 192x256). Printed: one row per VAE, with the PSNR over
the whole clips; written to OUT. With --require-shown F it also exits non-zero, naming the VAE, when
a decoded picture shows the cube in fewer than a share F of those frames: the recipe's check of a
fitted VAE before the latent cache is built on it (a short fit can end where the VAE draws the
background alone, and a policy trained on that latent never sees the cube).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.results import write_json  # noqa: E402


ORIGINAL_RED, DECODED_RED = 0.4, 0.3
MIN_CUBE, MIN_DECODED = 5, 3


def redness(video: torch.Tensor) -> torch.Tensor:
    """[N, 3, T, H, W] in [-1, 1] -> [N, T, H, W]: red minus the larger of green and blue, in [0, 1] units."""
    v = (video.clamp(-1, 1) + 1) / 2
    return v[:, 0] - torch.maximum(v[:, 1], v[:, 2])


def centroids(red: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., H, W] -> (row, column, pixel count) of the pixels above `threshold`, per frame."""
    mask = (red > threshold).float()
    count = mask.sum(dim=(-1, -2))
    rows = torch.arange(red.shape[-2], dtype=torch.float32).view(-1, 1)
    cols = torch.arange(red.shape[-1], dtype=torch.float32).view(1, -1)
    return ((mask * rows).sum(dim=(-1, -2)) / count.clamp_min(1),
            (mask * cols).sum(dim=(-1, -2)) / count.clamp_min(1), count)


def compare(original: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """Original and decoded clips [N, 3, T, H, W] in [-1, 1] -> how well the decoded ones show the cube."""
    y0, x0, n0 = centroids(redness(original), ORIGINAL_RED)
    y1, x1, n1 = centroids(redness(decoded), DECODED_RED)
    cube = n0 >= MIN_CUBE
    shown = cube & (n1 >= MIN_DECODED)
    error = ((y1 - y0) ** 2 + (x1 - x0) ** 2).sqrt()[shown]
    mse = (decoded.clamp(-1, 1) - original).pow(2).mean()
    return {"frames_with_cube": int(cube.sum()), "shown": int(shown.sum()) / max(1, int(cube.sum())),
            "error_px_median": float(error.median()) if len(error) else float("nan"),
            "error_px_mean": float(error.mean()) if len(error) else float("nan"),
            "error_px_p90": float(error.quantile(0.9)) if len(error) else float("nan"),
            "psnr_db": float(10 * torch.log10(4 / mse))}


def unseen_cube(rows: dict[str, dict[str, float]], required: float) -> list[str]:
    """One line per VAE whose decoded pictures show the cube in fewer than `required` of the frames."""
    return [f"{path}: the decoded picture shows the cube in {100 * r['shown']:.0f}% of the "
            f"{r['frames_with_cube']} held-out frames that show it; --require-shown asks for {100 * required:.0f}%"
            for path, r in rows.items() if r["shown"] < required]


def held_out_clips(config: str, windows: int) -> torch.Tensor:
    """`windows` validation windows spread over the held-out episodes, [N, 3, T, H, W] (the VAE's layout)."""
    from data import build_datasets
    from recipe.config import load_config

    _, val_set, _ = build_datasets(load_config(config, ["dataset.cache_dir=null"]))
    if val_set is None:
        raise SystemExit(f"decoded_cube: {config} holds out no episodes (dataset.val_fraction 0)")
    every = val_set.val_windows()
    picked = every[:: max(1, len(every) // windows)][:windows]
    return torch.stack([val_set.load(w)["video"] for w in picked]).permute(0, 2, 1, 3, 4)


def decode(vae_path: str, clips: torch.Tensor) -> torch.Tensor:
    from diffusers import AutoencoderKLWan

    from models.vae_fit import reconstruct

    return reconstruct(AutoencoderKLWan.from_pretrained(vae_path), clips)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the recipe whose validation episodes are read")
    parser.add_argument("--vae", action="append", required=True, help="a diffusers AutoencoderKLWan folder (repeat)")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/decoded_cube.json")
    parser.add_argument("--require-shown", type=float, default=None, metavar="F",
                        help="exit non-zero when a VAE shows the cube in fewer than this share of the frames")
    args = parser.parse_args()
    clips = held_out_clips(args.config, args.windows)
    rows = {path: compare(clips, decode(path, clips)) for path in args.vae}
    print(f"{len(clips)} held-out windows of {args.config}, {clips.shape[2]} frames each")
    print("| VAE | frames with the cube | decoded shows it | centroid error px: median / mean / p90 | PSNR |")
    print("|---|---|---|---|---|")
    for path, r in rows.items():
        print(f"| {path} | {r['frames_with_cube']} | {100 * r['shown']:.0f}% | {r['error_px_median']:.2f} / "
              f"{r['error_px_mean']:.2f} / {r['error_px_p90']:.2f} | {r['psnr_db']:.1f} dB |")
    write_json(args.out, {"config": args.config, "windows": len(clips), "vaes": rows})
    failed = unseen_cube(rows, args.require_shown) if args.require_shown is not None else []
    if failed:
        raise SystemExit("decoded_cube: " + "\n".join(failed) + "\nFit the VAE again, longer, then build the latent "
                         "cache on it (TRAINING.md, \"A short fit can lose the cube altogether\").")


if __name__ == "__main__":
    main()
