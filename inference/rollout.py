"""Closed-loop evaluation: a served policy acts in a simulator, and its success rate is reported.

    python -m inference.rollout --task transfer_cube (--checkpoint PATH [--which best] | --policy ws://HOST:PORT) \
        --episodes 50 --out DIR [--seed S] [--workers W] [--replan K] [--steps T] [--videos N] [--record N] \
        [--baselines expert,hold] [--device cpu] [serving.key=value ...]

Episode k runs on evaluation seed S + k (data.sim_env.EVAL_SEEDS, never a demonstration seed). The
policy is queried through openpi-client's WebsocketClientPolicy, the protocol inference.serve speaks;
with --checkpoint this command starts `python -m inference.serve` on a free loopback port (the
key=value overrides go to it) and stops it at the end. The server's metadata decides the picture size
and the keys sent (inference/rollout_server.py). Each answered chunk is executed open-loop for
--replan steps (default: the whole chunk). Episodes run in --workers processes against the one server,
which batches concurrent requests (serving.batch_window_ms). Baselines run on the same seeds without a
server: `hold` holds the initial pose, `expert` replays data.aloha_expert's trajectory (ALOHA only).

Writes report.json, report.md, rollout.png, the first --videos policy episodes as mp4 and the first
--record ones as npz (every executed action, the state observed before it, the steps that queried
a chunk: inference/rollout_episode.py) into a temporary folder renamed to --out at the end: --out
holds a whole report or nothing.
"""
import argparse
import concurrent.futures
import importlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from checkpoint.layout import WHICH
from inference import rollout_report
from inference.rollout_episode import ARMS, Episode, EpisodeError, Plan, close_worker, init_worker, run_episode
from inference.rollout_server import RolloutError, ServerProcess, observation_roles

if TYPE_CHECKING:
    from data.sim_env import SimTask

log = logging.getLogger("rollout")

DEFAULT_VIDEOS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="a data.sim_env task: transfer_cube, insertion or pusht")
    policy = p.add_mutually_exclusive_group(required=True)
    policy.add_argument("--checkpoint", help="serve this checkpoint (python -m inference.serve) for the rollout")
    policy.add_argument("--policy", help="a running policy server, ws://HOST:PORT")
    p.add_argument("--which", choices=WHICH, default=None,
                   help="with a run folder as --checkpoint: latest (default) or best (the run's `best` file)")
    p.add_argument("--episodes", type=int, required=True)
    p.add_argument("--out", required=True, help="a new or empty folder for the report")
    p.add_argument("--seed", type=int, default=None, help="first evaluation seed (default: the first of EVAL_SEEDS)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: the machine's cores)")
    p.add_argument("--replan", type=int, default=None, help="steps executed per chunk (default: the whole chunk)")
    p.add_argument("--steps", type=int, default=None, help="episode cap (default: the task's registered cap)")
    p.add_argument("--videos", type=int, default=DEFAULT_VIDEOS, help="mp4s of the first N policy episodes")
    p.add_argument("--record", type=int, default=0,
                   help="npz of the first N policy episodes: executed actions, observed states, query steps")
    p.add_argument("--baselines", default=None,
                   help="comma-separated of hold, expert (default: expert,hold for ALOHA, hold for pusht; '' for none)")
    p.add_argument("--device", default="cpu", help="the served checkpoint's device (with --checkpoint)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for inference.serve (with --checkpoint)")
    return p.parse_intermixed_args(argv)


def check_args(args: argparse.Namespace, task: "SimTask") -> tuple[list[int], list[str]]:
    """The run's seeds and baselines; RolloutError / SimTaskError for values that cannot work."""
    from data.sim_env import EVAL_SEEDS, check_seeds

    if args.episodes < 1:
        raise RolloutError(f"--episodes must be at least 1, got {args.episodes}")
    if args.workers is not None and args.workers < 1:
        raise RolloutError(f"--workers must be at least 1, got {args.workers}")
    if args.steps is not None and not 1 <= args.steps <= task.max_steps:
        raise RolloutError(f"--steps must lie in [1, {task.max_steps}] (task {task.name!r} is registered with "
                           f"{task.max_steps} steps), got {args.steps}")
    for flag, n in (("--videos", args.videos), ("--record", args.record)):
        if n < 0:
            raise RolloutError(f"{flag} must be >= 0, got {n}")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise RolloutError(f"--checkpoint '{args.checkpoint}' is not a folder; expected a checkpoint_step_N folder, "
                           "a run folder or an exported folder")
    if args.which is not None and args.checkpoint is None:
        raise RolloutError(f"--which {args.which} picks the checkpoint this command serves: it needs --checkpoint")
    if args.overrides and args.checkpoint is None:
        raise RolloutError(f"overrides {args.overrides} go to the server this command starts: they need --checkpoint")
    start = EVAL_SEEDS.start if args.seed is None else args.seed
    seeds = list(range(start, start + args.episodes))
    check_seeds(seeds, EVAL_SEEDS, "evaluation")
    default = "expert,hold" if task.module == "gym_aloha" else "hold"
    names = [b for b in (default if args.baselines is None else args.baselines).split(",") if b]
    bad = [b for b in names if b not in ARMS[1:]]
    if bad:
        raise RolloutError(f"--baselines {bad}: expected a comma-separated list of {', '.join(ARMS[1:])}")
    if "expert" in names and task.module != "gym_aloha":
        raise RolloutError(f"the expert baseline replays data.aloha_expert, ALOHA tasks only; task {task.name!r} "
                           "has none (use --baselines hold)")
    if "expert" in names:
        try:
            importlib.import_module("data.aloha_expert")
        except ImportError as e:
            raise RolloutError(f"the expert baseline needs data.aloha_expert ({e}); run without it: --baselines hold")
    return seeds, names


def check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise RolloutError(f"--out '{out}' exists and is not an empty folder; choose a new folder (nothing "
                           "of yours is overwritten)")


def connect(uri: str, where: str) -> dict[str, Any]:
    """The server's metadata (one connection through openpi-client, closed again); `where` names the server."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from websockets.exceptions import WebSocketException

    try:
        client = WebsocketClientPolicy(uri)
    except (OSError, ValueError, WebSocketException) as e:  # refused, unreachable, not a ws:// address or server
        raise RolloutError(f"cannot connect to the policy server {where} ({type(e).__name__}: {e})") from None
    meta = client.get_server_metadata()
    client._ws.close()  # openpi-client has no close(); the workers open their own connections
    return meta


def run_episodes(plan: Plan, jobs: list[tuple[str, int, str | None, str | None]], workers: int) -> list[Episode]:
    """jobs: [(arm, seed, video path or None, record path or None)] -> Episodes in job order. One worker runs in this process
    (debuggable, and what tests monkeypatch); more run in spawned processes, each with its own env."""
    if workers == 1:
        init_worker(plan, ignore_sigint=False)
        try:
            return [run_episode(*job) for job in jobs]
        finally:
            close_worker()
    ctx = multiprocessing.get_context("spawn")  # no forked EGL context or server connection
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker, initargs=(plan,))
    try:
        futures = [pool.submit(run_episode, *job) for job in jobs]
        done = [f.result() for f in futures]
    except BaseException as e:  # an episode failed or Ctrl-C: the other workers stop now, not after their episodes
        workers_left = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers_left:
            proc.terminate()
            proc.join(30)
        if isinstance(e, concurrent.futures.process.BrokenProcessPool):
            raise RolloutError(f"a worker process died ({e}); --workers 1 runs the episodes in this process and "
                               "shows why") from None
        raise
    pool.shutdown(wait=True)
    return done


def rollout(args: argparse.Namespace, tmp: str, argv: list[str]) -> dict[str, Any]:
    """Run everything into the folder `tmp`; returns the report. `argv`: the command line, for the report."""
    from data.sim_env import get_task

    started = time.perf_counter()
    task = get_task(args.task)
    seeds, baselines = check_args(args, task)
    server = None
    try:
        if args.checkpoint is not None:
            server = ServerProcess(args.checkpoint, os.path.join(tmp, "server.log"), args.device, args.overrides,
                                   args.which or "latest")
            log.info("starting the policy server: %s", " ".join(server.cmd))
            uri = server.start()
            where = f"for --checkpoint {args.checkpoint}"
        else:
            uri, where = args.policy, f"at {args.policy}"
        meta = connect(uri, where)
        roles, image_size = observation_roles(task, meta, where)
        chunk = int(meta["action_shape"][0])
        replan = chunk if args.replan is None else args.replan
        if not 1 <= replan <= chunk:
            raise RolloutError(f"--replan must lie in [1, {chunk}] (the server's action chunk), got {replan}")
        steps = args.steps or task.max_steps
        plan = Plan(args.task, image_size, steps, replan, uri, roles)
        jobs = [("policy", s, os.path.join(tmp, f"policy_seed{s}.mp4") if k < args.videos else None,
                 os.path.join(tmp, f"policy_seed{s}.npz") if k < args.record else None) for k, s in enumerate(seeds)]
        jobs += [(b, s, None, None) for b in baselines for s in seeds]
        workers = min(args.workers or os.cpu_count() or 1, len(jobs))
        log.info("%d episodes (%s) on %d workers, seeds %d..%d", len(jobs), ", ".join(["policy", *baselines]),
                 workers, seeds[0], seeds[-1])
        done = run_episodes(plan, jobs, workers)
    finally:
        if server is not None:
            server.stop()
    by_arm = {arm: [e for e in done if e.arm == arm] for arm in ["policy", *baselines]}
    task_key = {"image": task.image_key, "state": task.state_key, "prompt": "instruction"}
    report = {
        "task": task.name, "gym_id": task.gym_id, "success_rule": task.success, "instruction": task.instruction,
        "episodes": len(seeds), "seeds": seeds, "steps": steps, "replan": replan, "action_chunk": chunk,
        "image_size": list(image_size), "workers": workers,
        "policy": {"uri": uri, "checkpoint": meta.get("checkpoint"), "config_hash": meta.get("config_hash"),
                   "weights": meta.get("weights"),
                   "server_started_by_rollout": server is not None,
                   "num_inference_timesteps": meta.get("num_inference_timesteps")},
        "observation_map": {task_key[role]: key for key, role in roles.items()},
        "results": {arm: rollout_report.summarise(eps) for arm, eps in by_arm.items()},
        "time_split": rollout_report.time_split(by_arm["policy"]),
        "wall_s": time.perf_counter() - started,
        "command": ["python", "-m", "inference.rollout", *argv],
    }
    rollout_report.write(tmp, report, by_arm)
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from data.sim_env import SimTaskError

    out = os.path.abspath(args.out)
    try:
        check_out(out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial_", dir=os.path.dirname(out))
    except (RolloutError, OSError) as e:
        sys.exit(f"rollout failed: {e}")
    try:
        report = rollout(args, tmp, sys.argv[1:] if argv is None else list(argv))
        check_out(out)  # still free: nothing appeared there while the episodes ran
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except (RolloutError, SimTaskError, EpisodeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"rollout failed: {e}")
    except KeyboardInterrupt:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit("rollout interrupted: the workers and any server this command started are stopped; "
                 "nothing was written")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pol = report["results"]["policy"]
    lo, hi = pol["wilson_95"]
    parts = [f"policy {pol['successes']}/{pol['episodes']} = {100 * pol['success_rate']:.1f}% "
             f"(95% CI {100 * lo:.1f}-{100 * hi:.1f}%)"]
    parts += [f"{a} {100 * s['success_rate']:.1f}%" for a, s in report["results"].items() if a != "policy"]
    parts += [f"simulator {100 * report['time_split']['simulator_fraction']:.1f}% of episode time", f"report in {out}"]
    print(f"{report['task']} on {report['episodes']} seeds: " + "; ".join(parts))
    return report


if __name__ == "__main__":
    main()
