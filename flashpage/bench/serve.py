"""`flashpage bench serve`: Poisson arrivals at several request rates against OpenAI-compatible servers.

As vLLM's serving benchmark does: for each rate, ``--num-prompts`` streamed ``/v1/completions``
requests are sent with exponential inter-arrival times (rate ``inf``: all at once), and the client
measures request and output-token throughput, time to first token (send -> first text chunk) and
inter-token latency (gaps between text chunks), p50 and p99. The servers:

- flashpage: ``--base-url`` of a running server, or ``flashpage serve`` started here in a subprocess;
- transformers: ``transformers serve MODEL --continuous-batching`` started here in a subprocess
  (offline, the same local model), the same workload. Requests are greedy without ``ignore_eos``
  (transformers serve has none), so both servers produce the same tokens and the text of every
  request is compared (``outputs_agree``). If it cannot start, the report says why.

The prompts are seeded sentences of 4..60 words; every request asks for ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from flashpage.errors import install_hint
from flashpage.serve.ports import free_port

WORDS = ("the list module returns a new value of each object in the file when the function is called with "
         "an optional argument that must be a string or bytes and raises an exception if the key is not found "
         "in the dictionary").split()
STARTUP_TIMEOUT = 180.0


@dataclass
class RequestResult:
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))).capitalize() for _ in range(n)]


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ client side
async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    return res
                usage = (event.get("usage") or {}).get("completion_tokens", usage)
                text = "".join(c.get("text") or "" for c in event.get("choices", []))
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.text += text
                res.tokens += 1
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.tokens = usage if usage is not None else res.tokens
    res.latency = time.perf_counter() - start
    res.ok = True
    return res


async def _run_rate(url: str, model: str, prompts: list[str], rate: float, max_tokens: int,
                    seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await _one(client, url, {**body, "prompt": "Warm up", "max_tokens": 2})
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one(client, url, {**body, "prompt": prompt})))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tpots = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    ms = lambda v: None if v is None else round(v * 1e3, 2)
    e2e = _pct([r.latency for r in ok], 50)
    return {
        "rate": _rate(rate), "requests": len(results), "failed": len(results) - len(ok),
        "duration_s": round(duration, 3), "request_throughput": round(len(ok) / duration, 3),
        "output_tokens": sum(r.tokens for r in ok),
        "output_tokens_per_s": round(sum(r.tokens for r in ok) / duration, 1),
        "ttft_p50_ms": ms(_pct(ttfts, 50)), "ttft_p99_ms": ms(_pct(ttfts, 99)),
        "itl_p50_ms": ms(_pct(itls, 50)), "itl_p99_ms": ms(_pct(itls, 99)), "tpot_p50_ms": ms(_pct(tpots, 50)),
        "e2e_p50_s": None if e2e is None else round(e2e, 3), "e2e_p50_ms": ms(e2e),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def bench_server(url: str, model: str, prompts: list[str], rates: list[float], max_tokens: int,
                 seed: int, label: str) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Run every rate against one server: per-rate summaries and per-rate output texts."""
    rows, texts = [], []
    group = SERVER_GROUPS.get(url)
    for k, rate in enumerate(rates):
        cpu, server_cpu = time.process_time(), group_cpu_seconds(group)
        results, duration = asyncio.run(_run_rate(url, model, prompts, rate, max_tokens, seed + k))
        row = summarize(rate, results, duration)
        row["client_cpu_s"] = round(time.process_time() - cpu, 3)  # this process: the client shares the cores
        after = group_cpu_seconds(group)
        row["server_cpu_s"] = None if after is None or server_cpu is None else round(after - server_cpu, 3)
        _log(f"{label} rate {row['rate']}: {row['output_tokens_per_s']} tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
             f"ITL p50 {row['itl_p50_ms']} ms, failed {row['failed']}")
        rows.append(row)
        texts.append([r.text if r.ok else None for r in results])
    return rows, texts


# ------------------------------------------------------------------------------------ server side
SERVER_GROUPS: dict[str, int] = {}  # base URL -> process group of a server started_server() runs


def group_cpu_seconds(pgid: int | None) -> float | None:
    """User + system CPU seconds of the live processes in process group ``pgid`` (a server and the engine
    processes it started), from /proc; None without a group or /proc. Processes that ended are not counted."""
    if pgid is None or not os.path.isdir("/proc"):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields: state, ppid, pgrp, ..., utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def wait_quiet(url: str, timeout: float = 20.0, window: float = 0.5, share: float = 0.05) -> float:
    """Wait until the server at ``url`` (one ``started_server`` runs) uses under ``share`` of a core over
    ``window`` seconds, at most ``timeout`` seconds; returns the seconds waited. vLLM's processes keep
    spinning for about a second after a burst (measured: 1.0 CPU s in the 5 s after a rate-inf run, 0.08
    later), on the core its worker is bound to: the next server's run must not start under that."""
    group = SERVER_GROUPS.get(url)
    start = time.monotonic()
    if group is None:
        return 0.0
    while time.monotonic() - start < timeout:
        before = group_cpu_seconds(group)
        time.sleep(window)
        after = group_cpu_seconds(group)
        if before is None or after is None or after - before < share * window:
            break
    return time.monotonic() - start


@contextmanager
def started_server(cmd: list[str], port: int, env: dict[str, str] | None = None, timeout: float = STARTUP_TIMEOUT,
                   replace_env: bool = False, on_spawn: Callable[[int], None] | None = None) -> Iterator[str]:
    """Run ``cmd`` (a server on ``port``) until /health answers (at most ``timeout`` s); afterwards SIGTERM
    its whole process group (servers such as vLLM's start engine processes), then SIGKILL it if it lingers.
    ``env`` is added to this process's environment, or replaces it with ``replace_env``. ``on_spawn`` gets the
    server's pid as soon as it is started (before it answers)."""
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(env or {}) if replace_env else {**os.environ, **(env or {})})
    try:
        if on_spawn is not None:
            on_spawn(proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited with {proc.returncode}: {log.read()[-400:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"`{' '.join(cmd[:4])} ...` did not answer /health in {timeout:.0f} s: "
                                   f"{log.read()[-400:]}")
            time.sleep(0.25)
        SERVER_GROUPS[url] = proc.pid  # its own session: the group id is its pid
        yield url
    finally:
        SERVER_GROUPS.pop(url, None)
        _stop_group(proc)
        log.close()


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the process group of ``proc`` (its leader), wait, then SIGKILL what is left of it."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # the whole group is gone
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the leader is gone; children it started may linger a moment
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def _flashpage_cmd(model: str | None, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "flashpage.cli", "serve", "--port", str(port), "--log-level", "warning"]
    return cmd + (["--model", model] if model else [])


def _transformers_cmd(model_path: str, port: int) -> list[str] | str:
    exe = shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable), "transformers")
    if not os.path.exists(exe):
        return "the `transformers` command is not installed"
    return [exe, "serve", model_path, "--port", str(port), "--host", "127.0.0.1", "--continuous-batching",
            "--device", "cpu", "--log-level", "warning"]


# ------------------------------------------------------------------------------------------- run
def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rates {text!r}: give numbers separated by commas, e.g. 2,4,8,inf") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rates {text!r}: every rate must be > 0 (inf: all requests at once)")
    return rates


def run(base_url: str | None = None, model: str | None = None, rates: list[float] | None = None,
        num_prompts: int = 32, max_tokens: int = 32, seed: int = 0, transformers: bool = True) -> dict[str, Any]:
    """Benchmark flashpage (and transformers serve unless ``transformers=False``); the result dict."""
    from flashpage.serve.server import TINY_MODEL_NAME
    from flashpage.tiny import tiny_model_path

    rates = rates or [2.0, 4.0, 8.0, math.inf]
    prompts = make_prompts(num_prompts, seed)
    name = model or TINY_MODEL_NAME
    result: dict[str, Any] = {
        "model": name, "num_prompts": num_prompts, "max_tokens": max_tokens, "rates": [_rate(r) for r in rates],
        "workload": f"{num_prompts} streamed /v1/completions per rate, prompts of 4..60 words, greedy, "
                    f"max_tokens {max_tokens}, Poisson arrivals", "systems": {}, "transformers_note": None,
    }
    if base_url:
        rows, fp_texts = bench_server(base_url.rstrip("/"), name, prompts, rates, max_tokens, seed, "flashpage")
    else:
        _log("starting flashpage serve ...")
        with started_server(_flashpage_cmd(model, port := free_port()), port, {"OMP_NUM_THREADS": "1"}) as url:
            rows, fp_texts = bench_server(url, name, prompts, rates, max_tokens, seed, "flashpage")
    result["systems"]["flashpage"] = rows
    result["outputs_agree"] = None
    if not transformers:
        result["transformers_note"] = "skipped (--no-transformers)"
        return result
    path = model or str(tiny_model_path())
    cmd = _transformers_cmd(path, port := free_port())
    if isinstance(cmd, str):
        result["transformers_note"] = f"transformers serve not run: {cmd}"
        return result
    try:
        _log("starting transformers serve --continuous-batching ...")
        with started_server(cmd, port, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}) as url:
            rows, tf_texts = bench_server(url, path, prompts, rates, max_tokens, seed, "transformers")
    except (RuntimeError, OSError) as exc:
        result["transformers_note"] = f"transformers serve could not run here: {exc}"
        return result
    result["systems"]["transformers serve (continuous batching)"] = rows
    result["outputs_agree"] = fp_texts == tf_texts
    return result


def _rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def format_report(result: dict[str, Any]) -> str:
    lines = [f"bench serve: {result['model']}; {result['workload']}", ""]
    head = (f"{'server':<42} {'rate':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'failed':>6}")
    lines += [head, "-" * len(head)]
    for label, rows in result["systems"].items():
        for row in rows:
            ttft = f"{_ms(row['ttft_p50_ms']):>9} {_ms(row['ttft_p99_ms']):>9}"
            itl = f"{_ms(row['itl_p50_ms']):>8} {_ms(row['itl_p99_ms']):>8}"
            lines.append(f"{label:<42} {row['rate']!s:>5} {row['request_throughput']:>7.2f} "
                         f"{row['output_tokens_per_s']:>8.1f} {ttft} {itl} {row['failed']:>6}")
    if result.get("transformers_note"):
        lines += ["", f"note: {result['transformers_note']}"]
    if result.get("outputs_agree") is not None:
        lines += ["", f"outputs identical (flashpage vs transformers serve, greedy): {result['outputs_agree']}"]
    lines.append("(TTFT/ITL in ms, measured by the client)")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def write_plot(result: dict[str, Any], path: str) -> None:
    from flashpage.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("output_tokens_per_s", "output tokens/s"), ("ttft_p99_ms", "TTFT p99 (ms)"),
              ("itl_p50_ms", "ITL p50 (ms)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label, rows in result["systems"].items():
            xs = [str(r["rate"]) for r in rows]
            ax.plot(xs, [r[key] if r[key] is not None else float("nan") for r in rows], marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"bench serve: {result['model']}, {result['workload']}", fontsize=9)
    _save(plt, fig, path)


def run_cli(args: argparse.Namespace) -> int:
    """``flashpage bench serve``; exit 1 when requests failed or the two servers disagree."""
    if args.against == "vllm":
        from flashpage.bench.vs_vllm_serve import run_cli as run_against_vllm

        if args.base_url or args.plot or not args.transformers:
            raise ValueError("--against vllm starts both servers itself and prints a table: "
                             "drop --base-url, --plot and --no-transformers")
        return run_against_vllm(args)
    if args.vllm_python:
        raise ValueError("--vllm-python is for the vLLM comparison: add --against vllm")
    rates = parse_rates("4,inf" if args.quick and args.request_rates == "2,4,8,inf" else args.request_rates)
    num, max_tokens = (16, 16) if args.quick else (args.num_prompts, args.max_tokens)
    if num < 1 or max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    result = run(args.base_url, args.model, rates, num, max_tokens, args.seed, args.transformers)
    from flashpage.bench.record import dumps

    print(dumps(result) if args.json else format_report(result))
    if args.plot:
        try:
            write_plot(result, args.plot)
        except ImportError as exc:
            print(f"flashpage bench: --plot needs matplotlib ({exc}); {install_hint('matplotlib', 'plot')}",
                  file=sys.stderr)
            return 1
        _log(f"plot written to {args.plot}")
    failed = any(r["failed"] for rows in result["systems"].values() for r in rows)
    return 1 if failed or result["outputs_agree"] is False else 0

