"""The bundle manifest: what a bundle holds and what it needs, as pydantic models that validate in their constructor.

A manifest that exists is valid: paths are safe relative POSIX paths, digests are sha256 hex, versions are
semantic versions, files are sorted and unique, unknown keys are refused. Its byte form is canonical JSON
(`Manifest.to_bytes`), and `Manifest.from_bytes` accepts only that form, so signatures cover one meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import total_ordering
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from envex.bundles.canonical import CanonicalJSONError, canonical_bytes, parse_json

SCHEMA_VERSION = 1
KINDS = ("model", "runtime", "kernels")
Kind = Literal["model", "runtime", "kernels"]

MAX_FILES = 200_000
MAX_FILE_SIZE = 1 << 50  # 1 PiB: larger is a lie, not a model
MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255
MAX_PATH_DEPTH = 64

# Portable file-name characters: what wheels, Triton caches and HF model repos use. Anything else (spaces,
# backslashes, colons, control characters, non-ASCII) is refused rather than interpreted.
_COMPONENT = re.compile(r"[A-Za-z0-9_.+=@,~!%-]+")
# re.ASCII throughout: in str patterns \d and \s would otherwise match any Unicode digit or space ("١.٠.٠").
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?",
    re.ASCII,
)
_TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", re.ASCII)
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ACCELERATOR = re.compile(r"[a-z][a-z0-9_]{0,31}")  # sm_90, sm_90a, gfx942, cpu
_DRIVER = re.compile(r"\d{1,5}(\.\d{1,5}){0,3}", re.ASCII)
_SPEC_CHARS = re.compile(r"[0-9A-Za-z.,<>=!~*+ ]{1,128}")


def unsafe_path_reason(path: str) -> str | None:
    """Why `path` is not a safe relative POSIX path inside a bundle, or None when it is safe."""
    if not path:
        return "empty path"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"longer than {MAX_PATH_BYTES} bytes"
    if path.startswith("/"):
        return "absolute path"
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        return f"deeper than {MAX_PATH_DEPTH} components"
    for part in parts:
        if part in ("", "."):
            return "empty or '.' path component"
        if part == "..":
            return "'..' path component"
        if len(part) > MAX_COMPONENT_BYTES:
            return f"component longer than {MAX_COMPONENT_BYTES} bytes"
        if not _COMPONENT.fullmatch(part):
            return f"component {part!r} has characters outside [A-Za-z0-9_.+=@,~!%-]"
    return None


def _safe_path(path: str) -> str:
    reason = unsafe_path_reason(path)
    if reason is not None:
        raise ValueError(f"unsafe path {path!r}: {reason}")
    return path


def _pattern(regex: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


def parse_timestamp(value: str) -> datetime:
    """Parse our one timestamp form, `YYYY-MM-DDTHH:MM:SSZ`, as an aware UTC datetime."""
    if not _TIMESTAMP.fullmatch(value):
        raise ValueError(f"{value!r} is not a UTC timestamp of the form YYYY-MM-DDTHH:MM:SSZ")
    return datetime.strptime(value, _TIMESTAMP_FORMAT).replace(tzinfo=UTC)


def format_timestamp(value: datetime) -> str:
    """Format an aware datetime as `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds)."""
    if value.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return value.astimezone(UTC).strftime(_TIMESTAMP_FORMAT)


def _timestamp(value: str) -> str:
    parse_timestamp(value)
    return value


def _specifier(value: str) -> str:
    # PEP 440 specifiers ("==2.5.1", ">=3.11,<3.13"), checked by `packaging` so that the installer can evaluate them.
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not _SPEC_CHARS.fullmatch(value):
        raise ValueError(f"{value!r} is not a version specifier such as '>=3.11,<3.13'")
    try:
        SpecifierSet(value)
    except InvalidSpecifier as exc:
        raise ValueError(f"{value!r} is not a version specifier: {exc}") from None
    return value


SafePath = Annotated[str, AfterValidator(_safe_path)]
Sha256Hex = Annotated[str, _pattern(_SHA256, "a lowercase sha256 hex digest")]
BundleName = Annotated[str, _pattern(_NAME, "a bundle name ([a-z0-9][a-z0-9._-]{0,63})")]
SemVerStr = Annotated[str, _pattern(_SEMVER, "a semantic version such as 1.2.3 or 1.2.3-rc.1")]
Timestamp = Annotated[str, AfterValidator(_timestamp)]
Specifier = Annotated[str, AfterValidator(_specifier)]


@total_ordering
@dataclass(frozen=True)
class SemVer:
    """A semantic version (semver.org 2.0) with its precedence order; build metadata does not affect order."""

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: str = ""

    @classmethod
    def parse(cls, text: str) -> SemVer:
        match = _SEMVER.fullmatch(text)
        if match is None:
            raise ValueError(f"{text!r} is not a semantic version such as 1.2.3 or 1.2.3-rc.1")
        pre = tuple(match.group(4).split(".")) if match.group(4) else ()
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3)), pre, match.group(5) or "")

    def _key(self) -> tuple[Any, ...]:
        # A release sorts above its prereleases; numeric identifiers sort below alphanumeric ones (semver 11.4).
        if not self.prerelease:
            pre: tuple[Any, ...] = (1,)
        else:
            pre = (0, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease))
        return (self.major, self.minor, self.patch, pre)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, SemVer):
            return NotImplemented
        return self._key() < other._key()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SemVer):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + self.build
        return text


_CONSTRAINT = re.compile(r"(>=|<=|==|!=|>|<)\s*(\S+)", re.ASCII)


def _semver_constraints(value: str) -> str:
    parts = [p.strip() for p in value.split(",")]
    for part in parts:
        match = _CONSTRAINT.fullmatch(part)
        if match is None:
            raise ValueError(f"{value!r}: {part!r} is not a constraint such as '>=1.2.0' or '<2.0.0'")
        SemVer.parse(match.group(2))
    return value


SemVerConstraints = Annotated[str, AfterValidator(_semver_constraints)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileEntry(_Strict):
    """One payload file: its path under `payload/`, its size in bytes and its sha256."""

    path: SafePath
    size: int = Field(ge=0, le=MAX_FILE_SIZE)
    sha256: Sha256Hex


# Keys that only kernel bundles need, added after the first manifests were signed: absent from the canonical form
# when unset, so a manifest written before them keeps its exact bytes (and its signatures).
_OPTIONAL_TARGETS = ("cuda", "kernel_sources")
# What a kernels bundle must name: compiled Triton code runs only where every one of these matches.
KERNEL_KEYS = ("accelerators", "min_driver", "python", "torch", "triton", "cuda", "kernel_sources")


class Targets(_Strict):
    """Where the bundle runs. Empty or None means "any"; the installer compares these with the probed hardware.

    `cuda` is a specifier on the CUDA version torch was built for; `kernel_sources` is the digest of the envex
    kernel sources a kernels bundle was compiled from (`envex.bundles.kernel_cache.kernel_sources_digest`).
    """

    accelerators: list[Annotated[str, _pattern(_ACCELERATOR, "an accelerator architecture such as sm_90")]] = Field(
        max_length=64
    )
    min_driver: Annotated[str, _pattern(_DRIVER, "a driver version such as 535.104.05")] | None
    python: Specifier | None
    torch: Specifier | None
    triton: Specifier | None
    cuda: Specifier | None = None
    kernel_sources: Sha256Hex | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_optional_keys(self, handler: Any) -> Any:
        data = handler(self)
        for key in _OPTIONAL_TARGETS:
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def missing_kernel_keys(self) -> list[str]:
        """The keys a kernels bundle must set and this one leaves empty ([] when it is fully keyed)."""
        return [key for key in KERNEL_KEYS if getattr(self, key) in (None, [])]


class Requirement(_Strict):
    """Another bundle this one needs installed alongside: its name, kind and acceptable semantic versions."""

    name: BundleName
    kind: Kind
    version: SemVerConstraints

    def allows(self, version: str) -> bool:
        """Whether `version` (a semantic version) satisfies every constraint of this requirement."""
        have = SemVer.parse(version)
        for part in self.version.split(","):
            match = _CONSTRAINT.fullmatch(part.strip())
            assert match is not None  # validated in the constructor
            op, want = match.group(1), SemVer.parse(match.group(2))
            ok = {
                ">=": have >= want,
                "<=": have <= want,
                ">": have > want,
                "<": have < want,
                "==": have == want,
                "!=": have != want,
            }[op]
            if not ok:
                return False
        return True


class Manifest(_Strict):
    """What a bundle holds. Signed as its canonical bytes; see `to_bytes` and `from_bytes`."""

    schema_version: Literal[1]
    name: BundleName
    kind: Kind
    version: SemVerStr
    created: Timestamp
    expires: Timestamp
    targets: Targets
    requires: list[Requirement] = Field(max_length=256)
    files: list[FileEntry] = Field(max_length=MAX_FILES)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if parse_timestamp(self.expires) <= parse_timestamp(self.created):
            raise ValueError(f"expires {self.expires} is not after created {self.created}")
        if self.kind == "kernels" and self.targets.missing_kernel_keys():
            missing = ", ".join(f"targets.{k}" for k in self.targets.missing_kernel_keys())
            raise ValueError(f"a kernels bundle must name where its compiled code runs; {missing} not set")
        paths = [f.path for f in self.files]
        for before, after in zip(paths, paths[1:], strict=False):
            if before >= after:
                raise ValueError(f"files must be sorted by path and unique: {before!r} then {after!r}")
        # A path that is a file cannot also be a directory of another file ("a" and "a/b").
        names = set(paths)
        for path in paths:
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in names:
                    raise ValueError(f"{'/'.join(parts[:i])!r} is both a file and a directory (of {path!r})")
        return self

    @property
    def semver(self) -> SemVer:
        return SemVer.parse(self.version)

    @property
    def expires_at(self) -> datetime:
        return parse_timestamp(self.expires)

    @property
    def created_at(self) -> datetime:
        return parse_timestamp(self.created)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        """The canonical JSON bytes that are signed and stored as `manifest.json`."""
        return canonical_bytes(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse manifest bytes; anything but a valid manifest in canonical form raises ValueError."""
        try:
            value = parse_json(data, require_canonical=True)
        except CanonicalJSONError as exc:
            raise ValueError(f"manifest.json: {exc}") from None
        try:
            manifest = cls.model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"manifest.json: {first_error(exc)}") from None
        if manifest.to_bytes() != data:
            raise ValueError("manifest.json: not in canonical form (every field present, keys sorted, no whitespace)")
        return manifest


def first_error(exc: ValidationError) -> str:
    """The first of pydantic's errors as one line for people: where, and what is wrong."""
    errors = exc.errors()
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"
