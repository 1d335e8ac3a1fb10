"""The `envex` and `envex-install` commands, through their real console entry points, against hostile inputs.

Classes of defect (issue #11, "CLI and files"), each with its examples and its own fuzzing:

1. Unbounded reads: every file a command reads is a regular file, read with a cap. /dev/zero, a FIFO, a directory, a
   1 TiB sparse file, a symlink loop and a 5,000-character path each give one line and a non-zero exit, quickly
   (the children run under a memory limit and a timeout, so the old behaviour fails fast instead of taking the
   machine down).
2. Never replace what it should not: a bundle, a root or a key is written beside its target and renamed; device
   nodes, FIFOs and symlinks are never replaced; an existing file only with --force.
3. Never write outside what it was given: key names are plain stems.
4. One line, never a traceback: hypothesis over paths and option values for every command; the property is one
   line on stderr, a non-zero exit, no traceback, and nothing created outside the test's directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import socket
import stat
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.bundles import make_demo_trust, verify_bundle
from envex.bundles.archive import BundleArchive

LONG = "a" * 5000
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


def _limits() -> None:
    # 8 GiB of address space: the old readers of /dev/zero die with MemoryError in seconds instead of taking the
    # machine's memory; torch's import fits well within it.
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def run(argv: list[str | Path], *, program: str = "envex", timeout: float = 60, cwd: Path | None = None):
    module = {"envex": "envex.installer.commands", "envex-install": "envex.installer.cli"}[program]
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limits,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout, err)
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    assert err.endswith("\n") and lines[0].isprintable()
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A signed bundle with its root and key (real Ed25519), and one of every hostile kind of path."""
    root = tmp_path_factory.mktemp("cli")
    trust = make_demo_trust(root / "keys", expires=datetime.now(UTC) + timedelta(days=30))
    src = root / "src"
    src.mkdir()
    (src / "a.txt").write_text("payload\n")
    bundle = root / "b-1.0.0.envex"
    assert run(["bundle", "build", "--kind", "runtime", "--src", src, "--name", "b", "--version", "1.0.0",
                "--out", bundle]).returncode == 0
    assert run(["bundle", "sign", bundle, "--key", trust.key_path]).returncode == 0
    verify_bundle(bundle, root=trust.root)
    hostile = root / "hostile"
    hostile.mkdir()
    os.mkfifo(hostile / "fifo")
    (hostile / "dir").mkdir()
    (hostile / "loop").symlink_to(hostile / "loop")
    with open(hostile / "sparse", "wb") as handle:
        handle.truncate(1 << 40)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(hostile / "sock"))
    return {"root": root, "bundle": bundle, "trust": trust.root_path, "key": trust.key_path, "src": src,
            "fifo": hostile / "fifo", "dir": hostile / "dir", "loop": hostile / "loop", "sparse": hostile / "sparse",
            "sock": hostile / "sock", "zero": Path("/dev/zero"), "long": root / LONG}


HOSTILE = {
    "zero": "character device",
    "fifo": "FIFO",
    "dir": "directory",
    "sparse": "limit",
    "loop": "symlink loop",
    "long": "too long",
    "sock": "socket",
}


# Each test runs every hostile kind through one reader (some kinds were already refused in one line by some
# readers; the class is "every kind, every reader").


def test_verify_trust_root_is_read_bounded(world):
    for kind, needle in HOSTILE.items():
        assert_one_line(run(["verify", "bundle", world["bundle"], "--trust", world[kind]], timeout=30), needle)


def test_sign_key_and_sigstore_bundle_are_read_bounded(world):
    for kind, needle in HOSTILE.items():
        assert_one_line(run(["bundle", "sign", world["bundle"], "--key", world[kind]], timeout=30), needle)
        proc = run(["bundle", "sign", world["bundle"], "--key", world["key"], "--sigstore-bundle", world[kind]],
                   timeout=30)
        assert_one_line(proc, needle)
    verify_bundle(world["bundle"], root=world["trust"])  # untouched by the refusals


def test_serve_launch_and_make_root_keys_are_read_bounded(world, tmp_path):
    for kind, needle in HOSTILE.items():
        assert_one_line(run(["serve", "--launch", world[kind]], timeout=60), needle)
        proc = run(["bundle", "make-root", "--out", tmp_path / "root.json", "--root-key", world[kind],
                    "--bundle-key", world[kind], "--sign", world["key"]], timeout=30)
        assert_one_line(proc, needle)
    assert not (tmp_path / "root.json").exists()


def test_the_bundle_itself_is_refused_in_one_line(world):
    # A bundle is streamed, never read whole: a 1 TiB sparse "bundle" is an empty tar, refused at once.
    for kind, needle in {**HOSTILE, "sparse": "manifest.json is missing"}.items():
        assert_one_line(run(["verify", "bundle", world[kind], "--trust", world["trust"]], timeout=30), needle)


def test_state_json_and_media_root_are_read_bounded(world, tmp_path):
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    os.mkfifo(prefix / "state.json")
    assert_one_line(run(["status", "--prefix", prefix], timeout=30), "state file", "FIFO")
    assert_one_line(run(["rollback", "--prefix", prefix], timeout=30), "state file", "FIFO")
    media = tmp_path / "media"
    (media / "trust").mkdir(parents=True)
    (media / "bundles").mkdir()
    os.link(world["bundle"], media / "bundles" / world["bundle"].name)
    os.symlink("/dev/zero", media / "trust" / "root.json")
    proc = run(["--media", media, "--prefix", tmp_path / "new", "--trust-fingerprint", "0" * 64, "--yes"],
               program="envex-install", timeout=60)
    assert_one_line(proc, "character device")
    assert not (tmp_path / "new").exists()


def test_a_symlink_loop_is_reported_as_a_loop_not_as_missing(world, tmp_path):
    for argv in (["verify", "bundle", world["loop"]], ["bundle", "sign", world["loop"], "--key", world["key"]]):
        line = assert_one_line(run(argv, timeout=30), "symlink loop")
        assert "does not exist" not in line
    line = assert_one_line(
        run(["--media", world["loop"], "--prefix", tmp_path / "p", "--yes"], program="envex-install"), "symlink loop"
    )
    assert "does not exist" not in line


# ---- writers ---------------------------------------------------------------------------------------------------


def _build(world, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run(["bundle", "build", "--kind", "runtime", "--src", world["src"], "--name", "b", "--version", "1.0.0",
                "--out", out, *extra], timeout=60)


def test_build_never_replaces_a_device_fifo_or_link(world, tmp_path):
    fifo = tmp_path / "fifo.envex"
    os.mkfifo(fifo)
    assert_one_line(_build(world, fifo), "is a FIFO", "refusing to replace it")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    link = tmp_path / "link.envex"
    link.symlink_to(world["bundle"])
    assert_one_line(_build(world, link), "is a symlink")
    assert link.is_symlink()
    device = tmp_path / "full"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # what /dev/full is, in a place of our own
    except PermissionError:
        pytest.skip("mknod needs root")
    for extra in ((), ("--force",)):  # not even with --force
        assert_one_line(_build(world, device, *extra), "character device")
        assert stat.S_ISCHR(os.lstat(device).st_mode), "the device node was replaced by a regular file"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left behind


def test_build_refuses_to_overwrite_a_bundle_without_force(world, tmp_path):
    out = tmp_path / "b.envex"
    assert _build(world, out).returncode == 0
    signed = tmp_path / "signed.envex"
    os.link(world["bundle"], signed)
    before = signed.read_bytes()
    assert_one_line(_build(world, signed), "already exists", "--force")
    assert signed.read_bytes() == before
    assert _build(world, tmp_path, "--force").returncode == 0  # a directory: NAME-VERSION.envex inside
    assert _build(world, tmp_path).returncode == 2  # now it exists
    assert _build(world, out, "--force").returncode == 0


def test_make_root_refuses_to_overwrite_without_force(world, tmp_path):
    pub = world["key"].with_suffix(".pub.json")
    argv = ["bundle", "make-root", "--root-key", pub, "--bundle-key", pub, "--sign", world["key"]]
    out = tmp_path / "root.json"
    assert run([*argv, "--out", out]).returncode == 0
    first = out.read_bytes()
    assert_one_line(run([*argv, "--out", out]), "already exists", "--force")
    assert out.read_bytes() == first
    assert run([*argv, "--out", out, "--force"]).returncode == 0


def test_sign_writes_a_new_file_and_renames_it(world, tmp_path):
    """A crash while signing must leave the old bundle whole: the signed bundle is a new file renamed over the old
    one, so a hard link to the old one still holds the old bytes (an in-place rewrite would change both)."""
    bundle = tmp_path / "b-1.0.0.envex"
    assert _build(world, bundle).returncode == 0
    os.link(bundle, tmp_path / "before.envex")
    unsigned = bundle.read_bytes()
    second = tmp_path / "keys2"
    assert run(["bundle", "keygen", "--out", second, "--name", "k2"]).returncode == 0
    assert run(["bundle", "sign", bundle, "--key", world["key"]]).returncode == 0
    assert run(["bundle", "sign", bundle, "--key", second / "k2.key"]).returncode == 0
    assert (tmp_path / "before.envex").read_bytes() == unsigned
    with BundleArchive.open(bundle) as archive:
        assert archive.read_metadata("signatures.json").count(b"keyid") == 2  # both kept
    assert verify_bundle(bundle, root=world["trust"]).name == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b-1.0.0.envex", "before.envex", "keys2"]


@pytest.mark.parametrize("name", ["../x", "../../etc/evil", "/tmp/abs", "a/b", "..", ".hidden", "x\ny", ""])
def test_keygen_names_cannot_leave_out(tmp_path, name):
    out = tmp_path / "deep" / "keys"
    assert_one_line(run(["bundle", "keygen", "--out", out, "--name", name]), "key name")
    assert not (tmp_path / "x.key").exists() and not (tmp_path / "deep" / "x.key").exists()
    assert not out.exists() or list(out.iterdir()) == []


# ---- one line, never a traceback ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--port", "99999"], "'--port'"),
        (["serve", "--port", "-1"], "'--port'"),
        (["serve", "--load-format", "bogus"], "load_format: 'bogus' is not one of auto, dummy"),
        (["bundle", "build", "--kind", "runtime", "--src", ".", "--name", "b", "--version", "1.0.0", "--out", ".",
          "--expires-days", "1000000000"], "'--expires-days'"),
        (["bundle", "make-root", "--out", "r.json", "--root-key", "k", "--bundle-key", "k", "--sign", "k",
          "--expires-days", "1000000000"], "'--expires-days'"),
        (["bundle", "build", "--kind", "nonsense"], "'--kind'"),
        (["verify", "bundle"], "Missing argument"),
        (["no-such-command"], "No such command"),
        (["status", "--no-such-option"], "No such option"),
        (["admin", "--port", "70000"], "'--port'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, needle, tmp_path):
    proc = run(argv, cwd=tmp_path)
    assert proc.returncode == 2
    assert_one_line(proc, "error: ", needle)
    assert "╭" not in proc.stderr and "Usage:" not in proc.stderr


def test_install_usage_errors_are_one_line(tmp_path):
    proc = run(["--media", tmp_path, "--prefix", tmp_path / "p", "--max-model-len", "1"], program="envex-install")
    assert proc.returncode == 2 and assert_one_line(proc, "'--max-model-len'")
    proc = run(["--prefix", tmp_path / "p"], program="envex-install")
    assert proc.returncode == 2 and assert_one_line(proc, "Missing option '--media'")


def test_paths_with_newlines_are_printed_escaped(world, tmp_path):
    odd = tmp_path / "evil\nerror: forged second line"
    line = assert_one_line(run(["verify", "bundle", odd]), "does not exist")
    assert "evil\\nerror: forged second line" in line


def _in_process(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue()


# Paths as hypothesis makes them: odd characters, newlines, very long, and every hostile kind of file.
def _paths(world) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([str(world[k]) for k in HOSTILE] + ["/", "/proc/1/mem", "/dev/null", "", "."]),
        st.text(alphabet=st.sampled_from("ab/.-\n\t\x1b é:"), min_size=1, max_size=80),
        st.builds(lambda n: "p" * n, st.integers(min_value=200, max_value=6000)),
    )


@pytest.mark.timeout(600)
def test_every_command_fails_in_one_line_on_any_path(world, tmp_path_factory):
    from envex.installer import cli, commands

    cwd = tmp_path_factory.mktemp("cwd")

    @FUZZ
    @given(path=_paths(world), other=_paths(world), command=st.sampled_from([
        "verify", "trust", "sign", "key", "build-src", "build-out", "make-root", "status", "rollback", "activate",
        "serve", "install-media", "install-prefix", "keygen-out", "media-model",
    ]))
    def check(path: str, other: str, command: str) -> None:
        b, t, k, s = str(world["bundle"]), str(world["trust"]), str(world["key"]), str(world["src"])
        # Writers may succeed: keep what they write inside this test's directory (no "/" or "/a" as --out).
        hostile = {str(world[name]) for name in HOSTILE} | {"/proc/1/mem", "/dev/null"}
        w = path if path in hostile else (path.lstrip("/") or ".")
        argv = {
            "verify": ["verify", "bundle", path, "--trust", t],
            "trust": ["verify", "bundle", b, "--trust", path],
            "sign": ["bundle", "sign", path, "--key", k],
            "key": ["bundle", "sign", b, "--key", path],
            # --force and a fresh key directory: a writer that succeeds once succeeds again (hypothesis replays)
            "build-src": ["bundle", "build", "--kind", "model", "--src", path, "--name", "m", "--version", "1.0.0",
                          "--out", str(cwd / "x.envex"), "--force"],
            "build-out": ["bundle", "build", "--kind", "model", "--src", s, "--name", "m", "--version", "1.0.0",
                          "--out", w, "--force"],
            "make-root": ["bundle", "make-root", "--out", str(cwd / "r.json"), "--root-key", path,
                          "--bundle-key", k, "--sign", k],
            "status": ["status", "--prefix", path],
            "rollback": ["rollback", "--prefix", path],
            "activate": ["activate", "0001-x", "--prefix", path],
            "serve": ["serve", "--launch", path],
            "keygen-out": ["bundle", "keygen", "--out", f"{w}/sub-{uuid.uuid4().hex}", "--name", "k"],
            # refused at the model, before any key is read or wheel resolved (no path here is a model)
            "media-model": ["media", "build", "--model", path, "--out", str(cwd / "media"), "--keys", str(cwd)],
        }.get(command)
        before = sorted(os.listdir(cwd))
        if command.startswith("install"):
            media, prefix = (path, str(cwd / "pre")) if command == "install-media" else (str(cwd / "nomedia"), path)
            code, err = _in_process(cli.main, ["--media", media, "--prefix", prefix, "--yes", "--cpu"])
        else:
            assert argv is not None
            code, err = _in_process(commands.main, argv)
        if code == 0:  # only a writer given a writable place (or a source directory) may succeed
            assert command in ("build-out", "build-src", "keygen-out"), err
            return
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].isprintable(), err
        assert lines[0].startswith(("error: ", "verification failed [")), lines[0]
        assert "Traceback" not in err
        if command.startswith(("install", "status", "rollback", "activate")):
            assert sorted(os.listdir(cwd)) == before, "a failed command created something"

    old = os.getcwd()
    os.chdir(cwd)  # relative paths land here, never in the repository
    try:
        check()
    finally:
        os.chdir(old)


@pytest.mark.timeout(600)
def test_out_of_range_numbers_are_one_line(world, tmp_path_factory):
    from envex.installer import commands

    out = tmp_path_factory.mktemp("n")

    @FUZZ
    @given(days=st.integers(min_value=-(2**80), max_value=2**80), port=st.integers(min_value=-(2**70), max_value=2**70))
    def check(days: int, port: int) -> None:
        code, err = _in_process(commands.main, [
            "bundle", "build", "--kind", "runtime", "--src", str(world["src"]), "--name", "m", "--version", "1.0.0",
            "--out", str(out / "m.envex"), "--force", "--expires-days", str(days)])
        if 1 <= days <= 36500:
            assert code == 0, err
        else:
            assert code == 2 and len(err.splitlines()) == 1 and "'--expires-days'" in err, err
        if not 1 <= port <= 65535:  # a valid port would start a server
            code, err = _in_process(commands.main, ["serve", "--port", str(port)])
            assert code == 2 and len(err.splitlines()) == 1 and "'--port'" in err, err

    check()


def test_a_release_keeps_its_deterministic_setting_and_the_cli_takes_both_ways(tmp_path):
    launch = tmp_path / "launch.json"
    launch.write_text("{}")
    # a release serves the weights its gates passed with
    assert_one_line(run(["serve", "--launch", launch, "--load-format", "dummy"], timeout=60), "--load-format")
    for flag in ("--deterministic", "--no-deterministic"):  # either way: launch.json decides, the flag is refused
        assert_one_line(run(["serve", "--launch", launch, flag], timeout=60), "--deterministic/--no-deterministic",
                        "launch.json")  # fmt: skip
    # without a release both forms run (the default is off): the same two greedy tokens either way
    off = run(["generate", "hi", "--device", "cpu", "--max-tokens", "2", "--no-deterministic"], timeout=120)
    assert off.returncode == 0, off.stderr
    on = run(["generate", "hi", "--device", "cpu", "--max-tokens", "2", "--deterministic"], timeout=120)
    assert on.returncode == 0 and on.stdout == off.stdout, (on.stdout, off.stdout, on.stderr)


def test_the_commands_start_without_torch() -> None:
    """`envex` and `envex-install` load torch only in the commands that run a model (serve, gates, bench, media
    build): `envex verify bundle` on an appliance, and every command's errors, answer in well under a second
    (importing installer/media_build.py at start cost every command ~2 s)."""
    for module in ("envex.installer.commands", "envex.installer.cli"):
        probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
        done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "[]", (module, done.stdout, done.stderr)
