"""offline_docs/install.md's model card section says what the code does: its example is a valid `envex-model.json`,
its table names every field of the card, and the smoke test it says runs without a `smoke` entry is the gate
runner's default."""

from __future__ import annotations

import re
from pathlib import Path

from envex.installer.cards import ModelCard
from envex.installer.gate_runner import SMOKE_EXPECT, SMOKE_PROMPT

DOC = Path(__file__).resolve().parents[1] / "offline_docs" / "install.md"


def section() -> str:
    text = DOC.read_text()
    start = text.index("### The model card, `envex-model.json`")
    return text[start : text.index("\n## ", start)]


def test_the_example_card_is_valid() -> None:
    example = re.search(r"```json\n(.*?)```", section(), re.S)
    assert example is not None
    card = ModelCard.model_validate_json(example.group(1))
    assert card.format == "hf" and card.weights == "." and card.smoke is not None


def test_the_table_names_every_field() -> None:
    rows = [line for line in section().splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == set(ModelCard.model_fields)


def test_the_default_smoke_pair_is_the_gate_runners() -> None:
    text = " ".join(section().split())
    assert f"the prompt is `{SMOKE_PROMPT}` and the answer must contain `{SMOKE_EXPECT}`" in text
