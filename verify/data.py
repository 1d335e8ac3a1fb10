"""The authored data the gates run on (verify/data_*.json, written for this project; nothing is downloaded)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((_HERE / f"data_{name}.json").read_text(encoding="utf-8"))


def chat_prompts() -> list[str]:
    return list(_load("prompts")["prompts"])


def corpus_texts() -> list[str]:
    return list(_load("corpus")["texts"])


@dataclass(frozen=True)
class CodingTask:
    id: str
    entry_point: str
    prompt: str
    tests: str


def coding_tasks() -> list[CodingTask]:
    return [CodingTask(**t) for t in _load("coding_tasks")["tasks"]]


@dataclass(frozen=True)
class Needle:
    fact: str
    question: str
    answer: str


@dataclass(frozen=True)
class NeedleData:
    filler: tuple[str, ...]
    needles: tuple[Needle, ...]
    instruction: str
    question_suffix: str


def needle_data() -> NeedleData:
    d = _load("needle")
    return NeedleData(tuple(d["filler"]), tuple(Needle(**n) for n in d["needles"]), d["instruction"],
                      d["question_suffix"])


@dataclass(frozen=True)
class CodeEditTask:
    """A file to hand back whole with one small edit (speculative decoding's code-editing workload)."""

    id: str
    language: str
    filename: str
    instruction: str
    file: str

    @property
    def prompt(self) -> str:
        """The user's message: the edit, the file, and the request to hand all of it back."""
        return (f"{self.instruction} (`{self.filename}`)\n\n```{self.language}\n{self.file}```\n\n"
                "Rewrite the whole file with this change. Keep every other line exactly as it is.")

    @property
    def answer_prefix(self) -> str:
        """The start of the assistant's turn (after the chat template's generation prompt): the opened code block.
        SmolLM2-135M then copies the file (75% of its lines in a 150-token sample) instead of describing it."""
        return f"```{self.language}\n"


def code_edit_tasks() -> list[CodeEditTask]:
    return [CodeEditTask(**t) for t in _load("code_edit")["tasks"]]
