"""``python -m flashpage.bench.fastpath``: what the engine's fused norms / rotary / gated MLPs save.

For one decoder layer of the bench model (or ``--model``), at a decode-sized and a prefill-sized token
count: the aten ops each part dispatches (exact, from a dispatch mode) and its CPU time (10th percentile
of ``time.thread_time_ns`` over alternating fused / own-code calls, so a loaded machine shifts both
alike), with the fused forms (``flashpage/engine/fastpath.py``) inside their scope and without. The
layer runs with transformers' sdpa attention here (the paged attention needs an engine step); its
linears take oneDNN as in ``LLM``.

``--engine PAIRS``: engine level instead. One ``LLM`` runs the mixed workload (``flashpage bench engine``'s
requests, greedy) ``PAIRS`` times in each ``FLASHPAGE_FASTPATH`` mode (default ``torch`` = fused torch
forms, ``1`` = with the C++ ops), modes alternating A,B,B,A,... (the switch is read once per step);
output tokens/s per run (wall clock, and per CPU second of this process: less moved by other work on a
loaded machine), the ratios per pair, and whether each run's tokens equal the first run's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashpage.bench.models import load_average, load_bench_model
from flashpage.engine import fastpath
from flashpage.engine.linears import install_onednn_linears, onednn_scope


class _OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops(fn: Callable[[], Any], fused: bool) -> int:
    with fastpath.fastpath_scope(fused):
        fn()  # the step's rotary table, as for every layer after the first
        with _OpCounter() as counter:
            fn()
    return sum(counter.ops.values())


def _p10_us(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(fused, own) 10th-percentile CPU microseconds, calls alternating fused/own/own/fused; each timed
    call follows an untimed one in the same scope (an engine step builds its rotary table once, for
    every layer)."""
    times: dict[bool, list[int]] = {True: [], False: []}
    for i in range(reps * 2):
        fused = (i // 2) % 2 == i % 2
        with fastpath.fastpath_scope(fused):
            fn()
            start = time.thread_time_ns()
            fn()
            times[fused].append(time.thread_time_ns() - start)
    return tuple(sorted(times[f])[len(times[f]) // 10] / 1e3 for f in (True, False))  # type: ignore[return-value]


def _parts(model: Any, tokens: int) -> dict[str, Callable[[], Any]]:
    """The first decoder layer's parts on random inputs of ``tokens`` tokens."""
    layer = model.model.layers[0]
    cfg = model.config
    x = torch.randn(1, tokens, cfg.hidden_size)
    pos = torch.arange(tokens)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    attn = layer.self_attn
    q = torch.randn(1, tokens, cfg.num_attention_heads, attn.head_dim).transpose(1, 2)
    k = torch.randn(1, tokens, cfg.num_key_value_heads, attn.head_dim).transpose(1, 2)
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    return {
        "norm": lambda: layer.input_layernorm(x),
        "rotary": lambda: rotary(q, k, cos, sin),
        "gated MLP": lambda: layer.mlp(x),
        "decoder layer": lambda: layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin)),
    }


def run(model_name: str | None = None, tokens: tuple[int, ...] = (16, 1024), reps: int = 400) -> dict[str, Any]:
    """Per part and token count: ops and p10 CPU us, fused and own (see the module docstring)."""
    bm = load_bench_model(model_name, quick=True)
    model = bm.model
    install_onednn_linears(model)
    fp = fastpath.install_fastpath(model)
    model.config._attn_implementation = "sdpa"
    rows = []
    with torch.inference_mode(), onednn_scope():
        for n in tokens:
            for part, fn in _parts(model, n).items():
                fused_us, own_us = _p10_us(fn, max(reps * 16 // n, 10))
                rows.append({"part": part, "tokens": n, "ops_fused": _ops(fn, True), "ops_own": _ops(fn, False),
                             "us_fused": fused_us, "us_own": own_us})
    return {"model": bm.name, "fastpath": fp.describe(), "threads": torch.get_num_threads(),
            "load_average_1m": load_average(), "rows": rows}


def engine_ab(model_name: str | None = None, pairs: int = 3, quick: bool = False,
              modes: tuple[str, str] = ("torch", "1")) -> dict[str, Any]:
    """Output tokens/s of the mixed workload on one ``LLM`` per ``FLASHPAGE_FASTPATH`` mode, alternating
    (see the module docstring); the environment variable is restored afterwards."""
    import os

    from flashpage.bench.engine import MAX_BATCHED_TOKENS, _pool_blocks, _warm_prompts, make_workload, run_workload
    from flashpage.engine import LLM, SamplingParams

    bm = load_bench_model(model_name, quick=quick)
    work = make_workload("mixed", bm.vocab_size, quick=quick)
    saved = os.environ.get(fastpath.ENV)
    runs: list[dict[str, Any]] = []
    first: list[list[int]] | None = None
    try:
        os.environ[fastpath.ENV] = "1"  # the probes check the C++ forms only when they may run
        llm = LLM(bm.model, block_size=128, num_blocks=_pool_blocks(work, 128),
                  max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True)
        for i in range(pairs):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                os.environ[fastpath.ENV] = mode
                llm.generate(_warm_prompts(bm.vocab_size, 0), SamplingParams(max_tokens=4, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
                llm.reset_prefix_cache()
                cpu0 = time.process_time()
                seconds, tokens = run_workload(llm, work)
                cpu = time.process_time() - cpu0
                first = first or tokens
                runs.append({"pair": i, "mode": mode, "seconds": seconds, "tok_s": sum(map(len, tokens)) / seconds,
                             "cpu_seconds": cpu, "tok_cpu_s": sum(map(len, tokens)) / cpu,
                             "identical": sum(a == b for a, b in zip(first, tokens, strict=True)),
                             "requests": len(tokens), "load_average_1m": load_average()})
    finally:
        if saved is None:
            os.environ.pop(fastpath.ENV, None)
        else:
            os.environ[fastpath.ENV] = saved
    return {"model": bm.name, "fastpath": llm.fastpath.describe(), "modes": list(modes), "runs": runs}


def format_engine_report(result: dict[str, Any]) -> str:
    a, b = result["modes"]
    lines = [f"engine A/B, mixed workload, {result['model']} ({result['fastpath']}); "
             f"{fastpath.ENV}={a} vs {fastpath.ENV}={b}, alternating"]
    for r in result["runs"]:
        lines.append(f"  pair {r['pair']} {fastpath.ENV}={r['mode']:<6} {r['seconds']:7.2f} s {r['tok_s']:8.1f} tok/s"
                     f"  {r['cpu_seconds']:7.2f} CPU s {r['tok_cpu_s']:8.1f} tok/CPU s"
                     f"  tokens identical {r['identical']}/{r['requests']}  load {r['load_average_1m']}")
    for key, label in (("tok_s", "wall"), ("tok_cpu_s", "CPU time")):
        ratios = []
        for i in sorted({r["pair"] for r in result["runs"]}):
            by = {r["mode"]: r[key] for r in result["runs"] if r["pair"] == i}
            ratios.append(by[b] / by[a])
        lines.append(f"ratios {b}/{a} per pair ({label}): " + " ".join(f"{x:.3f}" for x in ratios)
                     + f"  (median {sorted(ratios)[len(ratios) // 2]:.3f})")
    return "\n".join(lines)


def format_report(result: dict[str, Any]) -> str:
    lines = [f"fastpath parts, {result['model']} ({result['fastpath']}); {result['threads']} thread(s), "
             f"load avg {result['load_average_1m']}",
             f"{'part':<15}{'tokens':>7}{'ops fused/own':>16}{'us fused':>11}{'us own':>10}{'own/fused':>11}"]
    for r in result["rows"]:
        ratio = r["us_own"] / r["us_fused"] if r["us_fused"] else float("nan")
        lines.append(f"{r['part']:<15}{r['tokens']:>7}{r['ops_fused']:>9}/{r['ops_own']:<6}"
                     f"{r['us_fused']:>11.1f}{r['us_own']:>10.1f}{ratio:>10.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashpage.bench.fastpath", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the random bench Llama, 4 layers)")
    parser.add_argument("--tokens", default="16,1024", help="token counts (default 16,1024)")
    parser.add_argument("--reps", type=int, default=400, help="alternating pairs at 16 tokens (fewer when longer)")
    parser.add_argument("--engine", type=int, default=0, metavar="PAIRS",
                        help="engine level instead: the mixed workload on one LLM, PAIRS runs per mode, alternating")
    parser.add_argument("--modes", default="torch,1", help=f"--engine: the two {fastpath.ENV} values (default torch,1)")
    parser.add_argument("--quick", action="store_true", help="--engine: the quick workload and a 4-layer bench model")
    args = parser.parse_args(argv)
    if args.engine:
        a, b = args.modes.split(",")
        print(format_engine_report(engine_ab(args.model, args.engine, args.quick, (a, b))))
        return
    print(format_report(run(args.model, tuple(int(t) for t in args.tokens.split(",")), args.reps)))


if __name__ == "__main__":
    main()
