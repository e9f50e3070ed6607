"""The checkpoint format version (checkpoint/manifest.py FORMAT): a checkpoint of any other format,
including one whose COMPLETE marker names no manifest, is refused with one message that says so."""
import hashlib
import json
import os

import pytest

from checkpoint import checkpointer as ck
from checkpoint.manifest import FORMAT, MANIFEST, CheckpointCorrupt, digest_files, list_files

GOOD = {"weights_finite": True, "loss_finite": True}


def checkpoint(tmp_path, step=2):
    path = tmp_path / "run" / f"checkpoint_step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    ck.seal(str(path), step, digest_files(str(path), list_files(str(path), ck.NOT_LISTED)), GOOD, 1)
    return str(path)


def test_a_sealed_checkpoint_is_whole_and_healthy(tmp_path):
    path = checkpoint(tmp_path)
    assert ck.verify(path) == [] and ck.saved_health(path) == GOOD and ck._healthy(path)
    assert json.loads(open(os.path.join(path, MANIFEST)).read())["format"] == FORMAT == 2


def test_another_format_is_one_clear_error(tmp_path):
    path = checkpoint(tmp_path)
    raw = open(os.path.join(path, MANIFEST)).read().replace(f'"format": {FORMAT}', '"format": 1')
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write(raw)
    with open(os.path.join(path, ck.MARKER), "w") as f:  # the marker names the new manifest's checksum
        f.write(f"2\nmanifest {hashlib.sha256(raw.encode()).hexdigest()}\n")
    expected = "checkpoint format 1, and this code reads format 2 only"
    assert expected in ck.verify(path)[0]
    assert ck.saved_health(path) is None and not ck._healthy(path)  # no readable record: not taken as healthy
    with pytest.raises(CheckpointCorrupt, match=expected):
        ck.resolve_resume_path(path, None)


def test_a_marker_without_a_manifest_is_refused(tmp_path):
    path = checkpoint(tmp_path)
    with open(os.path.join(path, ck.MARKER), "w") as f:
        f.write("2\n")  # what a checkpoint without a manifest would hold
    with pytest.raises(CheckpointCorrupt, match="checkpoint format 'none named', and this code reads format 2 only"):
        ck.read_marker(path)
    with pytest.raises(CheckpointCorrupt, match="none of the 1 complete checkpoints"):
        ck.resolve_resume_path(os.path.dirname(path), None)
