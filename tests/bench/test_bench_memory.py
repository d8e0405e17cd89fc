"""``flashpage bench memory`` on the built-in checkpoint: every case runs in its own process (``flashpage serve``
as its HTTP front and engine process), the peaks are real (above the weights), each within weights + KV pool +
1 GiB, and the flashpage cases' greedy tokens (the server's texts) equal unpatched transformers' (float32)."""

from __future__ import annotations

import sys

import pytest

from flashpage.bench.memory import CASES, MemoryWorkload, format_report, run
from flashpage.tiny import tiny_model_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="samples /proc (psutil, Linux)")


def test_bench_memory_on_the_builtin_checkpoint() -> None:
    workload = MemoryWorkload(num_requests=3, prompt_len=24, max_tokens=6, kv_cache_memory=16 << 20)
    result = run(str(tiny_model_path()), workload)
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == set(CASES)
    for case, r in rows.items():
        assert not r["error"], f"{case}: {r['error']}"
        assert r["weights"] < r["peak"] <= r["weights"] + r["pool"] + (1 << 30), (case, r)
    assert rows["flashpage-llm"]["pool"] > 0 and rows["transformers"]["pool"] == 0
    assert rows["flashpage-generate"]["tokens_equal_transformers"] is True
    assert rows["flashpage-llm"]["tokens_equal_transformers"] is True
    assert rows["flashpage-serve"]["tokens_equal_transformers"] is True
    assert rows["flashpage-serve"]["pool"] == workload.kv_cache_memory
    report = format_report(result)
    assert "flashpage-llm" in report and "flashpage-serve" in report and "= transformers" in report


def test_tree_rss_leaves_out_a_fork_that_has_not_exec_d() -> None:
    """A child forked without exec (its command line still its parent's) shares its parent's pages: the tree's
    sum counts the parent once, not twice."""
    import subprocess
    import time

    import psutil

    from flashpage.bench.memory import _tree_rss

    code = "import os, time\nblock = bytearray(64 << 20)\nos.fork()\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 20
        while not parent.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (fork,) = parent.children()
        assert fork.cmdline() == parent.cmdline()
        own = parent.memory_info().rss
        assert own > 64 << 20 and fork.memory_info().rss > 64 << 20  # each reports the shared pages
        assert abs(_tree_rss(proc.pid) - own) < 8 << 20  # counted once
    finally:
        for p in psutil.Process(proc.pid).children():
            p.kill()
        proc.kill()
        proc.wait()
