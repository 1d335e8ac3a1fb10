"""Benchmark: `verify_bundle` against `sha256sum` on the same multi-GB bundle file, in the same run.

    python -m envex.verify.bench_bundle_verify --size-gb 4 [--dir /tmp] [--repeats 3] [--shards 4]

Builds a signed model-like bundle of `--shards` weight files totalling `--size-gb` GiB under a fresh directory in
`--dir` (checking free space first), reads it once to warm the page cache, then alternates `sha256sum BUNDLE` and
a verifying child process `--repeats` times. Each verification runs in its own process, so its peak RSS (from
wait4) is its own; a verification of a tiny bundle gives the interpreter's baseline RSS, so the difference is
what hashing gigabytes costs in memory. Prints a Markdown table and JSON; deletes everything it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from envex.bundles.build import build_bundle, sign_bundle
from envex.bundles.keys import generate_key
from envex.bundles.trust import make_root, sign_root

GIB = 1024**3
_CHILD = """
import json, sys, time
from envex.bundles import load_root, verify_bundle
root = load_root(sys.argv[2])
start = time.perf_counter()
verified = verify_bundle(sys.argv[1], root=root)
seconds = time.perf_counter() - start
# VmHWM is this process's own peak RSS; rusage's ru_maxrss would also count the parent's pages at fork time.
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "bytes": verified.total_bytes, "peak_rss": hwm}))
"""


def _run_timed(argv: list[str]) -> tuple[float, float, str]:
    """Run a child to completion; return (wall seconds, its CPU seconds, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.run(argv, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({child.returncode}): {child.stderr.decode(errors='replace')[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, child.stdout.decode()


def _write_shards(src: Path, total: int, shards: int) -> None:
    block = os.urandom(16 * 1024 * 1024)  # content does not change hashing speed; a repeated block writes fast
    src.mkdir(parents=True)
    for i in range(shards):
        size = total // shards + (total % shards if i == shards - 1 else 0)
        with open(src / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as out:
            left = size
            while left:
                n = min(left, len(block))
                out.write(block[:n])
                left -= n


def _verify_child(bundle: Path, root: Path) -> dict[str, Any]:
    wall, cpu, out = _run_timed([sys.executable, "-c", _CHILD, str(bundle), str(root)])
    inner = json.loads(out)
    return {"wall_s": wall, "cpu_s": cpu, "in_call_s": inner["seconds"], "peak_rss": inner["peak_rss"]}


def run(size_gb: float, directory: Path, repeats: int, shards: int) -> dict[str, Any]:
    total = int(size_gb * GIB)
    free = shutil.disk_usage(directory).free
    need = 2 * total + GIB  # the source shards and the bundle exist together while building
    if free < need:
        raise SystemExit(f"{directory} has {free / GIB:.1f} GiB free; this run needs {need / GIB:.1f} GiB")
    work = Path(tempfile.mkdtemp(prefix="envex-bench-", dir=directory))
    try:
        key = generate_key()
        root = sign_root(make_root(root_keys=[key], bundle_keys=[key], expires=datetime.now(UTC) + timedelta(1)), [key])
        root_path = work / "root.json"
        root_path.write_bytes(root.to_bytes())
        _write_shards(work / "src", total, shards)
        started = time.perf_counter()
        bundle = build_bundle(work / "src", kind="model", name="bench", version="1.0.0", out=work)
        build_s = time.perf_counter() - started
        sign_bundle(bundle, [key])
        shutil.rmtree(work / "src")
        tiny_src = work / "tiny"
        tiny_src.mkdir()
        (tiny_src / "config.json").write_text("{}")
        tiny = build_bundle(tiny_src, kind="model", name="tiny", version="1.0.0", out=work)
        sign_bundle(tiny, [key])
        size = bundle.stat().st_size
        subprocess.run(["cat", str(bundle)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        baseline = _verify_child(tiny, root_path)
        rows: list[dict[str, Any]] = []
        for _ in range(repeats):  # interleaved, so drift affects both alike
            sha_wall, sha_cpu, _ = _run_timed(["sha256sum", str(bundle)])
            rows.append({"tool": "sha256sum", "wall_s": sha_wall, "cpu_s": sha_cpu, "peak_rss": None})
            rows.append({"tool": "verify_bundle", **_verify_child(bundle, root_path)})
        sha = statistics.median(r["wall_s"] for r in rows if r["tool"] == "sha256sum")
        ver = statistics.median(r["wall_s"] for r in rows if r["tool"] == "verify_bundle")
        ver_call = statistics.median(r["in_call_s"] for r in rows if r["tool"] == "verify_bundle")
        peak = max(r["peak_rss"] for r in rows if r["tool"] == "verify_bundle")
        return {
            "bundle_bytes": size,
            "payload_bytes": total,
            "shards": shards,
            "build_s": build_s,
            "repeats": repeats,
            "sha256sum_median_s": sha,
            "verify_median_wall_s": ver,
            "verify_median_in_call_s": ver_call,
            "sha256sum_MBps": size / sha / 1e6,
            "verify_MBps_wall": size / ver / 1e6,
            "ratio_wall": sha / ver,
            "ratio_in_call": sha / ver_call,
            "verify_peak_rss_bytes": peak,
            "tiny_bundle_peak_rss_bytes": baseline["peak_rss"],
            "rows": rows,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(result: dict[str, Any]) -> str:
    mib = 1024 * 1024
    lines = [
        "| run | tool | wall (s) | CPU (s) | MB/s | peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(result["rows"]):
        speed = result["bundle_bytes"] / row["wall_s"] / 1e6
        rss = "—" if row["peak_rss"] is None else f"{row['peak_rss'] / mib:.0f}"
        lines.append(
            f"| {i // 2 + 1} | {row['tool']} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {speed:.0f} | {rss} |"
        )
    lines += [
        "",
        f"Median: sha256sum {result['sha256sum_median_s']:.2f} s, verify_bundle {result['verify_median_wall_s']:.2f} s "
        f"(whole process, {result['verify_median_in_call_s']:.2f} s inside the call): verification runs at "
        f"**{result['ratio_wall']:.0%}** of sha256sum's speed ({result['ratio_in_call']:.0%} counting the call only). "
        f"Peak RSS {result['verify_peak_rss_bytes'] / mib:.0f} MiB verifying {result['bundle_bytes'] / GIB:.2f} GiB, "
        f"against {result['tiny_bundle_peak_rss_bytes'] / mib:.0f} MiB verifying a one-file bundle.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-gb", type=float, default=4.0, help="payload size in GiB (default 4)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (default /tmp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4, help="payload files, like safetensors shards (default 4)")
    parser.add_argument("--json", type=Path, help="also write the full result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.size_gb, args.dir, args.repeats, args.shards)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
