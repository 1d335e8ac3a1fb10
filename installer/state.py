"""The appliance's record, `<prefix>/state.json`: a pydantic schema (unknown keys rejected), written atomically.

It holds the pinned trust root, every bundle ever installed, the rollback high-water mark per bundle name (the
highest version ever activated), the releases with their gate results, and which release is active. The file is
the commit point of every change: it is replaced whole (temp file, fsync, rename), so a crash leaves the old
record or the new one, never a mix. `current` follows it (see activate.reconcile).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envex.bundles import SemVer
from envex.bundles.files import one_line, read_regular_file, show
from envex.installer.fsutil import atomic_write

STATE_FILE = "state.json"
# state.json keeps 500 events, but every release and bundle ever installed: years of weekly installs are a few MB.
MAX_STATE_BYTES = 64 * 1024 * 1024

ReleaseStatus = Literal["installing", "gating", "passed", "failed", "abandoned", "removed"]


def now_ts() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StateError(ValueError):
    """state.json is unreadable or invalid; the message names the file and the first problem."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BundleRef(_Model):
    """One verified bundle, as recorded: enough to tell exactly which signed bytes were installed."""

    name: str
    kind: Literal["model", "runtime", "kernels"]
    version: str
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    signer_keyids: list[str] = Field(default_factory=list)


class InstalledBundle(BundleRef):
    installed_at: str
    release: str


class PinnedTrust(_Model):
    root_version: int = Field(ge=1)
    root_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    pinned_at: str


class CheckSummary(_Model):
    """The verdict of the gates (and the benchmark's headline numbers) of one release on this machine."""

    verdict: Literal["pass", "fail"]
    suite: str
    gates: dict[str, str]  # gate name -> "pass" | "fail" | "skip"
    report: str  # path of the full report, relative to the prefix
    bench: dict[str, float] = Field(default_factory=dict)
    finished_at: str
    reference: Literal["local", "signed"] | None = None  # what the gates were judged against (None: not recorded)


class Release(_Model):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    created: str
    status: ReleaseStatus
    bundles: list[BundleRef]
    mode: Literal["cpu", "cuda"]
    checks: CheckSummary | None = None
    message: str | None = None  # why it failed or was abandoned, for people


class Event(_Model):
    at: str
    event: Literal["install", "activate", "rollback", "fail", "abandon", "pin-root", "rotate-root"]
    release: str | None = None
    detail: str | None = None


class State(_Model):
    schema_version: Literal[1] = 1
    trust: PinnedTrust | None = None
    high_water: dict[str, str] = Field(default_factory=dict)
    bundles: list[InstalledBundle] = Field(default_factory=list)
    releases: list[Release] = Field(default_factory=list)
    active: str | None = None
    history: list[Event] = Field(default_factory=list)

    def release(self, release_id: str) -> Release | None:
        return next((r for r in self.releases if r.id == release_id), None)

    def with_release(self, release: Release) -> State:
        """A copy with `release` added, or replacing the one of the same id."""
        others = [r for r in self.releases if r.id != release.id]
        return self.model_copy(update={"releases": [*others, release]})

    def with_event(self, event: str, release: str | None = None, detail: str | None = None) -> State:
        entry = Event(at=now_ts(), event=event, release=release, detail=detail)  # type: ignore[arg-type]
        return self.model_copy(update={"history": [*self.history, entry][-500:]})

    def raised_high_water(self, bundles: list[BundleRef]) -> dict[str, str]:
        marks = dict(self.high_water)
        for ref in bundles:
            old = marks.get(ref.name)
            if old is None or SemVer.parse(ref.version) > SemVer.parse(old):
                marks[ref.name] = ref.version
        return marks

    def next_release_number(self) -> int:
        numbers = [int(r.id.split("-", 1)[0]) for r in self.releases if r.id.split("-", 1)[0].isdigit()]
        return max(numbers, default=0) + 1


_M = TypeVar("_M", bound=BaseModel)


def validate_json(cls: type[_M], data: bytes) -> _M:
    """Parse JSON bytes into a pydantic model; a failure is a ValueError whose message is one line: the first
    error's field path and message (or the JSON error)."""
    try:
        return cls.model_validate(json.loads(data))
    except ValueError as exc:
        if isinstance(exc, ValidationError) and exc.errors():
            first = exc.errors()[0]
            raise ValueError(one_line(".".join(str(p) for p in first["loc"])) + ": " + first["msg"]) from None
        raise ValueError(str(exc)) from None


def load_state(prefix: Path) -> State:
    """The prefix's state, or an empty one when no install has happened there yet."""
    path = Path(prefix) / STATE_FILE
    try:
        if not os.path.lexists(path):
            return State()
        data = read_regular_file(path, max_bytes=MAX_STATE_BYTES, what="state file")
    except OSError as exc:
        raise StateError(str(exc)) from None
    try:
        return validate_json(State, data)
    except ValueError as exc:
        raise StateError(
            f"{show(path)}: invalid ({one_line(str(exc))}); restore it from a backup or reinstall the prefix"
        ) from None


def save_state(prefix: Path, state: State) -> None:
    State.model_validate(state.model_dump())  # re-validate: a copy made with model_copy(update=) is not checked
    atomic_write(Path(prefix) / STATE_FILE, (state.model_dump_json(indent=2) + "\n").encode())
