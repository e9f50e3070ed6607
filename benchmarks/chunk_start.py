"""Where a chunk starts: a checkpoint's action chunks queried along the scripted expert's own
transfer_cube episodes, each action measured against the expert's action at the same step.

    python benchmarks/chunk_start.py --checkpoint RUN/checkpoint_step_N [--checkpoint ...] \
        [--seeds 1000000-1000019] [--every 32] [--out benchmarks/results/chunk_start.json]

For each seed the expert's joint actions (`data.aloha_expert.expert_trajectory`) drive the
simulator; every `--every` steps up to step 160 (lift and hand-over included) the rendered frame
and the state are served to the checkpoint as `inference.serve` serves them (`Policy.infer`, the
recipe's sampler and noise), and the chunk's actions are compared with the expert's next ones.
Per checkpoint, over seeds and queries, on the twelve arm joints (the grippers left out), radians:
- `error@k`: the mean distance |chunk[k] - expert[t + k]| at chunk offsets k;
- `lead`: the mean distance of chunk[0] from the observed state, and the expert's own `expert_lead`
  (the arm's tracking lag: a position target leads the measured joints while they move).

A policy executes a whole chunk and then queries again, so chunk[0] of the new chunk follows the
last action of the old one: an error at k = 0 larger than the expert's lead is a jump at every
join between chunks. The expert drives, so the states are the demonstrations' states (no
compounding of the policy's own errors). Printed as a table and written to OUT.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.pose_coverage import parse_seeds  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


ARMS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]  # the two arms' six joints; 6 and 13 are the grippers
LAST_QUERY = 160  # the demonstrations end a few steps after the hand-over (~180 steps): later states are unseen


def query_figures(actions: np.ndarray, expert: np.ndarray, state: np.ndarray, t: int,
                  offsets: list[int]) -> dict[str, object]:
    """One query at step t: chunk `actions` [chunk, 14] against the `expert`'s [T, 14] from step t, and both
    first actions' distance from the observed `state` [14], on the arm joints. Offsets past the expert's
    end are left out."""
    return {"error": {k: float(np.linalg.norm(actions[k, ARMS] - expert[t + k, ARMS]))
                      for k in offsets if t + k < len(expert)},
            "lead": float(np.linalg.norm(actions[0, ARMS] - state[ARMS])),
            "expert_lead": float(np.linalg.norm(expert[t, ARMS] - state[ARMS]))}


def measure(checkpoint: str, seeds: list[int], every: int) -> dict[str, object]:
    from data.aloha_expert import expert_trajectory
    from data.sim_env import make_env
    from inference.load import load_checkpoint
    from inference.policy import Policy

    loaded = load_checkpoint(checkpoint)
    policy, cfg = Policy(loaded), loaded.cfg
    chunk = policy.action_shape[0]
    offsets = sorted({0, 1, 4, 8, 16, chunk - 1} & set(range(chunk)))
    env = make_env(cfg.evaluation.task or "transfer_cube", (cfg.common.video_height, cfg.common.video_width))
    errors: dict[int, list[float]] = {k: [] for k in offsets}
    lead, expert_lead = [], []
    try:
        for seed in seeds:
            expert = expert_trajectory(env.task.name, seed)
            env.reset(seed, observe=False)
            for t in range(min(LAST_QUERY + 1, len(expert))):
                if t % every == 0 and t > 0:
                    state = env.state()
                    observation = {cfg.serving.image_keys[0]: env.render(), cfg.serving.state_key: state,
                                   cfg.serving.prompt_key: env.task.instruction}
                    figures = query_figures(policy.infer([observation])[0], expert, state, t, offsets)
                    for k, error in figures["error"].items():
                        errors[k].append(error)
                    lead.append(figures["lead"])
                    expert_lead.append(figures["expert_lead"])
                env.step(expert[t])
    finally:
        env.close()
    return {"checkpoint": checkpoint, "seeds": len(seeds), "queries": len(lead), "chunk": chunk,
            "error": {str(k): float(np.mean(v)) for k, v in errors.items()},
            "lead": float(np.mean(lead)), "expert_lead": float(np.mean(expert_lead))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="a checkpoint_step_N folder (repeat)")
    parser.add_argument("--seeds", default="1000000-1000019", help="evaluation seeds, e.g. 1000000-1000019")
    parser.add_argument("--every", type=int, default=32, help="steps between queries along the expert's episode")
    parser.add_argument("--out", default="benchmarks/results/chunk_start.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    results = [measure(c, parse_seeds(args.seeds), args.every) for c in args.checkpoint]
    offsets = sorted({k for r in results for k in r["error"]}, key=int)
    print("| checkpoint | queries | " + " | ".join(f"error@{k}" for k in offsets) + " | lead | expert's lead |")
    print("|---|---|" + "---|" * len(offsets) + "---|---|")
    for r in results:
        print(f"| {r['checkpoint']} | {r['queries']} | " + " | ".join(f"{r['error'][k]:.3f}" if k in r["error"] else "-"
                                                                  for k in offsets)
              + f" | {r['lead']:.3f} | {r['expert_lead']:.3f} |")
    write_json(args.out, {"seeds": args.seeds, "every": args.every, "checkpoints": results})


if __name__ == "__main__":
    main()
