import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def one_thread():
    """Tiny matrices: one intra-op thread avoids oversubscribing the shared cores (10x faster when busy)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_yaml(tmp_path_factory):
    """tests/helpers.TINY_YAML as a file; its frozen parts, built by the first test that needs them, serve
    every test file of the session (test_models, test_encoders_cache, test_fake_cuda)."""
    from tests.helpers import TINY_YAML

    root = tmp_path_factory.mktemp("tiny")
    path = root / "tiny.yaml"
    path.write_text(TINY_YAML.format(d=root / "assets"))
    return str(path)


# scripts/test.sh runs the suite on 2 pytest-xdist workers (a launch's imports and a 1-process run
# each use one core, and leave the other idle). A test file runs whole on one worker: its module
# fixtures (a file's shared training runs) are built once. The files that start the local Slurm
# cluster or the two network-namespace hosts share fixed names (wm-node0/1, munge, job ids in
# logs/), so they run on one worker, one after the other.
ONE_CLUSTER = {"test_launch_slurm.py", "test_launch_multinode.py"}


# The longest files start first, so that the two workers finish together instead of one running
# test_train.py alone at the end.
LONGEST_FIRST = ["test_train.py", "test_launch_slurm.py", "test_launch_multinode.py", "test_resume_edits.py",
                 "test_faults.py", "test_config.py", "test_checkpoint_convert.py", "test_optim_zero.py",
                 "test_motus.py", "test_speed.py"]


def pytest_collection_modifyitems(config, items):
    def name(item):
        return os.path.basename(str(item.fspath))

    items.sort(key=lambda item: LONGEST_FIRST.index(name(item)) if name(item) in LONGEST_FIRST else len(LONGEST_FIRST))
    for item in items:
        item.add_marker(pytest.mark.xdist_group("cluster" if name(item) in ONE_CLUSTER else name(item)))
