"""`flashpage bench serve` against an in-process server: the report's figures and its CLI."""

from __future__ import annotations

import math

import pytest
from serve_helpers import tiny_server

from flashpage.bench import serve as bench
from flashpage.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def test_bench_serve_measures_every_rate(tmp_path) -> None:
    with tiny_server() as (server, engine):
        result = bench.run(server.url, rates=[50.0, math.inf], num_prompts=6, max_tokens=5, transformers=False)
        assert engine.stats().blocks_used == 0
    rows = result["systems"]["flashpage"]
    assert [r["rate"] for r in rows] == [50.0, "inf"]
    for r in rows:
        assert r["failed"] == 0 and r["requests"] == 6 and r["output_tokens"] >= 6
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["output_tokens_per_s"] > 0
    assert result["transformers_note"] == "skipped (--no-transformers)"
    text = bench.format_report(result)
    assert "TTFT p50" in text and "flashpage" in text
    bench.write_plot(result, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").stat().st_size > 1000


def test_bench_serve_cli_rejects_bad_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--request-rates", "fast", "--no-transformers"]) == 2
    assert "--request-rates 'fast'" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rates", "0,2", "--no-transformers"]) == 2
    with pytest.raises(ValueError, match="must be > 0"):
        bench.parse_rates("-1")
