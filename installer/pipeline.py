"""The whole install: verify, probe, plan, install, gates, activate; under the prefix lock, failing safe.

Whatever stops the install (an error, a failed gate, a kill), the release that was active stays active: the new
release lives in its own slot and becomes active only by the last step. A failed slot is removed (its report
stays under reports/); a slot left by a killed installer is removed by the next run (activate.reconcile).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from envex.bundles import SemVer, VerifiedBundle
from envex.installer.activate import finish_activation, reconcile
from envex.installer.admin.auth import create_admin_token, has_admin_token
from envex.installer.checks import report_dir, run_checks
from envex.installer.children import LeftoverError, kill_leftovers
from envex.installer.fsutil import PrefixLock
from envex.installer.media import (
    InstallError,
    TrustDecision,
    Verified,
    pin_trust,
    scan_media,
    settle_trust,
    verify_all,
)
from envex.installer.plan import bundle_ref, check_cards, make_plan, refuse_deterministic
from envex.installer.prefix import check_prefix, create_prefix, describe_os_error, is_envex_prefix
from envex.installer.probe import probe
from envex.installer.release import build_release, remove_release
from envex.installer.state import Release, State, load_state, now_ts, save_state
from envex.installer.ui import InstallUI


@dataclass(frozen=True, kw_only=True)
class InstallOptions:
    media: Path
    prefix: Path
    trust_fingerprint: str | None = None
    model: str | None = None
    max_model_len: int | None = None
    suite: str = "quick"
    bench: bool = True
    use_gpu: bool = True
    reinstall: bool = False
    deterministic: bool = False  # --deterministic: the release runs (and its gates require) batch-invariant kernels
    reference: str = "auto"  # --reference: the gates' reference, auto | local | signed (installer/plan.py)
    kv_cache_dtype: str = "bf16"  # --kv-cache-dtype: bf16 | fp8 | int4 (a packed one is gated against its band)
    weights: str | None = None  # --weights: a weights policy quantizing the model at load (gated against its band)
    test_gates_report: Path | None = None  # test hook ENVEX_TEST_GATES_REPORT; see checks.run_checks


@dataclass(frozen=True)
class InstallOutcome:
    ok: bool
    message: str
    release: str | None
    active: str | None
    report: Path | None = None


BUNDLES_DIR = "bundles"


def kept_bundle_name(manifest_sha256: str) -> str:
    """The file name of an installed bundle's copy in <prefix>/bundles/: its manifest's digest."""
    return f"{manifest_sha256}.envex"


def keep_bundle_files(prefix: Path, bundles: tuple[VerifiedBundle, ...] | list[VerifiedBundle]) -> None:
    """Keep the installed bundle files in <prefix>/bundles/, so the admin page can re-verify them later without
    the media.

    Each is kept under its manifest's digest, not its name and version: a bundle rebuilt with the same name and
    version but other bytes is another file, and never replaces the one an earlier release installed (that made
    Re-verify of the earlier release fail as "not the installed manifest"). A copy already there is kept. Each is
    copied under a temporary name and renamed into place: a crash leaves no half file.
    """
    keep = prefix / BUNDLES_DIR
    keep.mkdir(exist_ok=True)
    for bundle in bundles:
        target = keep / kept_bundle_name(bundle.manifest_sha256)
        if target.is_file():
            continue
        tmp = keep / f".{target.name}.tmp-{secrets.token_hex(6)}"
        try:
            shutil.copyfile(bundle.path, tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _describe(bundles: tuple[VerifiedBundle, ...]) -> str:
    return ", ".join(f"{b.name} {b.version}" for b in bundles)


@dataclass(frozen=True)
class _Checked:
    """The outcome of step 1: the trust root to use and the verified bundles."""

    decision: TrustDecision
    verified: Verified


def install(opts: InstallOptions, ui: InstallUI, confirm: Callable[[str], bool] | None = None) -> InstallOutcome:
    """Run the install chain into `opts.prefix`; a failure is an InstallOutcome with ok False and one-line message.

    Raises PrefixError (a prefix that cannot be one), LockHeldError and StateError, before anything is changed.
    Nothing is created until the inputs are checked: into a prefix that is not yet an Envex prefix, the media is
    verified and the trust root confirmed first, and only then are the prefix and its lock created.
    """
    prefix = check_prefix(opts.prefix, must_exist=False)
    early: _Checked | None = None
    if not is_envex_prefix(prefix):
        try:
            early = _verify(opts, ui, confirm, prefix, State())
        except (InstallError, OSError) as exc:
            return _failed(prefix, ui, State(), _message(exc))
        create_prefix(prefix)
    with PrefixLock(prefix):
        state = load_state(prefix)
        if early is not None and state != State():
            return _failed(prefix, ui, state, f"another install into {prefix} finished meanwhile; run again")
        holder: list[State] = [state]
        try:
            # Whatever a killed earlier install left running (its gate runner) goes before anything starts.
            for note in kill_leftovers(prefix):
                ui.note(note)
            state = holder[0] = reconcile(prefix, state)
            return _install_locked(opts, ui, confirm, prefix, holder, early)
        except (InstallError, LeftoverError, OSError) as exc:
            return _failed(prefix, ui, holder[0], _message(exc))


def _message(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{describe_os_error(exc)}; check the disk and the media"
    return str(exc)


def _failed(prefix: Path, ui: InstallUI, state: State, message: str) -> InstallOutcome:
    """Record and show a failed install: the unfinished release is marked failed and its slot removed."""
    last_ok = next((name for name, ok, _ in reversed(ui.results) if ok), None)
    release_id = _unfinished(state)
    if release_id is not None:
        state = _mark_failed(prefix, state, release_id, message)
    ui.fail(_next_step(last_ok), message)
    if state.active:
        ui.note(f"release {state.active} is still active")
    report = report_dir(prefix, release_id) / "gates.json" if release_id else None
    return InstallOutcome(False, message, release_id, state.active, report)


def _next_step(done: str | None) -> str:
    from envex.installer.ui import STEPS

    return STEPS[0] if done is None else STEPS[min(STEPS.index(done) + 1, len(STEPS) - 1)]


def _unfinished(state: State) -> str | None:
    return next((r.id for r in state.releases if r.status in ("installing", "gating") and r.id != state.active), None)


def _mark_failed(prefix: Path, state: State, release_id: str, message: str) -> State:
    release = state.release(release_id)
    assert release is not None
    state = state.with_release(release.model_copy(update={"status": "failed", "message": message[:2000]}))
    state = state.with_event("fail", release_id, message[:500])
    save_state(prefix, state)
    remove_release(prefix, release_id)
    return state


def _verify(
    opts: InstallOptions, ui: InstallUI, confirm: Callable[[str], bool] | None, prefix: Path, state: State
) -> _Checked:
    """Step 1: every bundle on the media verified against the pinned (or newly confirmed) trust root, the cards of
    the runtime and model to install checked, and a choice the model cannot take refused (--deterministic). Writes
    nothing."""
    scan = scan_media(opts.media)
    with ui.step("verify", total=len(scan.bundle_paths) + 1) as bar:
        decision = settle_trust(scan, state, prefix, trust_fingerprint=opts.trust_fingerprint, confirm=confirm)
        bar.advance()
        verified = verify_all(
            scan, decision.root, state, on_bundle=lambda p: bar.advance(description=f"verify {p.name}")
        )
    for note in (*decision.notes, *verified.skipped):
        ui.note(note)
    if not verified.bundles:
        raise InstallError(
            f"verify: downgrade refused: every bundle on the media is older than what this prefix already accepted "
            f"({verified.refused[0] if verified.refused else 'none verified'}); envex rollback goes back to an "
            "installed release"
        )
    # Before the prefix, its trust pin or a slot is written: the cards (a missing or bad envex-model.json, a
    # `weights` path not in the payload) and a choice the model cannot take; without a model, plan says so.
    checked = check_cards(verified.bundles, opts.model)
    if opts.deterministic and checked is not None:
        refuse_deterministic(*checked)
    return _Checked(decision, verified)


def refuse_downgrades(verified: Verified, model_name: str | None) -> None:
    """Say that a downgrade is refused, and why, when the media's only runtime or (named) model bundle is below
    the prefix's high-water mark; otherwise planning would report it as missing from the media."""
    for kind, name in (("runtime", None), ("model", model_name)):
        if any(b.kind == kind and name in (None, b.name) for b in verified.bundles):
            continue
        refused = [d for d in verified.refused if d.kind == kind and name in (None, d.name)]
        if refused:
            d = max(refused, key=lambda r: SemVer.parse(r.version))
            raise InstallError(
                f"plan: downgrade refused: the media's {kind} bundle {d.name} {d.version} is older than "
                f"{d.high_water}, the highest version this prefix has accepted (rollback protection); to go back, "
                f"run envex rollback or envex activate on an installed release, or bring media with {d.name} "
                f"{d.high_water} or newer"
            )


def _launch_setting(prefix: Path, release_id: str, name: str, default: object) -> object:
    """An installed release's engine setting `name` (its launch.json; `default` where launch.json predates it),
    None when launch.json cannot be read: a release of the same bundles is installed again when it differs."""
    from envex.installer.launch import LAUNCH_FILE, LaunchError, read_launch
    from envex.installer.release import release_dir

    try:
        manifest, _ = read_launch(release_dir(prefix, release_id) / LAUNCH_FILE)
    except LaunchError:
        return None
    return manifest.engine.get(name, default)


def _runs_deterministic(prefix: Path, release_id: str) -> bool | None:
    """Whether an installed release runs the deterministic mode (its launch.json), None when that cannot be read: a
    release of the same bundles is installed again when the admin's choice differs from it."""
    value = _launch_setting(prefix, release_id, "deterministic", None)
    return value if isinstance(value, bool) else None


def _install_locked(
    opts: InstallOptions,
    ui: InstallUI,
    confirm: Callable[[str], bool] | None,
    prefix: Path,
    holder: list[State],
    checked: _Checked | None,
) -> InstallOutcome:
    state = holder[0]
    # 1. verify every bundle on the media against the pinned (or newly confirmed) trust root
    checked = checked or _verify(opts, ui, confirm, prefix, state)
    decision, verified = checked.decision, checked.verified
    state = holder[0] = pin_trust(prefix, state, decision)
    rotated = f", rotated from v{decision.rotated_from}" if decision.rotated_from else ""
    ui.ok(
        "verify",
        f"{len(verified.bundles)} bundles verified ({_describe(verified.bundles)}); trust root "
        f"v{decision.root.version} {decision.root.fingerprint[:16]}…{rotated}",
    )
    # 2. probe the hardware
    with ui.step("probe"):
        found = probe(prefix, want_gpu=opts.use_gpu)
    for note in found.notes:
        ui.note(note)
    ui.ok("probe", found.summary())
    # 3. plan
    with ui.step("plan"):
        refuse_downgrades(verified, opts.model)
        plan = make_plan(verified.bundles, found, model_name=opts.model, max_model_len=opts.max_model_len,
                         deterministic=opts.deterministic, reference=opts.reference,
                         kv_cache_dtype=opts.kv_cache_dtype, weights_policy=opts.weights)  # fmt: skip
    for note in plan.notes:
        ui.note(note)
    ui.ok("plan", plan.summary())
    refs = [bundle_ref(b) for b in plan.bundles]
    active = state.release(state.active) if state.active else None
    if (
        not opts.reinstall
        and active is not None
        and active.mode == plan.mode
        and sorted(r.manifest_sha256 for r in active.bundles) == sorted(r.manifest_sha256 for r in refs)
        and _runs_deterministic(prefix, active.id) == plan.engine["deterministic"]
        and _launch_setting(prefix, active.id, "kv_cache_dtype", "bf16") == plan.engine["kv_cache_dtype"]
        and _launch_setting(prefix, active.id, "weights", None) == plan.engine.get("weights")
    ):
        message = f"release {active.id} already runs exactly these bundles; nothing to do (--reinstall to redo)"
        ui.ok("install", message)
        return InstallOutcome(True, message, active.id, active.id)
    # 4. install into a new slot
    release_id = f"{state.next_release_number():04d}-{plan.model.name}-{plan.model.version}"
    release = Release(id=release_id, created=now_ts(), status="installing", bundles=refs, mode=plan.mode)  # type: ignore[arg-type]
    state = holder[0] = state.with_release(release).with_event("install", release_id)
    save_state(prefix, state)
    with ui.step("install", total=4) as bar:
        launch = build_release(
            prefix, release_id, plan, on_progress=lambda what, _n: bar.advance(description=f"install {what}")
        )
    keep_bundle_files(prefix, plan.bundles)
    state = holder[0] = state.with_release(release.model_copy(update={"status": "gating"}))
    save_state(prefix, state)
    ui.ok(
        "install", f"release {release_id} in {prefix / 'releases' / release_id} (envex {launch.runtime.envex_version})"
    )
    # 5. gates and benchmark, on this machine, by the release itself
    with ui.step("gates"):
        summary, gate_report = run_checks(
            prefix,
            release_id,
            plan.model_card,
            suite=opts.suite,
            bench=opts.bench,
            reference=plan.reference,
            signed_references=plan.signed_references,
            injected_report=opts.test_gates_report,
        )
    gated = state.release(release_id)
    assert gated is not None
    state = holder[0] = state.with_release(gated.model_copy(update={"checks": summary}))
    save_state(prefix, state)
    failed = sorted(name for name, verdict in summary.gates.items() if verdict == "fail")
    if summary.verdict != "pass":
        # A band gate (a packed KV cache, a weights policy) says why in one line naming its figures: shown here.
        details = gate_report.get("details") if isinstance(gate_report, dict) else None
        reasons = [str(d["reason"]) for name in failed
                   if isinstance(details, dict) and isinstance(d := details.get(name), dict) and "reason" in d]
        raise InstallError(
            f"gates: {len(failed)} failed ({', '.join(failed) or 'no gate ran'}){''.join(': ' + r for r in reasons)}"
            f"; report: {prefix / summary.report}; nothing was activated"
        )
    figures = "; " + ", ".join(f"{k} {v:g}" for k, v in list(summary.bench.items())[:3]) if summary.bench else ""
    against = f", {summary.reference} reference" if summary.reference else ""
    ui.ok("gates", f"{len(summary.gates)} gates passed ({summary.suite} suite{against}){figures}")
    # 6. activate: launch.json, state.json, `current`, unit file
    with ui.step("activate"):
        state = holder[0] = finish_activation(prefix, state, release_id, launch)
    ui.ok(
        "activate",
        f"{release_id} is active: {prefix / 'current'} ; serve with envex serve --launch "
        f"{prefix / 'current' / 'launch.json'} (unit file {prefix / 'envex.service'})",
    )
    # The admin page's token: created at the first install, shown only now; the prefix keeps only its hash.
    if not has_admin_token(prefix):
        ui.note(f"admin token for the /admin page (shown once; note it now): {create_admin_token(prefix)}")
    return InstallOutcome(True, f"{release_id} active", release_id, release_id)
