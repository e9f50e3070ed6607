"""Render the config schema as Markdown tables, one per section, from the dataclasses'
field docstrings, so TRAINING.md documents exactly the keys the code reads.

    python -m recipe.config_doc > /tmp/keys.md
"""
import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from recipe.schema import Config


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal that follows its definition in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    cls_def = tree.body[0]
    assert isinstance(cls_def, ast.ClassDef)
    body: list = cls_def.body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field[Any]) -> str | None:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return None
    return "null" if value is None else repr(value).replace("'", "")


def _rows(cls: Any, prefix: str) -> list[str]:  # a dataclass of recipe/schema.py (a Field's type is `type | str`)
    docs = _field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if default is None:
            nested.append((f.type, f"{prefix}{f.name}."))
            continue
        rows.append(f"| `{prefix}{f.name}` | `{default}` | {docs.get(f.name, '')} |")
    for sub, sub_prefix in nested:
        rows.extend(_rows(sub, sub_prefix))
    return rows


def render() -> str:
    out = []
    for f in dataclasses.fields(Config):
        out += [f"#### `{f.name}`", "", "| key | default | meaning |", "|---|---|---|", *_rows(f.type, f"{f.name}."), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
