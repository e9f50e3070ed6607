"""Inspect checkpoints without loading them into a model.

    python -m checkpoint verify PATH     # a checkpoint_step_N folder or a run folder: every file's
                                         # size and checksum against the manifest; exit 1 on failure
    python -m checkpoint describe PATH   # what a checkpoint_step_N folder holds (ZeRO layout, state)
"""
import argparse
import glob
import os
import sys
from collections.abc import Sequence

from checkpoint.checkpointer import (PREFIX, complete_checkpoints, is_complete, quick_check, saved_health, step_of,
                                    verify)
from checkpoint.files import ENGINE_DIR
from checkpoint.zero import CheckpointConvertError, describe


def _report(path: str) -> bool:
    """One line about checkpoint `path`; True when it is complete and whole."""
    if not is_complete(path):
        print(f"INCOMPLETE  {path}: no COMPLETE marker (an interrupted save; resume never loads it)")
        return False
    problems = verify(path)
    if problems:
        print(f"FAILED      {path}:\n" + "\n".join(f"              {p}" for p in problems))
        return False
    health = saved_health(path) or {}  # verified: its manifest is readable
    flags = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in health.items())
    print(f"OK          {path}: every file matches the manifest ({flags})")
    return True


def verify_command(path: str) -> int:
    if step_of(path) is not None:
        return 0 if _report(path) else 1
    # a folder such as checkpoint_step_3.old has no step: it sorts first, and is not reported
    found = sorted(glob.glob(os.path.join(path, PREFIX + "*")), key=lambda p: step_of(p) or 0)
    if not found:
        print(f"{path}: neither a {PREFIX}N folder nor a run folder holding one")
        return 1
    ok = [_report(p) for p in found if step_of(p) is not None]
    usable = [p for p in complete_checkpoints(path) if not verify(p)]
    print(f"{sum(ok)} of {len(ok)} checkpoints are whole; the newest whole one: {usable[-1] if usable else 'none'}")
    return 0 if all(ok) else 1


def describe_command(path: str) -> int:
    if not os.path.isdir(os.path.join(path, ENGINE_DIR)):
        print(f"{path}: expected a {PREFIX}N folder with an {ENGINE_DIR}/ subfolder", file=sys.stderr)
        return 1
    manifest, _ = quick_check(path)  # it records the world size that wrote the checkpoint
    try:
        print(describe(path, manifest["world_size"] if manifest else None))
    except CheckpointConvertError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("verify", help="check sizes and checksums against the manifest").add_argument(
        "path", help="a checkpoint_step_N folder or a run folder")
    sub.add_parser("describe", help="what a checkpoint holds; checks every parameter can be rebuilt").add_argument(
        "path", help="a checkpoint_step_N folder")
    args = parser.parse_args(argv)
    command = verify_command if args.command == "verify" else describe_command
    return command(args.path.rstrip("/"))


if __name__ == "__main__":
    sys.exit(main())
