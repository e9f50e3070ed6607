"""A rollout's report: success rates with 95% Wilson intervals, per-episode rows, policy latency and
the wall-time split, as report.json, report.md and rollout.png (success per seed, reward curves)."""
import json
import math
import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Dict, List

import numpy as np

if TYPE_CHECKING:
    from inference.rollout_episode import Episode

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
PLOT = "rollout.png"


def wilson_interval(successes: int, n: int, z: float = Z95) -> list[float]:
    """The Wilson score interval of a binomial proportion: [low, high] (sound at 0 or n successes, where
    the normal approximation collapses to a point)."""
    if n <= 0:
        raise ValueError(f"a success rate needs at least one episode, got {n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [max(0.0, centre - half), min(1.0, centre + half)]


def summarise(episodes: Sequence["Episode"]) -> dict[str, Any]:
    """One arm's episodes (in seed order) -> its success rate, interval and rows."""
    n, wins = len(episodes), sum(e.success for e in episodes)
    latencies = [ms for e in episodes for ms in e.latencies_ms]
    out = {"success_rate": wins / n, "successes": wins, "episodes": n, "wilson_95": wilson_interval(wins, n),
           "mean_max_reward": float(np.mean([e.max_reward for e in episodes])),
           "per_episode": [{"seed": e.seed, "success": e.success, "max_reward": e.max_reward, "steps": e.steps,
                            "wall_s": round(e.wall_s, 4), "rewards": e.rewards,
                            **({"video": e.video} if e.video else {}),
                            **({"record": e.record} if e.record else {})}
                           for e in episodes]}
    if latencies:
        out["latency_ms"] = {"p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99)),
                             "queries": len(latencies)}
    return out


def time_split(episodes: Sequence["Episode"]) -> dict[str, float]:
    """Seconds of all episodes (summed over workers) spent in the simulator, the policy and the rest."""
    sim = sum(e.simulator_s for e in episodes)
    pol = sum(e.policy_s for e in episodes)
    rest = sum(e.rest_s for e in episodes)
    total = sim + pol + rest
    return {"simulator_s": sim, "policy_s": pol, "rest_s": rest,
            "simulator_fraction": sim / total if total else 0.0, "policy_fraction": pol / total if total else 0.0,
            "rest_fraction": rest / total if total else 0.0}


def plot(report: dict[str, Any], episodes: Dict[str, List["Episode"]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(episodes)
    seeds = report["seeds"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(5.0, 0.25 * len(seeds) + 2), 5.5),
                                      gridspec_kw={"height_ratios": [max(1, len(arms)), 3]})
    grid = np.array([[float(e.success) for e in episodes[a]] for a in arms])
    top.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    top.set_yticks(range(len(arms)), arms, fontsize=7)
    ticks = range(0, len(seeds), max(1, len(seeds) // 10))
    top.set_xticks(list(ticks), [str(seeds[i]) for i in ticks], fontsize=6, rotation=30)
    top.set_xticks(np.arange(-0.5, len(seeds)), minor=True)  # white lines between the cells: one per episode
    top.set_yticks(np.arange(-0.5, len(arms)), minor=True)
    top.grid(which="minor", color="white", linewidth=1)
    top.tick_params(which="minor", length=0)
    top.set_title(f"{report['task']}: success per seed (green: success)", fontsize=9)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, arm in enumerate(arms):
        for i, e in enumerate(episodes[arm]):
            bottom.plot(range(1, len(e.rewards) + 1), e.rewards, color=colours[k % len(colours)], alpha=0.6,
                        linewidth=1, label=arm if i == 0 else None)
    bottom.set_xlabel("step", fontsize=8)
    bottom.set_ylabel("reward", fontsize=8)
    bottom.set_title("reward per step, one line per episode", fontsize=9)
    bottom.tick_params(labelsize=7)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(report: dict[str, Any]) -> str:
    r = report
    lines = [f"# Closed-loop rollout: {r['task']} ({r['gym_id']})", "",
             f"Policy `{r['policy']['uri']}`, checkpoint `{r['policy'].get('checkpoint')}`, config hash "
             f"`{r['policy'].get('config_hash')}`, weights `{r['policy'].get('weights')}`. "
             f"{r['episodes']} episodes on evaluation seeds "
             f"{r['seeds'][0]}..{r['seeds'][-1]}, at most {r['steps']} steps each; success: {r['success_rule']}. "
             f"Rendered at {r['image_size'][0]}x{r['image_size'][1]}, a chunk of {r['action_chunk']} actions "
             f"executed {r['replan']} steps before the next query. Instruction: \"{r['instruction']}\".", "",
             "| arm | success | 95% Wilson interval | mean max reward |", "|---|---|---|---|"]
    for arm, s in r["results"].items():
        lo, hi = s["wilson_95"]
        lines.append(f"| {arm} | {s['successes']}/{s['episodes']} = {_pct(s['success_rate'])} | "
                     f"[{_pct(lo)}, {_pct(hi)}] | {s['mean_max_reward']:.3g} |")
    lines += ["", f"![success per seed and reward curves]({PLOT})", ""]
    pol = r["results"].get("policy", {})
    if "latency_ms" in pol:
        lat = pol["latency_ms"]
        lines.append(f"Policy latency (round trip, {lat['queries']} queries): p50 {lat['p50']:.1f} ms, "
                     f"p99 {lat['p99']:.1f} ms.")
    ts = r["time_split"]
    lines += [f"Episode time, summed over {r['workers']} workers: simulator {ts['simulator_s']:.1f} s "
              f"({_pct(ts['simulator_fraction'])}), policy {ts['policy_s']:.1f} s ({_pct(ts['policy_fraction'])}), "
              f"rest {ts['rest_s']:.1f} s ({_pct(ts['rest_fraction'])}); the command took {r['wall_s']:.1f} s.", "",
              "Observation sent (task feature -> server key): " +
              ", ".join(f"{task_key} -> `{server_key}`" for task_key, server_key in r["observation_map"].items()), "",
              "## Episodes", "", "| arm | seed | success | max reward | steps | wall s | video |",
              "|---|---|---|---|---|---|---|"]
    for arm, s in r["results"].items():
        for e in s["per_episode"]:
            video = f"[mp4]({e['video']})" if "video" in e else ""
            lines.append(f"| {arm} | {e['seed']} | {'yes' if e['success'] else 'no'} | {e['max_reward']:.3g} | "
                         f"{e['steps']} | {e['wall_s']:.2f} | {video} |")
    lines += ["", "Reproduce: `" + shlex.join(r["command"]) + "`", ""]
    return "\n".join(lines)


def write(folder: str, report: dict[str, Any], episodes: dict[str, list["Episode"]]) -> None:
    """report.json, report.md and the plot into `folder`."""
    plot(report, episodes, os.path.join(folder, PLOT))
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write(markdown(report))
