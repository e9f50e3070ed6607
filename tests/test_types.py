"""The type checker runs in the test command: mypy over the packages (mypy.ini) finds no error, and
every function there is annotated (disallow_untyped_defs)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_no_error():
    # the files and the level are mypy.ini's; its cache (.mypy_cache) makes a rerun take seconds
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "Success: no issues found" in out.stdout, out.stdout + out.stderr
