"""Time the installer's work on the demo model bundle against a plain copy of the same file (the baseline).

    python -m envex.verify.lab.bench_install [--repeats 5]

Prints one JSON object: median seconds of `cp` (shutil.copyfile + fsync), `verify_bundle`, `extract` (re-hashing
copy into a fresh directory), and a whole `envex-install` with an injected gate report (verify, probe, plan,
install with venv, activate; the gates' own time is the benchmark's business), each with its ratio to the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from envex.bundles import verify_bundle
from envex.installer.demo import build_demo_media, build_envex_wheel
from envex.tests.support.installer import PASS_REPORT


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="envex-bench-install-") as tmp_name:
        tmp = Path(tmp_name)
        wheel = build_envex_wheel(tmp / "wheel")
        media = build_demo_media(tmp / "media", tmp / "keys", wheel=wheel)
        bundle = next((media.media / "bundles").glob("smollm2-*.envex"))
        (tmp / "pass.json").write_text(json.dumps(PASS_REPORT))
        times: dict[str, list[float]] = {"copy": [], "verify": [], "extract": [], "install": []}
        for i in range(args.repeats):

            def copy(i: int = i) -> None:
                target = tmp / f"copy-{i}"
                shutil.copyfile(bundle, target)
                with open(target, "rb") as handle:
                    os.fsync(handle.fileno())

            times["copy"].append(_time(copy))
            verified = verify_bundle(bundle, root=media.media / "trust" / "root.json")
            times["verify"].append(_time(lambda: verify_bundle(bundle, root=media.media / "trust" / "root.json")))
            times["extract"].append(_time(lambda i=i, v=verified: v.extract(tmp / f"extract-{i}")))
            cmd = [
                sys.executable,
                "-m",
                "envex.installer.cli",
                "--media",
                str(media.media),
                "--prefix",
                str(tmp / f"prefix-{i}"),
                "--trust-fingerprint",
                media.fingerprint,
                "--yes",
            ]
            env = {**os.environ, "ENVEX_TEST_GATES_REPORT": str(tmp / "pass.json")}
            times["install"].append(
                _time(lambda cmd=cmd, env=env: subprocess.run(cmd, env=env, check=True, capture_output=True))
            )
            shutil.rmtree(tmp / f"prefix-{i}")
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(
            json.dumps(
                {
                    "bundle_bytes": bundle.stat().st_size,
                    "repeats": args.repeats,
                    "median_seconds": {k: round(v, 3) for k, v in medians.items()},
                    "ratio_to_copy": {k: round(v / medians["copy"], 2) for k, v in medians.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
