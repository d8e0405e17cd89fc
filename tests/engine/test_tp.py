"""Tensor parallelism across processes: two ranks under torchrun (gloo, CPU, loopback rendezvous).

One torchrun run of tests/tp_worker.py (about 25 s on 2 cores) serves every test here: greedy
patched generate() and LLM equal to the single-process model, each rank's pool holding its half of
the KV heads, unseeded / seeded / stop-string sampling equal on both ranks, a preemption-heavy run
equal to the single-process one, speculative decoding (n-gram and a draft model) equal to the
single-process run without it, an abort made on rank 0 alone, and a divergence both ranks refuse.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tp_worker
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashpage
from flashpage import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' reports; the processes must exit by themselves within TIMEOUT_S."""
    out = tmp_path_factory.mktemp("tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(Path(tp_worker.__file__)), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "FLASHPAGE_TP_TIMEOUT_S": "90"}
    log_path = out / "torchrun.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:  # each rank also has its own watchdog (tp_worker.WATCHDOG_S) and collective timeout
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            proc.wait(timeout=30)
            pytest.fail(f"the two TP ranks did not exit within {TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def single() -> tuple[Any, Any]:
    path = flashpage.tiny_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_patched_generate_matches_single_process(ranks: list[dict[str, Any]], single: tuple[Any, Any]) -> None:
    model, tok = single
    batch = tok(tp_worker.PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left")
    want = model.generate(**batch, max_new_tokens=12, do_sample=False).tolist()  # transformers, unpatched
    for r in ranks:
        assert r["generate"]["sequences"] == want
    # sampling generate(): sync_rng() gives every rank rank 0's RNG, so the draws agree
    assert ranks[0]["generate"]["sampled"] == ranks[1]["generate"]["sampled"] != want
    # each rank stores its own KV head (of 2) for the same tokens: half the single-process bytes
    flashpage.patch(model)
    try:
        full = model.generate(**batch, max_new_tokens=12, do_sample=False, return_dict_in_generate=True).cache
    finally:
        flashpage.unpatch(model)
    assert full.kv.num_kv_heads == 2
    for r in ranks:
        assert r["generate"]["kv_heads"] == 1
        assert r["generate"]["tokens_stored"] == full.memory_stats().tokens_stored
        assert 2 * r["generate"]["bytes_in_use"] == full.memory_stats().bytes_in_use


def test_llm_greedy_matches_single_process_and_pool_is_per_rank(ranks: list[dict[str, Any]],
                                                                 single: tuple[Any, Any]) -> None:
    llm = LLM(*single, max_num_seqs=8, kv_cache_memory=1 << 22)
    outs = llm.generate(tp_worker.PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    s = llm.stats()
    assert (s.tp_rank, s.tp_size, s.kv_heads) == (0, 1, 2)
    for rank, r in enumerate(ranks):
        g = r["greedy"]
        assert g["tokens"] == [o.outputs[0].token_ids for o in outs]
        assert (g["tp_rank"], g["tp_size"], g["kv_heads"]) == (rank, 2, 1)
        # the same byte budget holds twice the blocks when a rank stores half the heads
        assert g["num_blocks"] == 2 * s.blocks_total
        assert g["kv_bytes"] == s.kv_bytes == 1 << 22


def test_preemption_heavy_run_matches_single_process(ranks: list[dict[str, Any]], single: tuple[Any, Any]) -> None:
    want = tp_worker.preemption_llm(*single)
    assert want["preemptions"] > 0
    assert ranks[0]["preemption"] == ranks[1]["preemption"] == want


def test_sampling_is_the_same_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks[0]["sampling"], ranks[1]["sampling"]
    assert a["unseeded"] == b["unseeded"]  # each rank's global RNG was seeded differently
    assert a["seeded"] == b["seeded"]
    assert all(len(o[0]) == 16 and o[0] != o[1] for o in a["seeded"])  # n=2: two different samples
    flat_a, flat_b = sum(a["logprobs"], []), sum(b["logprobs"], [])
    assert len(flat_a) == 3 * 16 and flat_a == pytest.approx(flat_b, abs=1e-5)
    assert a["stops"] == b["stops"]
    reasons = {reason for _text, reason, _ids in a["stops"]}
    assert "stop" in reasons and not any(" the" in text or "." in text for text, _r, _ids in a["stops"])


def test_speculation_matches_single_process_without_it(ranks: list[dict[str, Any]], single: tuple[Any, Any]) -> None:
    """n-gram and draft-model speculation on 2 ranks: greedy equals the single-process LLM without speculation,
    and the ranks proposed, accepted and verified the same; unseeded sampling (each rank's RNG seeded
    differently) keeps rank 0's verified tokens on both."""
    want = LLM(*single, max_num_seqs=8, kv_cache_memory=1 << 22).generate(tp_worker.SPEC_PROMPTS,
                                                                           tp_worker.SPEC_PARAMS, use_tqdm=False)
    want_ids = [o.outputs[0].token_ids for o in want]
    a, b = ranks[0]["speculative"], ranks[1]["speculative"]
    for method in ("ngram", "draft"):
        assert a[method] == b[method] == want_ids, method
        assert a[f"{method}_counts"] == b[f"{method}_counts"], method
        proposed, accepted, verifications, _length = a[f"{method}_counts"]
        assert proposed > 0 and accepted > 0 and verifications > 0, method
    assert a["draft_counts"][1] == a["draft_counts"][0]  # the draft is the model itself: every proposal holds
    assert a["ngram_sampled"] == b["ngram_sampled"] and a["ngram_sampled_counts"] == b["ngram_sampled_counts"]
    assert a["ngram_sampled_counts"][0] > a["ngram_counts"][0]  # the sampled run verified proposals too


def test_abort_on_one_rank_ends_the_request_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks[0]["aborts"], ranks[1]["aborts"]
    assert a["final"] == b["final"]
    tokens, reason = a["final"]["b"]
    assert reason == "abort" and 0 < len(tokens) < 30
    assert [a["final"][rid][1] for rid in ("a", "c")] == ["length", "length"]
    assert a["streamed"] == b["streamed"] and len(a["streamed"]) == 7
    assert a["after"] == b["after"] and a["running"] == b["running"] == 0


def test_driver_and_follower_run_the_same_steps(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks[0]["driver"], ranks[1]["driver"]
    assert len(a["tokens"]) == 4 and all(len(t) > 0 for t in a["tokens"])
    assert a["d"] == [["abort", 2]]  # aborted after two steps, reported by the next one
    assert a["steps"] == b["steps"] > 0
    assert b["follower_steps"] == a["steps"] + 1  # + the step that only applied the abort
    assert a["generated"] == b["generated"]
    assert a["spmd_after"] == b["spmd_after"]


def test_divergent_ranks_both_raise(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        d = r["divergence"]
        assert d["error"] is not None and "scheduled a different step" in d["error"]
        assert "same prompts" in d["error"]
        assert d["running"] == d["waiting"] == 0


def test_bench_tp_reports_per_rank_kv_and_agreement(tmp_path: Path) -> None:
    """`flashpage bench tp --quick`: one torchrun per size; a rank of 2 holds half the KV bytes per token."""
    cmd = [sys.executable, "-m", "flashpage.cli", "bench", "tp", "--quick", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    one, two = result["runs"]
    assert (one["tp_size"], two["tp_size"]) == (1, 2) and result["outputs_agree"]
    assert two["ranks_agree"] and two["tokens_equal_tp1"]
    (solo,), halves = one["ranks"], two["ranks"]
    assert [r["rank"] for r in halves] == [0, 1]
    for r in halves:
        assert (solo["kv_heads"], r["kv_heads"]) == (2, 1)
        assert 2 * r["kv_bytes_per_token"] == solo["kv_bytes_per_token"]
        assert 2 * r["pool_bytes"] == solo["pool_bytes"] and 0 < r["peak_kv_bytes"] <= r["pool_bytes"]
        assert r["output_tokens_per_s"] > 0


def test_serve_tensor_parallel_two_ranks(single: tuple[Any, Any]) -> None:
    """`flashpage serve --tensor-parallel-size 2` starts its own torchrun: rank 0 serves HTTP, rank 1
    follows; greedy equals the single-process engine, a stream left mid-way is aborted on both ranks
    (the next requests still agree), and SIGTERM drains and exits 0."""
    import httpx

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHPAGE_TP_TIMEOUT_S": "90"}
    proc = subprocess.Popen([sys.executable, "-m", "flashpage.cli", "serve", "--tensor-parallel-size", "2",
                             "--port", str(port), "--log-level", "warning", "--max-num-seqs", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    llm = LLM(*single, max_num_seqs=8)
    try:
        _wait_up(proc, url)
        body = {"model": "flashpage-tiny", "prompt": tp_worker.PROMPTS[:3], "max_tokens": 16, "temperature": 0}
        got = [c["text"] for c in httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]]
        want = llm.generate(tp_worker.PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        assert got == [o.outputs[0].text for o in want]
        stream = {**body, "prompt": "The list", "max_tokens": 200, "stream": True, "temperature": 1.0,
                  "ignore_eos": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=stream) as r:
            assert r.status_code == 200
            for i, _line in enumerate(r.iter_lines()):
                if i >= 6:
                    break  # disconnect: the server aborts the request on both ranks
        sampled = {**body, "temperature": 1.0, "n": 2}
        assert len(httpx.post(f"{url}/v1/completions", json=sampled, timeout=60).json()["choices"]) == 6
        again = [c["text"] for c in httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]]
        assert again == got
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"flashpage serve -tp 2 did not stop on SIGTERM:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "stopped (all requests finished)" in out


def _wait_up(proc: subprocess.Popen, url: str, timeout: float = 120.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail("flashpage serve -tp 2 did not come up")


def test_readme_tensor_parallel_example_runs(tmp_path: Path) -> None:
    """README's 'Tensor parallel' script, as written, under torchrun with 2 ranks: same text on both,
    one KV head each."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "tensor-parallel.md").read_text(encoding="utf-8")
    block = re.search(r"# Tensor parallel\n.*?```python\n(.*?)```", readme, re.S)
    assert block, "docs/tensor-parallel.md has no Tensor parallel python block"
    script = tmp_path / "tp.py"
    script.write_text(block.group(1), encoding="utf-8")
    # each rank's stdout to its own file (--redirects 1): the two ranks' prints into one pipe interleave
    # ("10 1 536870912 ..." was rank 1's "1" inside rank 0's line)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--log-dir", str(tmp_path / "logs"), "--redirects", "1", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHPAGE_TP_TIMEOUT_S": "90"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stdout = "\n".join(f.read_text() for f in sorted((tmp_path / "logs").rglob("stdout.log")))
    # each rank prints "rank kv_heads kv_bytes text"; the sampled text may hold newlines (a line "1 to ...")
    lines = sorted(line.split(" ", 3) for line in stdout.splitlines() if re.match(r"[01] \d+ \d+ ", line))
    assert [rank for rank, *_ in lines] == ["0", "1"], f"stdout: {stdout!r}\nstderr: {proc.stderr[-2000:]}"
    (_, heads0, bytes0, text0), (_, heads1, bytes1, text1) = lines
    assert heads0 == heads1 == "1" and bytes0 == bytes1 and text0 == text1


def test_step_digest_is_process_independent_and_sensitive() -> None:
    from flashpage.engine.distributed import step_digest

    base = step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], [("c", 0)])
    assert base == step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], [("c", 0)])
    assert base == 0x7EB7BF4B4E94FAAF  # fixed by blake2b: the same in every process (no salted str hash)
    for other in ([("a", 0, 0, [1, 2, 4]), ("b", 1, 5, [7])], [("a", 0, 1, [1, 2, 3]), ("b", 1, 5, [7])],
                  [("b", 1, 5, [7]), ("a", 0, 0, [1, 2, 3])], [("a", 0, 0, [1, 2, 3])]):
        assert step_digest(other, [("c", 0)]) != base
    assert step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], []) != base
    # speculative proposals: which of a chunk's tokens are proposed counts; none proposed hashes as before
    assert step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], [("c", 0)], [0, 0]) == base
    spec = step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], [("c", 0)], [2, 0])
    assert spec != base and spec != step_digest([("a", 0, 0, [1, 2, 3]), ("b", 1, 5, [7])], [("c", 0)], [1, 0])


def test_tp_helpers_refuse_a_single_process_llm(single: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from flashpage.engine.distributed import control_timeout, drive, follow, sync_rng

    llm = LLM(*single, max_num_seqs=2, kv_cache_memory=1 << 20)
    assert llm.stats().tp_size == 1
    with pytest.raises(ValueError, match="not tensor-parallel"):
        follow(llm)
    with pytest.raises(ValueError, match="not tensor-parallel"), drive(llm):
        pass
    sync_rng(single[0])  # a no-op without TP
    with pytest.raises(ValueError, match="sharded over 1 rank"):
        LLM(*single, tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        LLM(flashpage.tiny_model_path(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="positive int"):
        LLM(*single, tensor_parallel_size=0)
    monkeypatch.setenv("FLASHPAGE_TP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FLASHPAGE_TP_TIMEOUT_S='soon'"):
        control_timeout()
    monkeypatch.setenv("FLASHPAGE_TP_TIMEOUT_S", "12.5")
    assert control_timeout().total_seconds() == 12.5
