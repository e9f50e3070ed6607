"""Test launcher: `python -m inference.follow` with a cheap stand-in for inference.rollout.

    python tests/fake_follow.py follow RUN_DIR [follow's flags]   # the real follower; its rollout command
                                                                # runs this file's `rollout` instead
    python tests/fake_follow.py rollout [inference.rollout's flags]

The stand-in takes the argv the real command would (checkpoint/evaluations.py rollout_command) and does
what inference.rollout does with its files: a temporary `.eval.partial_*` folder beside --out, renamed to
--out at the end, removed on Ctrl-C. It appends one JSON line per event ("start", "done", "stopped",
"failed", with the step and the argv) to $FAKE_EVENTS; $FAKE_PLAN maps a step to {"seconds", "success_rate"
or "fail"}. Kept under tests/: the product code has no hook for this.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def event(kind, step, argv):
    with open(os.environ["FAKE_EVENTS"], "a") as f:
        f.write(json.dumps({"event": kind, "step": step, "argv": argv}) + "\n")


def rollout(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--episodes", type=int, required=True)
    args, _ = p.parse_known_args(argv)
    step = int(args.checkpoint.rsplit("_", 1)[1])
    plan = json.loads(os.environ["FAKE_PLAN"])[str(step)]
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(args.out)}.partial_", dir=os.path.dirname(args.out))
    open(os.path.join(tmp, "server.log"), "w").write("serving on ws://127.0.0.1:1\n")
    try:  # "start" inside: a stop the test sends once it reads "start" always ends in "stopped"
        event("start", step, argv)
        time.sleep(plan["seconds"])
    except KeyboardInterrupt:
        shutil.rmtree(tmp)
        event("stopped", step, argv)
        sys.exit("rollout interrupted")
    if "fail" in plan:
        shutil.rmtree(tmp)
        event("failed", step, argv)
        sys.exit(f"rollout failed: {plan['fail']}")
    rate = plan["success_rate"]
    results = {"policy": {"success_rate": rate, "successes": round(rate * args.episodes), "episodes": args.episodes}}
    with open(os.path.join(tmp, "report.json"), "w") as f:
        json.dump({"results": results}, f)
    os.rename(tmp, args.out)
    event("done", step, argv)


def follow(argv):
    from checkpoint import evaluations
    from inference.follow import main

    real = evaluations.rollout_command
    evaluations.rollout_command = lambda ckpt, ev, python: [python, __file__, "rollout", *real(ckpt, ev, python)[3:]]
    main(argv)


if __name__ == "__main__":
    {"rollout": rollout, "follow": follow}[sys.argv[1]](sys.argv[2:])
