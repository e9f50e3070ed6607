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
# each use one core, and leave the other idle), a test file per worker (--dist loadfile): its module
# fixtures (a file's shared training runs) are built once. The longest files start first, so that
# the two workers finish together instead of one running test_train.py alone at the end; the two
# files that bring up the local cluster (which take turns: tests.helpers.the_only_cluster) far apart.
LONGEST_FIRST = ["test_train.py", "test_launch_slurm.py", "test_resume_edits.py", "test_faults.py", "test_config.py",
                 "test_checkpoint_convert.py", "test_optim_zero.py", "test_motus.py", "test_speed.py",
                 "test_launch_multinode.py"]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
