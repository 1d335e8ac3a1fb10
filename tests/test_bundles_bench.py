"""The benchmark script runs end to end on a small bundle and reports what the lab's journal records
(verify/lab/journal.md, "Bundle verification")."""

from __future__ import annotations

from pathlib import Path

from envex.verify.bench_bundle_verify import markdown, run


def test_bench_verify_small(tmp_path: Path) -> None:
    result = run(0.01, tmp_path, repeats=1, shards=2)
    assert result["bundle_bytes"] > result["payload_bytes"] > 10_000_000
    assert result["sha256sum_median_s"] > 0 and result["verify_median_wall_s"] > 0
    assert result["verify_peak_rss_bytes"] > 10 * 1024 * 1024
    assert [row["tool"] for row in result["rows"]] == ["sha256sum", "verify_bundle"]
    assert "of sha256sum's speed" in markdown(result)
    assert list(tmp_path.iterdir()) == []  # everything it wrote is gone
