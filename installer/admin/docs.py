"""The offline docs (offline_docs/*.md, shipped inside the package envex.offline_docs) rendered to HTML.

Markdown is rendered by markdown-it-py with raw HTML disabled (it is escaped), so a doc cannot inject markup or
script into the admin page. Images the docs reference are served from the same package, by exact file name.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib.resources import files
from importlib.resources.abc import Traversable

from markdown_it import MarkdownIt

DOCS_PACKAGE = "envex.offline_docs"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
IMAGE_TYPES = {".png": "image/png"}


def _root() -> Traversable:
    return files(DOCS_PACKAGE)


def doc_names() -> list[str]:
    """The docs' stems (install, bundles, ...), README-like index first when present."""
    names = sorted(p.name[:-3] for p in _root().iterdir() if p.name.endswith(".md") and _SAFE_NAME.match(p.name))
    return sorted(names, key=lambda n: (n != "index", n))


def _title(text: str, fallback: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return fallback


@lru_cache(maxsize=1)
def _renderer() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable("table")


def render_doc(name: str) -> tuple[str, str] | None:
    """(title, html) of offline_docs/<name>.md, or None when there is no such doc. `name` may end in .md."""
    stem = name[:-3] if name.endswith(".md") else name
    if not _SAFE_NAME.match(stem + ".md") or stem not in doc_names():
        return None
    text = _root().joinpath(stem + ".md").read_text(encoding="utf-8")
    return _title(text, stem), _renderer().render(text)


def render_markdown(text: str) -> str:
    """Markdown from a report (a bench table) to HTML, raw HTML escaped."""
    return _renderer().render(text)


def doc_titles() -> list[tuple[str, str]]:
    out = []
    for stem in doc_names():
        text = _root().joinpath(stem + ".md").read_text(encoding="utf-8")
        out.append((stem, _title(text, stem)))
    return out


def doc_image(name: str) -> tuple[bytes, str] | None:
    """(bytes, content type) of an image shipped with the docs, by exact file name; None otherwise."""
    suffix = name[name.rfind(".") :] if "." in name else ""
    if not _SAFE_NAME.match(name) or suffix not in IMAGE_TYPES:
        return None
    entry = _root().joinpath(name)
    if not entry.is_file():
        return None
    return entry.read_bytes(), IMAGE_TYPES[suffix]
