"""bundles.files: every read is of a regular file, opened once, bounded; every write goes beside the target and is
renamed into place, never onto a device, FIFO, socket, directory or symlink, never over a file unless asked.

Hypothesis drives the paths (control characters, newlines, long names, every kind of file) and the sizes; the
properties: a FileProblem (an OSError) or the exact bytes, never a hang or another exception, and a message that is
always one printable line.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.bundles.files import FileProblem, one_line, read_regular_file, show, write_file

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = "a" * 5000


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """One of every kind of thing a path can name."""
    root = tmp_path_factory.mktemp("zoo")
    (root / "file").write_bytes(b"0123456789")
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "link").symlink_to(root / "file")
    with open(root / "sparse", "wb") as handle:
        handle.truncate(1 << 40)  # 1 TiB of nothing: refused by its size, never read
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(root / "sock"))
    paths = {p.name: p for p in root.iterdir()}
    paths["zero"] = Path("/dev/zero")
    paths["missing"] = root / "missing"
    paths["long"] = root / LONG
    paths["notdir"] = root / "file" / "below"
    paths["newline"] = root / "new\nline"
    yield paths
    sock.close()


EXPECTED = {
    "zero": "is a character device, not a regular file",
    "fifo": "is a FIFO, not a regular file",
    "dir": "is a directory, not a regular file",
    "sock": "is a socket, not a regular file",
    "sparse": "over the 1,024-byte limit",
    "loop": "is a symlink loop",
    "dangling": "does not exist",
    "missing": "does not exist",
    "long": "the path is too long",
    "notdir": "a component of the path is not a directory",
    "newline": "does not exist",
}


@pytest.mark.timeout(30)  # a FIFO that blocked the open would hang here
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_read_refuses_what_is_not_a_bounded_regular_file(zoo, kind):
    with pytest.raises(FileProblem) as caught:
        read_regular_file(zoo[kind], max_bytes=1024, what="trust root")
    message = str(caught.value)
    assert EXPECTED[kind] in message and message.startswith("trust root ")
    assert message.isprintable() and "\n" not in message  # one line, the newline in a name shown escaped
    assert isinstance(caught.value, OSError)  # existing `except OSError` handlers keep catching it


def test_read_follows_links_to_regular_files_and_returns_the_bytes(zoo):
    assert read_regular_file(zoo["link"], max_bytes=10, what="key") == b"0123456789"
    with pytest.raises(FileProblem, match="is 10 bytes, over the 9-byte limit for a key"):
        read_regular_file(zoo["file"], max_bytes=9, what="key")


@FUZZ
@given(data=st.binary(max_size=4096), limit=st.integers(min_value=0, max_value=5000))
def test_read_returns_exactly_the_bytes_up_to_the_limit(tmp_path_factory, data, limit):
    path = tmp_path_factory.mktemp("r") / "f"
    path.write_bytes(data)
    if len(data) <= limit:
        assert read_regular_file(path, max_bytes=limit, what="card") == data
    else:
        with pytest.raises(FileProblem, match="limit"):
            read_regular_file(path, max_bytes=limit, what="card")


# Path text as a person (or an attacker) might type it: control characters, newlines, odd Unicode, long runs.
path_text = st.one_of(
    st.text(min_size=1, max_size=64),
    st.text(alphabet=st.sampled_from("ab/.\n\t\x1b\x00 é"), min_size=1, max_size=300),
    st.builds(lambda n: "x" * n, st.integers(min_value=250, max_value=6000)),
    st.sampled_from(["/dev/zero", "/dev/null", "/proc/self/mem", "/", "/proc", ".", "..", "/dev/stdin"]),
)


@pytest.mark.timeout(120)
@FUZZ
@given(text=path_text)
def test_read_of_any_path_is_bytes_or_one_line(text):
    try:
        data = read_regular_file(text, max_bytes=1 << 20, what="launch manifest")
    except FileProblem as exc:
        message = str(exc)
        assert message.isprintable() and message.startswith("launch manifest ")
    except ValueError:  # a NUL byte in the path: Python refuses it before any system call
        assert "\x00" in text
    else:
        assert isinstance(data, bytes) and len(data) <= 1 << 20


@given(text=st.text(max_size=200))
def test_show_and_one_line_are_always_one_printable_line(text):
    for rendered in (one_line(text), show(text)):
        assert rendered.isprintable()
        rendered.encode("utf-8")  # surrogates (undecodable bytes in a file name) are escaped too
    assert one_line(text) == text or not text.isprintable()


# ---- writing ---------------------------------------------------------------------------------------------------


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode) else "dir" if stat.S_ISDIR(mode) else (
        "chr" if stat.S_ISCHR(mode) else "file")


def _target(root: Path, kind: str) -> Path:
    target = root / "target"
    if kind == "file":
        target.write_bytes(b"old")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind == "link":
        (root / "elsewhere").write_bytes(b"old")
        target.symlink_to(root / "elsewhere")
    elif kind == "chr":
        try:
            os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # the numbers of /dev/full
        except PermissionError:
            pytest.skip("mknod needs root")
    return target


@FUZZ
@given(kind=st.sampled_from(["absent", "file", "fifo", "dir", "link", "chr"]), replace=st.booleans(),
       data=st.binary(max_size=64))
def test_write_replaces_only_a_regular_file_and_only_when_asked(kind, replace, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = _target(root, kind)
        allowed = kind == "absent" or (kind == "file" and replace)
        if allowed:
            write_file(target, data, what="bundle", replace=replace)
            assert target.read_bytes() == data and _kind(target) == "file"
        else:
            with pytest.raises(FileProblem) as caught:
                write_file(target, data, what="bundle", replace=replace)
            assert _kind(target) == kind, "the node was replaced"
            message = str(caught.value)
            assert ("--force" in message) if kind == "file" else "refusing to replace it" in message
            if kind == "link":
                assert (root / "elsewhere").read_bytes() == b"old"
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_write_sets_the_mode_exactly_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_file(tmp_path / "pub", b"x", what="public key", mode=0o644, replace=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "pub").st_mode) == 0o644


@FUZZ
@given(name=st.one_of(st.text(max_size=80), st.sampled_from(["../x", "..", ".", "a/../../b", "/etc/x", "k\n", "k"])))
def test_key_names_never_leave_the_key_directory(name):
    from envex.bundles.keys import generate_key, write_key_files

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "keys"
        try:
            private, public = write_key_files(generate_key(), out, name)
        except ValueError as exc:
            assert str(exc).startswith("key name ") and str(exc).isprintable()
            assert not out.exists() or list(out.iterdir()) == []
        else:
            assert private.parent == out and public.parent == out
            assert sorted(p.name for p in out.iterdir()) == sorted([f"{name}.key", f"{name}.pub.json"])
            assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
        assert sorted(p.name for p in Path(tmp).iterdir()) in ([], ["keys"])  # nothing beside --out
