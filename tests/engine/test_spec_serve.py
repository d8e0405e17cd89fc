"""Speculative decoding outside the engine: ``flashpage serve --speculative-config``, ``/metrics`` and
``flashpage bench spec``."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import MODEL, metrics, tiny_server

from flashpage.bench.spec import DEFAULT_SPEC, format_report, run
from flashpage.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_mx": 3}', "unknown key(s) ['prompt_lookup_mx']"),
    ("ngram", "is not JSON"),
])
def test_serve_refuses_a_bad_speculative_config_before_loading(capsys, value, message):
    assert main(["serve", "--port", "1", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashpage serve: error:") and message in err


def test_served_completions_speculate_and_metrics_count_it():
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"
    with tiny_server(speculative_config=NGRAM) as (server, _):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": text, "max_tokens": 48, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 48
        m = metrics(server.url)
    assert m["flashpage_spec_decode_num_drafts_total"] > 0
    assert m["flashpage_spec_decode_num_draft_tokens_total"] >= m["flashpage_spec_decode_num_accepted_tokens_total"] > 0


def test_bench_spec_runs_and_reports():
    result = run([1], 24, 1, DEFAULT_SPEC, repeats=1)
    rows = result["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [("copy", 1), ("open", 1)]
    assert rows[0]["identical"] is True and rows[0]["acceptance_length"] > 1.0
    assert all(r["tokens_per_s_base"] > 0 and r["tokens_per_s_spec"] > 0 for r in rows)
    assert "copy" in format_report(result) and "ratio" in format_report(result)
