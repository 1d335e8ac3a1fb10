"""Canonical JSON: the one byte form of a JSON value that signatures and fingerprints are computed over.

The form is RFC 8785 (JCS) restricted to what our documents hold: objects, arrays, strings, integers, booleans and
null; no floats (their textual form is where JCS implementations disagree). Keys are sorted, there is no
whitespace, text is UTF-8 with only the escapes JSON requires. Parsing is strict: duplicate keys, floats, NaN and
non-canonical bytes are refused, so one document has exactly one byte form.
"""

from __future__ import annotations

import json
from typing import Any

# Our documents are small; a manifest of a wheelhouse with thousands of files is a few MB. The bound keeps a
# hostile archive from making us parse gigabytes of JSON.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
MAX_NESTING = 64


class CanonicalJSONError(ValueError):
    """The bytes are not canonical JSON of the supported subset."""


def _check_value(value: Any, depth: int = 0) -> None:
    if depth > MAX_NESTING:
        raise CanonicalJSONError(f"nesting deeper than {MAX_NESTING}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalJSONError(f"object key {key!r} is not a string")
            _check_value(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, depth + 1)
    elif isinstance(value, float):
        raise CanonicalJSONError("floats are not allowed in canonical JSON")
    elif value is None or isinstance(value, str | int | bool):
        return
    else:
        raise CanonicalJSONError(f"{type(value).__name__} is not a JSON value")


def canonical_bytes(value: Any) -> bytes:
    """Encode `value` (dicts, lists, str, int, bool, None) as canonical JSON bytes."""
    _check_value(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, item in pairs:
        if key in result:
            raise CanonicalJSONError(f"duplicate key {key!r}")
        result[key] = item
    return result


def _no_float(text: str) -> Any:
    raise CanonicalJSONError(f"float {text} is not allowed in canonical JSON")


def _no_constant(text: str) -> Any:
    raise CanonicalJSONError(f"{text} is not allowed in JSON")


def parse_json(data: bytes, *, require_canonical: bool) -> Any:
    """Parse strict JSON (no duplicate keys, floats or NaN); with `require_canonical`, refuse any other byte form."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise CanonicalJSONError(f"document of {len(data)} bytes is over the {MAX_DOCUMENT_BYTES} byte limit")
    try:
        text = data.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_no_float, parse_constant=_no_constant)
    except CanonicalJSONError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CanonicalJSONError(f"not valid JSON: {exc}") from None
    if require_canonical:
        try:
            again = canonical_bytes(value)
        except RecursionError:
            raise CanonicalJSONError("nesting too deep") from None
        if again != data:
            raise CanonicalJSONError("not in canonical form (sorted keys, no whitespace, UTF-8)")
    return value
