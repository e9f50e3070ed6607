"""The manifest of a checkpoint: every file it holds, with its size and checksum, and whether its
weights and loss were finite when it was saved.

`MANIFEST.json` is written after every other file and before the `COMPLETE` marker, which records
the manifest's own checksum: a damaged or missing manifest is found like any damaged file.
A file's checksum is the SHA-256 of the SHA-256 digests of its 16 MiB chunks, so that the chunks
of one large file (the model states) are hashed by several threads at once.
"""
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Collection, Sequence

MANIFEST = "MANIFEST.json"
FORMAT = 2
"""The checkpoint format: what a checkpoint_step_N folder holds (this manifest with the world size that
wrote it, the COMPLETE marker naming its checksum, one file or folder per registered part: train/train.py
`checkpoint_parts`). A reader accepts this format only; change the number whenever the folder's contents
change meaning. 2: the parts of checkpoint/state.py (trainer_state.json, data.json, schedule.json, rng/,
engine/ with a zero_layout.json without world size); the world size in the manifest only."""
ALGORITHM = "sha256-of-16MiB-chunk-sha256"
CHUNK = 16 << 20
THREADS = max(1, min(8, os.cpu_count() or 1))
FileRecord = dict[str, Any]
"""One file of a manifest: {"size": bytes, "sha256": hex digest}."""


class CheckpointCorrupt(RuntimeError):
    """A checkpoint that fails verification; the message names the file and what is wrong."""


def list_files(root: str, skip: Collection[str] = ()) -> list[str]:
    """Every file under `root`, as sorted paths relative to it (those in `skip` left out)."""
    found = []
    for base, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), root)
            if rel not in skip:
                found.append(rel)
    return sorted(found)


def _chunk_digest(path: str, index: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(index * CHUNK)
        return hashlib.sha256(f.read(CHUNK)).digest()


def digest_files(root: str, rels: Sequence[str]) -> dict[str, FileRecord]:
    """{rel: {"size", "sha256"}} of the files `rels` under `root`, their chunks hashed in parallel."""
    sizes = {rel: os.path.getsize(os.path.join(root, rel)) for rel in rels}
    jobs = [(rel, i) for rel in rels for i in range(max(1, -(-sizes[rel] // CHUNK)))]
    with ThreadPoolExecutor(THREADS) as pool:  # hashlib releases the GIL on large buffers
        parts = list(pool.map(lambda job: _chunk_digest(os.path.join(root, job[0]), job[1]), jobs))
    chunks: dict[str, list[bytes]] = {}
    for (rel, _), part in zip(jobs, parts):
        chunks.setdefault(rel, []).append(part)
    return {rel: {"size": sizes[rel], "sha256": hashlib.sha256(b"".join(chunks[rel])).hexdigest()}
            for rel in rels}


def manifest_bytes(step: int, files: dict[str, FileRecord], health: dict[str, bool], world_size: int) -> bytes:
    return json.dumps({"format": FORMAT, "step": step, "world_size": world_size, "algorithm": ALGORITHM,
                       "health": health, "files": dict(sorted(files.items()))}, indent=1).encode()


def read_manifest(path: str, expected_digest: str) -> dict[str, Any]:
    """The manifest of checkpoint `path`, checked against the digest its COMPLETE marker records."""
    where = os.path.join(path, MANIFEST)
    try:
        with open(where, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointCorrupt(f"{where}: cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(raw).hexdigest() != expected_digest:
        raise CheckpointCorrupt(f"{where}: its checksum does not match the one in COMPLETE (the manifest "
                                "is damaged)")
    manifest = json.loads(raw)
    check_format(where, manifest.get("format"))
    if manifest.get("algorithm") != ALGORITHM:
        raise CheckpointCorrupt(f"{where}: checksum algorithm {manifest.get('algorithm')!r}; expected {ALGORITHM}")
    return manifest


def check_format(where: str, found: object) -> None:
    """The one check of a checkpoint's format version: anything but FORMAT is refused."""
    if found != FORMAT:
        raise CheckpointCorrupt(f"{where}: checkpoint format {found!r}, and this code reads format {FORMAT} only "
                                "(the checkpoint was written by another version of the recipe); load it with "
                                "the version that wrote it")


def check_sizes(path: str, manifest: dict[str, Any], skip: Collection[str]) -> list[str]:
    """Problems found without reading the files: missing, unexpected or of another size."""
    problems = []
    on_disk = set(list_files(path, skip))
    for rel, entry in manifest["files"].items():
        full = os.path.join(path, rel)
        if rel not in on_disk:
            problems.append(f"{full}: missing (the manifest lists it)")
        elif os.path.getsize(full) != entry["size"]:
            problems.append(f"{full}: {os.path.getsize(full)} bytes, the manifest says {entry['size']}")
    problems += [f"{os.path.join(path, rel)}: not in the manifest" for rel in sorted(on_disk - set(manifest["files"]))]
    return problems


def share(files: dict[str, FileRecord], index: int, count: int) -> list[str]:
    """The files that reader `index` of `count` checks: a size-balanced split, the same on every reader."""
    loads, mine = [0] * count, []
    for rel in sorted(files, key=lambda r: (-files[r]["size"], r)):
        who = loads.index(min(loads))
        loads[who] += files[rel]["size"]
        if who == index:
            mine.append(rel)
    return mine


def check_digests(path: str, manifest: dict[str, Any], rels: Sequence[str]) -> list[str]:
    """Checksum problems of the files `rels` (each of them is there with its size)."""
    actual = digest_files(path, rels)
    return [f"{os.path.join(path, rel)}: checksum mismatch (the file is damaged)"
            for rel in rels if actual[rel]["sha256"] != manifest["files"][rel]["sha256"]]
