"""Where every benchmark's JSON goes: `--out`, a file path (folders made as needed)."""
import json
import os
from typing import Any


def write_json(path: str, result: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written {path}")
