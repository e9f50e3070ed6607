"""The import graph (README, "Imports go one way") and the cost of reading a recipe.

Layers, lowest first: utils; data, models, optim; recipe; checkpoint; train, inference. Library code
imports its own layer or lower, and the packages' import graph has no cycle. A command-line module's
`main()` is a program, not library code: like train/train.py it sits above every package and may
import any of them (read a recipe with recipe.config.load_config, build a model, write an export);
nothing imports a `main()`, so its imports are not edges of the graph. Still, no module imports one
that imports it back from another package, main() included: such a circle ties the two packages.
"""
import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"utils": 0, "data": 1, "models": 1, "optim": 1, "recipe": 2, "checkpoint": 3, "train": 4, "inference": 4}


def _functions_named_main(tree):
    return {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "main"
            for n in ast.walk(f)}


def library_imports():
    """(importing package, imported package, 'file:line') for every first-party import outside a main()."""
    found = []
    for package in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                in_main = _functions_named_main(tree)
                for node in ast.walk(tree):
                    if id(node) in in_main:
                        continue
                    if isinstance(node, ast.Import):
                        modules = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0:
                        modules = [node.module]
                    else:
                        continue
                    for module in modules:
                        top = module.split(".")[0]
                        if top in LAYERS and top != package:
                            found.append((package, top, f"{os.path.relpath(path, ROOT)}:{node.lineno}"))
    return found


def test_library_code_never_imports_upwards():
    upward = [f"{where}: {a} imports {b}" for a, b, where in library_imports() if LAYERS[b] > LAYERS[a]]
    assert not upward, "library code imports a higher layer:\n" + "\n".join(upward)


def test_no_cycle_among_the_packages():
    edges = {}
    for a, b, where in library_imports():
        edges.setdefault(a, {}).setdefault(b, where)
    done, path = set(), []

    def visit(node):
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(
                f"{x} ({edges[x][y]})" for x, y in zip(cycle, cycle[1:])))
        if node in done:
            return
        path.append(node)
        for nxt in edges.get(node, {}):
            visit(nxt)
        path.pop()
        done.add(node)

    for package in LAYERS:
        visit(package)
    # the graph is not empty: the parser sees the imports it checks
    assert {"utils", "models", "checkpoint"} <= set(edges.get("inference", {}))


def module_imports():
    """{module: {first-party modules it imports}}, every import of the file counted: a main()'s and
    a type-only one too."""
    modules = {}
    for package in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
                    modules[module.removesuffix(".__init__")] = path
    edges = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a module or a name in it
            else:
                continue
            edges.setdefault(module, set()).update(n for n in names if n in modules and n != module)
    return edges


def test_no_circle_between_modules_of_two_packages():
    edges = module_imports()

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, ()))
        return False

    circles = [f"{a} imports {b}, which imports {a} back" for a in sorted(edges) for b in sorted(edges[a])
               if a.split(".")[0] != b.split(".")[0] and reaches(b, a)]
    assert not circles, "modules of two packages import each other:\n" + "\n".join(circles)
    assert "models.folder" in edges["checkpoint.export"]  # the parser resolves `from x.y import name`


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The two rules above fail on a tree that breaks them (a copy of two packages, one import added)."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "utils" / "a.py").write_text("from data.x import y\n")
    (tmp_path / "data" / "b.py").write_text("import utils.a\n\ndef main():\n    from train.t import go\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    with pytest.raises(AssertionError, match="utils/a.py:1: utils imports data"):
        test_library_code_never_imports_upwards()
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_cycle_among_the_packages()
    (tmp_path / "models" / "c.py").write_text("def main():\n    from recipe.d import go\n")
    (tmp_path / "recipe" / "d.py").write_text("from models import c\n")
    with pytest.raises(AssertionError, match="models.c imports recipe.d, which imports models.c back"):
        test_no_circle_between_modules_of_two_packages()
    assert ("data", "train") not in {(a, b) for a, b, _ in library_imports()}  # main() is a program


HEAVY = ("torch", "av", "diffusers", "transformers")


def test_reading_a_recipe_loads_no_heavy_library():
    """Checking a YAML imports only the light `config` modules: no torch, PyAV, diffusers or transformers
    (each costs seconds; TRAINING.md has the import times)."""
    code = ("import json, sys\nfrom recipe.config import load_config\n"
            "for name in ('tiny', 'robotwin', 'latent_action', 'lerobot', 'motus_finetune_lerobot'):\n"
            "    load_config(f'configs/{name}.yaml')\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_allowed_names_match_what_implements_them():
    """The light lists in the config modules are the names the heavy modules implement."""
    from models.config import PROJECTOR_TYPES
    from models.experts import ADAPTERS
    from optim.config import NS_DTYPES
    from optim.newton_schulz import DTYPES

    assert PROJECTOR_TYPES == tuple(ADAPTERS) and NS_DTYPES == tuple(DTYPES)


def test_every_python_file_compiles_without_a_warning():
    """An invalid escape in a string ('\\.' outside a raw string) is a DeprecationWarning on Python 3.11
    and a SyntaxWarning from 3.12 (the GPU image printed one for optim/routing.py), and will become an
    error: every tracked file compiles with warnings raised."""
    import warnings

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 50
    bad = []
    for f in files:
        with open(os.path.join(ROOT, f)) as src, warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(src.read(), f, "exec")
            except (SyntaxError, DeprecationWarning, SyntaxWarning) as e:
                bad.append(f"{f}: {e}")
    assert bad == []
