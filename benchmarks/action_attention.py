"""Where the action tokens look: a checkpoint's attention from its action tokens to the condition
frame, at the first query of transfer_cube episodes, measured against where the cube is.

    python benchmarks/action_attention.py --checkpoint RUN/checkpoint_step_N [--checkpoint ...] \
        [--seeds 1000000-1000049] [--out benchmarks/results/action_attention.json]

For each seed the simulator's first observation (the start pose, the cube where the seed puts it,
rendered at the recipe's size) is served to the checkpoint as `inference.serve` serves it
(`inference.policy.Policy`, the recipe's sampler and noise), and every joint attention of that
`policy`-mode sampling is recorded. The cube's token is the condition-frame video token under the
cube's centroid, found by `decoded_cube`'s red rule in the rendered frame. Per layer, averaged over
heads, action tokens, Euler steps and seeds:
- `frame0`, `predicted`, `actions`: the shares of the action tokens' attention that fall on the
  condition frame's tokens, on the predicted frames' (pure noise in the policy mode: nothing to
  read) and on the action tokens (the rest goes to the understanding tokens);
- `cube`: the share on the cube's token, and `lift`, that share over the condition frame's mean
  token share (1: the cube's token gets no more than any other);
- `peak`: over (seed, head), how often the condition-frame token with the most attention lies within
  one token of the cube's.
Printed as a table per checkpoint and written to OUT. A policy that places its fingers from
the picture has to read the cube's token; this says whether and where it does.
"""
import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decoded_cube import ORIGINAL_RED, centroids, redness  # noqa: E402
from benchmarks.pose_coverage import parse_seeds  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


def cube_token(frame: np.ndarray, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The (row, column) of the `grid` token under the red cube's centroid in an RGB uint8 frame [H, W, 3];
    None when the frame shows no cube."""
    video = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).float().div(127.5).sub(1)[None, :, None]
    y, x, n = centroids(redness(video), ORIGINAL_RED)
    if float(n) < 1:
        return None
    height, width = frame.shape[:2]
    return int(float(y) * grid[0] // height), int(float(x) * grid[1] // width)


def action_query_attention(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, num_video: int,
                           num_action: int) -> torch.Tensor:
    """The action queries' softmax weights over every key, [B, heads, S], averaged over the action tokens.
    q, k [B, S, H, hd] as `models.joint.attention` gets them: `num_video` video tokens first, then
    `num_action` action tokens, then the understanding tokens; mask as there."""
    qa = q[:, num_video:num_video + num_action].float().transpose(1, 2)
    scores = qa @ k.float().transpose(1, 2).transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).mean(2)


@contextmanager
def recorded_attention(num_video: int, num_action: int) -> Iterator[list[torch.Tensor]]:
    """While active, every joint attention appends its action_query_attention [B, H, S] to the list
    yielded (in call order: layer by layer, Euler step by step)."""
    from models import joint

    original: Callable[..., torch.Tensor] = joint.attention
    calls: list[torch.Tensor] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        calls.append(action_query_attention(q, k, mask, num_video, num_action).cpu())
        return original(q, k, v, mask)

    joint.attention = spy
    try:
        yield calls
    finally:
        joint.attention = original


def layer_figures(weights: torch.Tensor, cubes: list[tuple[int, int]], grid: tuple[int, int], num_video: int,
                  num_action: int) -> dict[str, float]:
    """weights [steps, seeds, heads, S] of one layer (action_query_attention's) -> its figures."""
    rows, cols = grid
    index = torch.tensor([r * cols + c for r, c in cubes])
    every = weights.mean(0)  # [seeds, heads, S]
    per_seed = every[..., :rows * cols]  # the condition frame's tokens
    frame0 = per_seed.sum(-1)
    cube = per_seed.gather(-1, index.view(-1, 1, 1).expand(-1, per_seed.shape[1], 1)).squeeze(-1)
    peak = per_seed.argmax(-1)
    near = ((peak // cols - index.view(-1, 1) // cols).abs() <= 1) & ((peak % cols - index.view(-1, 1) % cols).abs() <= 1)
    return {"frame0": float(frame0.mean()), "predicted": float(every[..., rows * cols:num_video].sum(-1).mean()),
            "actions": float(every[..., num_video:num_video + num_action].sum(-1).mean()), "cube": float(cube.mean()),
            "lift": float((cube / (frame0 / (rows * cols))).mean()), "peak": float(near.float().mean())}


def measure(checkpoint: str, seeds: list[int]) -> dict[str, object]:
    from data.sim_env import make_env
    from inference.load import load_checkpoint
    from inference.policy import Policy

    loaded = load_checkpoint(checkpoint)
    policy, model, cfg = Policy(loaded), loaded.model, loaded.cfg
    p_t, p_h, p_w = model.video.config.patch_size
    num_action = model.action_expert.positions.shape[1]
    env = make_env(cfg.evaluation.task, (cfg.common.video_height, cfg.common.video_width))
    per_seed, cubes = [], []
    try:
        for seed in seeds:
            obs = env.reset(seed)
            image = obs[env.task.image_key]
            observation = {cfg.serving.image_keys[0]: image, cfg.serving.state_key: obs[env.task.state_key],
                           cfg.serving.prompt_key: env.task.instruction}
            # what Policy.infer does, with the latent grid read on the way
            inputs = policy.encoders.encode(policy.batch([policy.check(observation)]))
            height, width = inputs.video_latents.shape[3:]  # the condition frame's latent; the sampler adds the rest
            grid = (height // p_h, width // p_w)
            cube = cube_token(image, grid)
            if cube is None:
                continue
            num_video = model.latent_frames // p_t * grid[0] * grid[1]
            with recorded_attention(num_video, num_action) as calls:
                policy.sample(inputs, [cfg.serving.seed])
            per_seed.append(torch.stack(calls).view(-1, len(model.video.blocks), *calls[0].shape[1:]))
            cubes.append(cube)
    finally:
        env.close()
    if not per_seed:
        raise SystemExit(f"action_attention: no first frame of seeds {seeds[0]}..{seeds[-1]} shows the red cube")
    weights = torch.stack(per_seed, 2)  # [steps, layers, seeds, heads, tokens]
    layers = [layer_figures(weights[:, i], cubes, grid, num_video, num_action) for i in range(weights.shape[1])]
    return {"checkpoint": checkpoint, "seeds": len(cubes), "grid": list(grid), "layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="a checkpoint_step_N folder (repeat)")
    parser.add_argument("--seeds", default="1000000-1000049", help="evaluation seeds, e.g. 1000000-1000049")
    parser.add_argument("--out", default="benchmarks/results/action_attention.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    results = [measure(c, parse_seeds(args.seeds)) for c in args.checkpoint]
    print("| checkpoint | seeds | layer | on the condition frame | on the predicted frames | on the action tokens "
          "| on the cube's token | lift | peak within a token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for i, f in enumerate(r["layers"]):
            print(f"| {r['checkpoint']} | {r['seeds']} | {i} | {100 * f['frame0']:.1f}% | {100 * f['predicted']:.1f}% | "
                  f"{100 * f['actions']:.1f}% | {100 * f['cube']:.2f}% | "
                  f"{f['lift']:.2f} | {100 * f['peak']:.0f}% |")
    write_json(args.out, {"seeds": args.seeds, "checkpoints": results})


if __name__ == "__main__":
    main()
