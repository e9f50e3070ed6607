"""Crash-safe training checkpoints: write under a temporary name, list every file with its checksum,
mark complete, rename.

Layout of `{run_dir}/checkpoint_step_{N}/`: one file or folder per part of the run's state, each
registered once with a checkpoint.state.Registry (train/train.py registers them; this module does not
know what they are), then
  MANIFEST.json      every file of the parts with its size and checksum, the number of ranks that wrote
                     them, and whether the weights and the last loss were finite (checkpoint/manifest.py)
  COMPLETE           written last, before the rename: the step and the manifest's checksum
`{run_dir}/latest` names the newest complete checkpoint; `{run_dir}/best` the one with the highest
closed-loop success, when checkpoints were evaluated (checkpoint/evaluations.py): retention keeps it.

A save that fails on any rank (a full disk) fails on every rank with one CheckpointSaveError,
after the partial folder is removed; older checkpoints and `latest` are never touched.
"""
import contextlib
import errno
import glob
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

import torch
from omegaconf import DictConfig

from checkpoint import disk, evaluations
from checkpoint.layout import MARKER, PREFIX, WHICH, complete_checkpoints, is_complete, step_of
from checkpoint.manifest import (MANIFEST, CheckpointCorrupt, FileRecord, check_digests, check_format, check_sizes,
                                 digest_files, list_files, manifest_bytes, read_manifest, share)
from checkpoint.state import PER_RANK_PATTERN, Registry
from checkpoint.zero import shard_rank
from utils import dist

NOT_LISTED = (MANIFEST, MARKER)
"""The files of a checkpoint its manifest cannot list: written after it."""
log = logging.getLogger("checkpoint")
T = TypeVar("T")
SaveFailure = tuple[int, int | None, str]
"""How a save failed on one rank: (rank, errno or None, "ExceptionType: message")."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; raised on every rank, after the partial save was removed."""


# --- verification --------------------------------------------------------------------------------
def read_marker(path: str) -> tuple[int | None, str]:
    """(step, manifest digest) of a checkpoint, from its COMPLETE marker."""
    where = os.path.join(path, MARKER)
    with open(where, errors="replace") as f:
        lines = f.read().split("\n")
    if lines[0].strip() != str(step_of(path)):
        raise CheckpointCorrupt(f"{where}: says step {lines[0].strip()!r}, the folder is step {step_of(path)}")
    for line in lines[1:]:
        if line.startswith("manifest "):
            return step_of(path), line.split()[1]
        if line.strip():
            raise CheckpointCorrupt(f"{where}: unexpected line {line.strip()[:40]!r} (the marker is damaged)")
    check_format(where, "none named")  # every format this code reads names its manifest here: this raises
    raise AssertionError(f"{where}: check_format accepted a marker that names no manifest")


def not_listed(path: str) -> list[str]:
    """The files of checkpoint `path` its manifest does not list: NOT_LISTED and an evaluation's records,
    written into the sealed folder later (checkpoint/evaluations.py)."""
    return [*NOT_LISTED, *(rel for rel in list_files(path) if evaluations.added_after_save(rel))]


def quick_check(path: str) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest or None when it cannot be read, problems) without reading the files' contents."""
    try:
        _, digest = read_marker(path)
        manifest = read_manifest(path, digest)
        return manifest, check_sizes(path, manifest, not_listed(path))
    except (CheckpointCorrupt, OSError, ValueError) as e:
        return None, [str(e)]


def verify(path: str, index: int = 0, count: int = 1) -> list[str]:
    """Problems of checkpoint `path` (empty: it is whole). With `count` readers, this one checksums
    its share of the files; call `verify_together` to have every rank check its own share."""
    manifest, problems = quick_check(path)
    if manifest is None or problems:
        return problems
    try:
        return check_digests(path, manifest, share(manifest["files"], index, count))
    except OSError as e:
        return [f"{path}: a file cannot be read ({e})"]


def _gather(obj: T) -> list[T]:
    """`obj` of every rank, on every rank (a list), or [obj] without a process group."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def verify_together(path: str) -> list[str]:
    """Collective: every rank checksums a share of the files; all get every problem."""
    return sorted({p for problems in _gather(verify(path, dist.rank(), dist.world_size())) for p in problems})


def saved_health(path: str) -> dict[str, bool] | None:
    """{"weights_finite", "loss_finite"} recorded at save time, or None when the manifest cannot be read."""
    manifest, _ = quick_check(path)
    return manifest["health"] if manifest else None


def saved_world_size(path: str) -> int:
    """The number of ranks that wrote checkpoint `path` (its manifest records it)."""
    manifest, problems = quick_check(path)
    if manifest is None:
        raise CheckpointCorrupt(problems[0])
    return int(manifest["world_size"])


def _healthy(path: str) -> bool:
    """Weights and last loss finite at save time; a checkpoint without a readable record is not."""
    h = saved_health(path)
    return h is not None and h["weights_finite"] and h["loss_finite"]


def _warn(message: str) -> None:
    if dist.is_main():
        log.warning("%s", message)


def newest_verified(run_dir: str) -> str | None:
    """Collective. The newest complete checkpoint that passes verification, preferring those whose
    weights and last loss were finite; None when the run has no complete checkpoint. Skipped ones
    are reported loudly; when none passes, CheckpointCorrupt says why for each."""
    found = complete_checkpoints(run_dir)[::-1]
    # saved after a non-finite step: last; a record that cannot be read is verified in turn, and fails loudly
    found = sorted(found, key=lambda p: saved_health(p) is not None and not _healthy(p))
    failures = []
    for path in found:
        problems = verify_together(path)
        if problems:
            failures.append(f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
            _warn(f"!!! checkpoint {path} FAILS VERIFICATION and is skipped: {'; '.join(problems[:3])}. "
                  "Check it with `python -m checkpoint verify`; an older checkpoint is used instead")
            continue
        if not _healthy(path):
            _warn(f"checkpoint {path} was saved after a step with a non-finite loss ({saved_health(path)}); "
                  "no newer checkpoint with finite loss and weights passes verification")
        return path
    if failures:
        raise CheckpointCorrupt(f"none of the {len(failures)} complete checkpoints of {run_dir} passes "
                                "verification: " + "; ".join(failures))
    return None


@overload
def resolve_resume_path(path: str, run_dir: None, key: str = ...) -> str: ...
@overload
def resolve_resume_path(path: str | None, run_dir: str, key: str = ...) -> str | None: ...
def resolve_resume_path(path: str | None, run_dir: str | None, key: str = "resume.checkpoint_path") -> str | None:
    """Collective. `auto` -> newest verified checkpoint of run `run_dir` (None if there is none); a run
    folder -> its newest verified checkpoint; a checkpoint folder -> itself, if complete and whole.
    Without a `run_dir` (an explicit path), `auto` is a folder of that name like any other.
    `key` names where the path came from in the errors (inference passes --checkpoint)."""
    if path is None:
        return None
    if path == "auto" and run_dir is not None:
        return newest_verified(run_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key} '{path}' does not exist")
    if step_of(path) is None:
        try:
            found = newest_verified(path)
        except CheckpointCorrupt as e:
            raise CheckpointCorrupt(f"{key} '{path}': {e}") from None
        if found is None:
            raise FileNotFoundError(f"{key} '{path}' holds no complete {PREFIX}N folder (no {MARKER} marker in "
                                    "any: their saves were interrupted)")
        return found
    if not is_complete(path):
        raise FileNotFoundError(f"{key} '{path}' has no {MARKER} marker: its save was interrupted; pick an "
                                "older checkpoint, or its run folder (or auto) for the newest one that is whole")
    problems = verify_together(path)
    if problems:
        raise CheckpointCorrupt(f"{key} '{path}' fails verification: {'; '.join(problems)}; pick an older "
                                "checkpoint, or its run folder (or auto) for the newest one that is whole")
    return path


def resolve_which(path: str, which: str, key: str) -> str:
    """Collective. A run folder -> its newest verified checkpoint (`latest`, as resolve_resume_path) or
    the checkpoint its `best` file names (checkpoint/evaluations.py), verified; a checkpoint folder ->
    itself, if complete and whole (`latest` only). `key` names the path in the errors."""
    if which not in WHICH:
        raise ValueError(f"--which {which!r}: expected one of {', '.join(WHICH)}")
    if which == "latest":
        return resolve_resume_path(path, None, key)
    if step_of(path) is not None:
        raise FileNotFoundError(f"--which best picks a checkpoint of a run folder, and {key} '{path}' is a "
                                "checkpoint folder: pass its run folder, or leave out --which")
    best = evaluations.read_best(path)
    if best is None:
        raise FileNotFoundError(f"{key} '{path}' has no `{evaluations.BEST}` file: no checkpoint of it has an "
                                f"evaluation report ({evaluations.EVAL_DIR}/{evaluations.REPORT}); evaluate them "
                                f"(python -m inference.follow {path} --once), or use --which latest")
    if not is_complete(best):  # retention keeps the best one: deleted or damaged by hand
        raise FileNotFoundError(f"{key} '{path}' --which best: `{evaluations.BEST}` names {os.path.basename(best)}, "
                                f"which {'has no ' + MARKER + ' marker' if os.path.isdir(best) else 'does not exist'}; "
                                "use --which latest, or name a checkpoint folder")
    return resolve_resume_path(best, None, key)


# --- saving --------------------------------------------------------------------------------------
def seal(folder: str, step: int, files: dict[str, Any], health: dict[str, bool], world_size: int) -> None:
    """Write the manifest of `files` ({rel: digest_files' record}, written by `world_size` ranks) and then
    the COMPLETE marker naming the manifest's checksum: the last two files of a checkpoint, in the order
    a reader relies on."""
    raw = manifest_bytes(step, files, health, world_size)
    disk.fsync_write(os.path.join(folder, MANIFEST), raw)
    disk.fsync_write(os.path.join(folder, MARKER), f"{step}\nmanifest {hashlib.sha256(raw).hexdigest()}\n")


def _owner(rel: str) -> int:
    """The rank that wrote file `rel` of a checkpoint (it checksums it)."""
    m = re.search(PER_RANK_PATTERN + "$", rel)
    if m:
        return int(m.group(1))
    return shard_rank(os.path.basename(rel)) or 0


def checkpoint_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, rel)) for rel in list_files(path))


class Checkpointer:
    """Saves and restores the registered parts of a run (checkpoint/state.py), crash-safe, and decides
    when the trainer saves (`maybe_save`)."""

    def __init__(self, run_dir: str, cfg: DictConfig, parts: Registry | None = None,
                 health: Callable[[int], dict[str, bool]] | None = None) -> None:
        """`cfg`: the run's config (system.save_interval, system.total_limit: the retention). `parts`:
        what a checkpoint holds; `health(step)`: what the save of `step` records in its manifest
        ({"weights_finite", "loss_finite"}), raising instead when it must not be saved. `save` and
        `load` also take their parts explicitly."""
        self.run_dir = run_dir
        self.cfg = cfg
        self.parts = parts if parts is not None else Registry()
        self.health = health

    def due(self, step: int, last: bool, preempted: bool) -> bool:
        """A save is due after update `step`: a multiple of system.save_interval, the last one, or the
        run was preempted."""
        return step % self.cfg.system.save_interval == 0 or last or preempted

    def maybe_save(self, step: int, last: bool, preempted: bool) -> str | None:
        """Collective. Save the registered parts after update `step` when it is `due`; the saved
        folder, else None."""
        if not self.due(step, last, preempted):
            return None
        assert self.health is not None, "maybe_save needs the health callable given at construction"
        path = self.save(step, self.parts, self.health(step))
        log.info("saved %s", path)
        return path

    def remove_interrupted_saves(self) -> None:
        """Temporary folders of saves that were killed: never loadable, safe to delete (rank 0)."""
        if dist.is_main():
            for tmp in glob.glob(os.path.join(self.run_dir, f".tmp_{PREFIX}*")) + \
                    glob.glob(os.path.join(self.run_dir, f".trash_{PREFIX}*")):
                shutil.rmtree(tmp, ignore_errors=True)
            for tmp in glob.glob(os.path.join(self.run_dir, f".{evaluations.BEST}.*")):  # update_best's
                os.remove(tmp)
            if os.path.exists(os.path.join(self.run_dir, "latest.tmp")):
                os.remove(os.path.join(self.run_dir, "latest.tmp"))

    def save(self, step: int, parts: Registry, health: dict[str, bool]) -> str:
        """Collective: call on every rank. Every part of `parts` writes its files; `health`:
        {"weights_finite", "loss_finite"} (the same on every rank), recorded in the manifest."""
        final = os.path.join(self.run_dir, f"{PREFIX}{step}")
        if is_complete(final):  # a rewound run reached a step saved before: keep what is on disk
            if dist.is_main():
                print(f"checkpoint: {final} already exists and is kept as it is", flush=True)
            return final
        tmp = os.path.join(self.run_dir, f".tmp_{PREFIX}{step}")
        self.warn_if_short_of_space(step)
        self._together(step, tmp, self._prepare, tmp)
        self._together(step, tmp, self._write, tmp, parts)
        files = {}
        for part in self._together(step, tmp, self._digest_own, tmp):
            files.update(part)
        self._together(step, tmp, self._commit, tmp, final, step, files, health)
        if dist.is_main():
            self._apply_retention(keep=final)
            self.warn_if_short_of_space(step + 1, after=final)
        return final

    def _together(self, step: int, tmp: str, fn: Callable[..., T], *args: Any) -> list[T]:
        """Run `fn` on every rank; if it raises on any rank, every rank raises CheckpointSaveError
        (the gather is the agreement, and the barrier). Returns every rank's result."""
        try:
            result, error = fn(*args), None
        except Exception as e:  # noqa: BLE001 (torch.save reports a full disk as a RuntimeError)
            result, error = None, (dist.rank(), getattr(e, "errno", None), f"{type(e).__name__}: {e}")
        outcomes = _gather((result, error))
        errors = [e for _, e in outcomes if e is not None]
        if not errors:
            return [cast(T, r) for r, _ in outcomes]  # no rank failed: each returned its result
        message = self._failure_message(step, tmp, errors) if dist.is_main() else ""
        raise CheckpointSaveError(message)

    def _failure_message(self, step: int, tmp: str, errors: list[SaveFailure]) -> str:
        """Remove the partial save (rank 0) and say what happened, in one message."""
        written = checkpoint_size(tmp) if os.path.isdir(tmp) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(os.path.join(self.run_dir, "latest.tmp")):
            os.remove(os.path.join(self.run_dir, "latest.tmp"))
        previous = complete_checkpoints(self.run_dir)
        needed = checkpoint_size(previous[-1]) if previous else 0
        free = shutil.disk_usage(self.run_dir).free
        full = any(code in (errno.ENOSPC, errno.EDQUOT) or disk.looks_full(text) for _, code, text in errors)
        kept = (f"the partial save was removed; the older checkpoints and `latest` "
                f"({previous[-1] if previous else 'none yet'}) are untouched")
        if full or free < max(needed, written):
            need = f"about {disk.gb(needed)}" if needed else f"more than the {disk.gb(written)} written before it failed"
            return (f"no space left on {disk.device_of(self.run_dir)} while saving {PREFIX}{step} to "
                    f"{self.run_dir}: it needs {need}, {disk.gb(free)} free; {kept}. Free space (or lower "
                    "system.total_limit) and resume with resume.checkpoint_path=auto")
        rank, _, text = errors[0]
        return (f"could not write {PREFIX}{step} to {self.run_dir} (rank {rank}: {text}); {kept}. "
                "Resume with resume.checkpoint_path=auto once the file system is fixed")

    def _prepare(self, tmp: str) -> None:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def _write(self, tmp: str, parts: Registry) -> None:
        for name, part in parts:
            part.save(os.path.join(tmp, name))

    def _digest_own(self, tmp: str) -> dict[str, FileRecord]:
        """Checksums of the files this rank wrote (its page cache holds them), all ranks at once."""
        rank = dist.rank()
        return digest_files(tmp, [rel for rel in list_files(tmp, NOT_LISTED) if _owner(rel) == rank])

    def _commit(self, tmp: str, final: str, step: int, files: dict[str, FileRecord],
                health: dict[str, bool]) -> None:
        if not dist.is_main():
            return
        seal(tmp, step, files, health, dist.world_size())
        # `latest` is prepared before the rename: after it, nothing is left to write
        disk.fsync_write(os.path.join(self.run_dir, "latest.tmp"), os.path.basename(final) + "\n")
        os.replace(tmp, final)  # the save has succeeded: `auto` finds complete checkpoints by name
        try:
            os.replace(os.path.join(self.run_dir, "latest.tmp"), os.path.join(self.run_dir, "latest"))
        except OSError as e:
            log.warning("%s is saved, but `latest` could not be updated (%s); it still names an older one",
                        final, e)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.run_dir, "latest.tmp"))

    def warn_if_short_of_space(self, step: int, after: str | None = None) -> None:
        """Warn (rank 0) when the free space is less than the newest checkpoint's size."""
        if not dist.is_main():
            return
        found = complete_checkpoints(self.run_dir)
        if not found:
            return
        needed, free = checkpoint_size(found[-1]), shutil.disk_usage(self.run_dir).free
        if free < needed:
            when = "the next save" if after else f"the save of {PREFIX}{step}"
            log.warning("only %s free on %s but %s takes %s: %s will likely fail; free space or lower "
                        "system.total_limit", disk.gb(free), disk.device_of(self.run_dir),
                        os.path.basename(found[-1]), disk.gb(needed), when)

    def _protected(self, keep: str) -> set[str]:
        """Never deleted: the checkpoint just written; the newest whose weights and loss were finite and
        whose files are all there (or, when none, the newest whose weights were finite); the one with the
        best evaluation (checkpoint/evaluations.py). Nor those being evaluated: `_apply_retention` asks
        each just before deleting it."""
        found = complete_checkpoints(self.run_dir)[::-1]
        whole = [p for p in found if not quick_check(p)[1]]
        good = [p for p in whole if _healthy(p)] or [p for p in whole if (saved_health(p) or {}).get("weights_finite")]
        best = evaluations.best_checkpoint(self.run_dir)
        return {keep, *good[:1], *([best] if best else [])}

    def _apply_retention(self, keep: str) -> None:
        """Keep the newest `total_limit` checkpoints (and the protected ones). A failure here is a
        warning: the new checkpoint is complete, and the next save tries again."""
        limit = self.cfg.system.total_limit
        try:
            found = complete_checkpoints(self.run_dir)
            excess = len(found) - limit if limit else 0
            protected = self._protected(keep) if excess > 0 else set()
            for old in found:
                if excess <= 0:
                    break
                # asked last: an evaluation may have begun since the checks above
                if old in protected or evaluations.is_being_evaluated(old):
                    continue
                # rename first: a crash during the delete must not leave a half-deleted "complete" folder
                trash = os.path.join(self.run_dir, f".trash_{os.path.basename(old)}")
                os.replace(old, trash)
                shutil.rmtree(trash, ignore_errors=True)
                excess -= 1
        except OSError as e:
            log.warning("retention could not delete an old checkpoint of %s (%s); it is retried at the next "
                        "save", self.run_dir, e)
        try:
            evaluations.update_best(self.run_dir)
        except OSError as e:
            log.warning("`best` of %s could not be updated (%s); it is retried at the next save", self.run_dir, e)

    def load(self, path: str, parts: Registry | None = None) -> None:
        """Collective: restore every part of `parts` (default: the registered ones) registered to be restored,
        in registration order. `path` comes from resolve_resume_path, which verified every file's checksum."""
        world_size = saved_world_size(path)
        for name, part in (parts if parts is not None else self.parts).restored():
            part.load(os.path.join(path, name), world_size)
