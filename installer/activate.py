"""Step 6 and after: activation, rollback, recovery after a crash, the systemd unit, and the status view.

Order of an activation: launch.json gets the gate results; state.json records the new active release (the
commit point); `current` is switched by an atomic rename; the unit file is (re)written. A crash before the
state write leaves the old release active; a crash after it leaves `current` behind, and `reconcile` (run by
every command that takes the lock) points it at the recorded release.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

from envex.installer.fsutil import PrefixLock, atomic_write, switch_symlink
from envex.installer.launch import LAUNCH_FILE, OFFLINE_ENV, LaunchManifest, read_launch, recorded_probe
from envex.installer.media import InstallError
from envex.installer.prefix import check_prefix
from envex.installer.release import RELEASES_DIR, release_dir
from envex.installer.state import InstalledBundle, Release, State, load_state, now_ts, save_state

CURRENT = "current"
UNIT_FILE = "envex.service"
KEEP_PASSED = 3  # passed releases kept on disk for rollback, besides the active one


def current_target(prefix: Path) -> str | None:
    """The release id `current` points at, or None when there is no link."""
    link = Path(prefix) / CURRENT
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return Path(target).name


def _switch_current(prefix: Path, release_id: str) -> None:
    switch_symlink(Path(prefix) / CURRENT, f"{RELEASES_DIR}/{release_id}")


def activatable(prefix: Path, release: Release) -> bool:
    return release.status == "passed" and (release_dir(prefix, release.id) / LAUNCH_FILE).is_file()


def write_unit(prefix: Path, *, host: str = "127.0.0.1", port: int = 8000) -> Path:
    """`<prefix>/envex.service`: serves whatever `current` points to; written, never enabled here."""
    prefix = Path(prefix).resolve()
    env = "\n".join(f"Environment={k}={v}" for k, v in sorted(OFFLINE_ENV.items()))
    text = f"""# Written by envex-install; never enabled by it. To enable:
#   systemctl link {prefix}/{UNIT_FILE} && systemctl enable --now envex
[Unit]
Description=Envex inference server (OpenAI-compatible API) for {prefix}
After=local-fs.target
# No network-online.target: the server binds {host} and needs nothing from any network.

[Service]
Type=simple
ExecStart={prefix}/{CURRENT}/venv/bin/envex serve --launch {prefix}/{CURRENT}/launch.json --host {host} --port {port}
{env}
Restart=on-failure
RestartSec=5
NoNewPrivileges=yes

[Install]
WantedBy=multi-user.target
"""
    path = prefix / UNIT_FILE
    atomic_write(path, text.encode())
    return path


def activate_release(prefix: Path, state: State, release_id: str, *, event: str = "activate") -> State:
    """Make `release_id` (a release that passed its gates) the active one; returns the saved state."""
    release = state.release(release_id)
    if release is None or not activatable(prefix, release):
        raise InstallError(f"release {release_id} has not passed its gates or is no longer on disk; see envex status")
    bundles = list(state.bundles)
    known = {(b.name, b.manifest_sha256) for b in bundles}
    for ref in release.bundles:
        if (ref.name, ref.manifest_sha256) not in known:
            bundles.append(InstalledBundle(**ref.model_dump(), installed_at=now_ts(), release=release_id))
    new = state.model_copy(
        update={"active": release_id, "high_water": state.raised_high_water(release.bundles), "bundles": bundles}
    ).with_event(event, release_id, f"previous: {state.active}")  # type: ignore[arg-type]
    save_state(prefix, new)
    _switch_current(prefix, release_id)
    write_unit(prefix)
    return new


def finish_activation(prefix: Path, state: State, release_id: str, launch: LaunchManifest) -> State:
    """Record the passed gates in launch.json and state.json, then activate, then prune old releases."""
    release = state.release(release_id)
    assert release is not None and release.checks is not None
    final = launch.model_copy(update={"gates": release.checks, "bench": release.checks.bench})
    atomic_write(
        release_dir(prefix, release_id) / LAUNCH_FILE, LaunchManifest.model_validate(final.model_dump()).to_bytes()
    )
    state = state.with_release(release.model_copy(update={"status": "passed"}))
    save_state(prefix, state)
    state = activate_release(prefix, state, release_id)
    return prune(prefix, state)


def _number(release: Release) -> int:
    head = release.id.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def rollback_target(prefix: Path, state: State) -> Release:
    if state.active is None:
        raise InstallError("rollback: no release is active in this prefix; run envex-install first")
    active = state.release(state.active)
    floor = _number(active) if active else 1 << 62
    older = sorted((r for r in state.releases if _number(r) < floor and activatable(prefix, r)), key=_number)
    if not older:
        raise InstallError(f"rollback: no release before {state.active} passed its gates and is still on disk")
    return older[-1]


def change_release(prefix: Path, change: Literal["activate", "rollback"], release_id: str | None = None) -> State:
    """What `envex activate|rollback` and the admin page both run: take the prefix lock, reconcile, switch.

    For "activate", `release_id` is the release to make active. For "rollback", `release_id` (when given) is the
    target the operator confirmed: if the releases changed since and the rollback would now go elsewhere, nothing
    changes. Raises PrefixError (before anything is created: a prefix with nothing installed is not touched),
    LockHeldError, InstallError or StateError with a one-line message.
    """
    prefix = check_prefix(prefix, must_exist=True)
    with PrefixLock(prefix):
        state = reconcile(prefix, load_state(prefix))
        if change == "rollback":
            target = rollback_target(prefix, state)
            if release_id and target.id != release_id:
                raise InstallError(
                    f"rollback would now go to {target.id}, not {release_id} as confirmed; review and retry"
                )
            return activate_release(prefix, state, target.id, event="rollback")
        if not release_id:
            raise InstallError("activate: no release was chosen; give a release id from envex status")
        return activate_release(prefix, state, release_id)


def prune(prefix: Path, state: State) -> State:
    """Remove the slots of all but the newest KEEP_PASSED passed releases (never the active one)."""
    passed = sorted((r for r in state.releases if activatable(prefix, r) and r.id != state.active), key=_number)
    doomed = passed[: max(0, len(passed) - KEEP_PASSED)]
    if not doomed:
        return state
    for release in doomed:
        state = state.with_release(release.model_copy(update={"status": "removed"}))
    save_state(prefix, state)
    for release in doomed:
        shutil.rmtree(release_dir(prefix, release.id), ignore_errors=True)
    return state


def reconcile(prefix: Path, state: State) -> State:
    """Bring the prefix back to what state.json records after a crash: abandon unfinished slots, remove stray
    directories, and point `current` at the recorded active release."""
    prefix = Path(prefix)
    changed = False
    for release in state.releases:
        if release.status in ("installing", "gating") and release.id != state.active:
            state = state.with_release(
                release.model_copy(update={"status": "abandoned", "message": "the installer stopped before finishing"})
            ).with_event("abandon", release.id)
            changed = True
    if changed:
        save_state(prefix, state)
    keep = {r.id for r in state.releases if r.status in ("passed", "installing", "gating")} | {state.active}
    root = prefix / RELEASES_DIR
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name not in keep and entry.name != current_target(prefix):
                shutil.rmtree(
                    entry, ignore_errors=True
                ) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for stray in prefix.glob(f".{CURRENT}.tmp-*"):
        stray.unlink(missing_ok=True)
    if state.active is not None and current_target(prefix) != state.active:
        if (release_dir(prefix, state.active) / LAUNCH_FILE).is_file():
            _switch_current(prefix, state.active)
    return state


def status_lines(prefix: Path, state: State) -> list[str]:
    lines = [f"prefix: {Path(prefix).resolve()}"]
    if state.trust:
        lines.append(f"trust root: version {state.trust.root_version}, fingerprint {state.trust.root_fingerprint}")
    lines.append(f"active: {state.active or 'none'} (current -> {current_target(prefix) or 'none'})")
    for release in sorted(state.releases, key=_number):
        mark = "*" if release.id == state.active else " "
        verdict = release.checks.verdict if release.checks else "-"
        names = ", ".join(f"{b.name} {b.version}" for b in release.bundles)
        lines.append(f" {mark} {release.id}  {release.status:<9} gates {verdict:<4} {release.mode}  {names}")
    marks = ", ".join(f"{n} {v}" for n, v in sorted(state.high_water.items(), key=lambda kv: kv[0]))
    lines.append(f"high-water marks (older bundles are refused): {marks or 'none'}")
    active_launch = release_dir(prefix, state.active) / LAUNCH_FILE if state.active else None
    if active_launch is not None and active_launch.is_file():
        manifest, _ = read_launch(active_launch)
        lines.append(
            f"active launch: {manifest.model.served_name} ({manifest.numeric_policy}), runtime envex "
            f"{manifest.runtime.envex_version}; unit file {Path(prefix).resolve() / UNIT_FILE}"
        )
        kernels = manifest.kernels
        lines.append(
            f"kernels: bundle {kernels.bundle.name} {kernels.bundle.version} ({kernels.accelerator}, triton "
            f"{kernels.triton}; digest {kernels.bundle.manifest_sha256[:16]}…), read-only"
            if kernels is not None
            else f"kernels: no kernel bundle{'; compiled at first start' if manifest.mode == 'cuda' else ''}"
        )
        recorded = recorded_probe(prefix)
        if recorded is not None:
            lines.append(f"hardware ({recorded[1]}): {recorded[0].summary()}")
    return lines
