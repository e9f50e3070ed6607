"""TRAINING.md documents exactly the config keys the schema has."""
import re

from recipe.config_doc import render


def test_config_reference_matches_the_schema():
    text = open("TRAINING.md").read()
    block = re.search(r"<!-- config-reference:start -->\n(.*)<!-- config-reference:end -->", text, re.S)
    assert block, "TRAINING.md lost its generated config reference"
    assert block.group(1).strip() == render().strip(), \
        "TRAINING.md's config reference is stale: regenerate it with python -m recipe.config_doc"


def test_every_key_has_a_meaning():
    empty = [line for line in render().splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not empty, f"config keys without a docstring: {empty}"
