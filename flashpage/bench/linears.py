"""The engine's CPU linears one GEMM at a time: oneDNN on the plain weight, on a packed weight, and sibling
linears fused into one packed GEMM (``python -m flashpage.bench.linears``; what ``LLM(cpu_prepack=...)``
chooses between, see ``flashpage/engine/linears.py``).

Shapes are the bench model's (hidden 512, 8 heads of 64, 2 KV heads, intermediate 1376, vocab 8192):
q/k/v (512 / 128 / 128 outputs from one input), o, gate/up (1376 each), down and the LM head, at
``rows`` tokens per call (1-32: decode steps; 256-2048: prefill chunks). Every variant computes the
same outputs; the three run alternately (``repeats`` rounds of ``iters`` calls each) and the best
round of each is reported: on a shared machine the minimum is the least disturbed estimate.

``--engine``: the same choice in ``LLM`` (``FLASHPAGE_CPU_PREPACK=0`` / ``unfused`` / ``1``, alternating,
a fresh engine per run; ``--compile``: ``LLM(compile=True)``, compiled in the untimed warm-up) on a
decode-heavy workload (16 requests x 96 new tokens, short prompts) and
on ``bench engine``'s quick mixed workload, the bench model (``--quick``: 4 layers): wall and process
CPU time of each timed ``generate()`` (CPU time is what a loaded machine disturbs least), tokens
compared across modes, and what packing the model costs (all GEMMs; one after a one-tensor edit).

``--small-rows``: what a step of one to four rows costs once a GEMM's original weight is paged out (it then
runs on the packed weight, see ``Prepacked.release``) against ``small_linear`` on the original, at Qwen3-0.6B's
widths (:data:`REAL_GROUPS`; ``layers`` copies streamed from memory, as a decode step reads them), in thread CPU
time (best of ``repeats`` alternating rounds): packed, packed zero-padded to ``PACKED_MIN_ROWS`` rows (what the
engine runs), small_linear.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashpage.bench.models import load_average
from flashpage.engine.linears import PACK_BATCH_HINT

HIDDEN, KV, INTERMEDIATE, VOCAB = 512, 128, 1376, 8192
GROUPS: dict[str, tuple[int, tuple[int, ...]]] = {  # name -> (input width, output widths of the siblings)
    "q/k/v": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)), "gate/up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    "down": (INTERMEDIATE, (HIDDEN,)), "lm_head": (HIDDEN, (VOCAB,)),
}
ROWS = (1, 8, 32, 256, 2048)
REAL_GROUPS: dict[str, tuple[int, tuple[int, ...]]] = {  # Qwen3-0.6B: hidden 1024, 16 / 8 heads of 128, MLP 3072
    "q/k/v": (1024, (2048, 1024, 1024)), "o": (2048, (1024,)), "gate/up": (1024, (3072, 3072)), "down": (3072, (1024,)),
}


@dataclass(frozen=True)
class SmallRow:
    """Best-round microseconds per call of one real-width group at ``rows`` rows (``small``: small_linear on
    each member's original weight; ``packed``: the fused packed GEMM; ``padded``: that, zero-padded)."""

    group: str
    rows: int
    small_us: float
    packed_us: float
    padded_us: float


def measure_small_rows(group: str, rows: int, layers: int = 8, repeats: int = 9, seed: int = 0) -> SmallRow | None:
    """:class:`SmallRow` of ``group`` (a :data:`REAL_GROUPS` key); None without the C++ small-M kernel."""
    from flashpage.engine import linears
    from flashpage.kernels import cpu_fused

    ops = cpu_fused.load()
    if ops is None:
        return None
    width, outs = REAL_GROUPS[group]
    gen = torch.Generator().manual_seed(seed)
    weights = [[torch.randn(n, width, generator=gen) / width ** 0.5 for n in outs] for _ in range(layers)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.cat(ws), PACK_BATCH_HINT) for ws in weights]
    x = torch.randn(1, rows, width, generator=gen)
    variants: dict[str, Callable[[], object]] = {
        "small": lambda: [ops.small_linear(x, w, None) for ws in weights for w in ws],
        "packed": lambda: [_call(x, p).split(outs, -1) for p in packed],
        "padded": lambda: [linears._packed_call(x, p, None).split(outs, -1) for p in packed]}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, fn in variants.items():
            fn()
            start = time.thread_time()
            for _ in range(4):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / 4 / layers)
    return SmallRow(group, rows, best["small"] * 1e6, best["packed"] * 1e6, best["padded"] * 1e6)


def small_rows_main(repeats: int) -> int:
    rows = [r for g in REAL_GROUPS for n in (1, 2, 3, 4) if (r := measure_small_rows(g, n, repeats=repeats))]
    if not rows:
        print("no C++ small-M kernel here (cpu_fused did not load)", file=sys.stderr)
        return 1
    print(f"{'group':8s} {'rows':>5s} {'small us':>9s} {'packed us':>10s} {'padded us':>10s} {'packed/small':>13s} "
          f"{'padded/small':>13s}")
    for r in rows:
        print(f"{r.group:8s} {r.rows:5d} {r.small_us:9.0f} {r.packed_us:10.0f} {r.padded_us:10.0f} "
              f"{r.packed_us / r.small_us:13.2f} {r.padded_us / r.small_us:13.2f}")
    for n in (1, 2, 3, 4):
        at = [r for r in rows if r.rows == n]
        small = sum(r.small_us for r in at)
        print(f"a layer at {n} row(s): packed/small {sum(r.packed_us for r in at) / small:.2f}, "
              f"padded/small {sum(r.padded_us for r in at) / small:.2f}")
    print(f"load avg {load_average():.2f}")
    return 0


@dataclass(frozen=True)
class Row:
    """Best-round microseconds per call of one group at one row count (``fused`` = ``packed`` for one linear)."""

    group: str
    rows: int
    plain_us: float
    packed_us: float
    fused_us: float


def _call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _variants(x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """x (1, rows, in); weights [(out_i, in)]: plain calls, packed calls, one fused packed call split in views."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
    fused = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), PACK_BATCH_HINT) if len(weights) > 1 \
        else packed[0]
    sizes = [w.shape[0] for w in weights]
    return {"plain": lambda: [_call(x, w) for w in weights], "packed": lambda: [_call(x, p) for p in packed],
            "fused": lambda: _call(x, fused).split(sizes, -1)}


def check_equal(weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Largest |difference| between the fused GEMM's split outputs and the plain calls (float32 rounding)."""
    v = _variants(x, weights)
    return max(float((a - b).abs().max()) for a, b in zip(v["fused"](), v["plain"](), strict=True))


def measure(group: str, rows: int, repeats: int = 15, seed: int = 0) -> Row:
    """Time the three variants of ``group`` at ``rows`` rows, alternating, best round of each."""
    width, outs = GROUPS[group]
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, width, generator=gen) / width ** 0.5 for n in outs]
    x = torch.randn(1, rows, width, generator=gen)
    variants = _variants(x, weights)
    iters = max(2, min(200, 4000 // rows))
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return Row(group, rows, best["plain"] * 1e6, best["packed"] * 1e6, best["fused"] * 1e6)


MODES = ("0", "unfused", "1")


@dataclass(frozen=True)
class EngineRun:
    """One timed ``generate()`` of a workload under one ``FLASHPAGE_CPU_PREPACK`` mode."""

    workload: str
    mode: str
    wall_s: float
    cpu_s: float
    tokens: tuple[tuple[int, ...], ...]


def _engine_workloads(vocab: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    from flashpage.bench.engine import make_workload

    gen = torch.Generator().manual_seed(0)
    decode = [torch.randint(3, vocab, (24,), generator=gen).tolist() for _ in range(16)]
    mixed = make_workload("mixed", vocab, quick=True)
    return {"decode-heavy": (decode, [96] * len(decode)), "mixed": (mixed.prompts, list(mixed.max_tokens))}


def engine_run(model: torch.nn.Module, workload: str, prompts: list[list[int]], max_tokens: list[int],
               mode: str, compile: bool = False) -> EngineRun:
    """A fresh ``LLM`` under ``FLASHPAGE_CPU_PREPACK=mode``: a small untimed generate (the probe step
    and the packing), then the timed one."""
    import os

    from flashpage import LLM, SamplingParams
    from flashpage.patches import unpatch

    previous = os.environ.get("FLASHPAGE_CPU_PREPACK")
    os.environ["FLASHPAGE_CPU_PREPACK"] = mode
    if compile:  # every compiled engine on one model adds graphs to one code object: dynamo's limit is 8
        torch.compiler.reset()
    try:
        llm = LLM(model, max_num_seqs=256, block_size=128, enable_prefix_caching=False, compile=compile)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        cpu, wall = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        unpatch(model)
        if previous is None:
            os.environ.pop("FLASHPAGE_CPU_PREPACK", None)
        else:
            os.environ["FLASHPAGE_CPU_PREPACK"] = previous
    return EngineRun(workload, mode, wall, cpu, tuple(tuple(o.outputs[0].token_ids) for o in outs))


def pack_cost(model: torch.nn.Module) -> dict[str, float]:
    """Milliseconds to pack every linear of ``model`` (best of 3), and to repack after one weight edit."""
    from flashpage.engine import linears

    linears.install_onednn_linears(model)
    packs = linears.Prepacked(model, True)
    with torch.inference_mode(), linears.onednn_scope(True, packs):
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))  # the probe step
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        packs.refresh(everything=True)
        best = min(best, time.perf_counter() - start)
    with torch.no_grad():
        next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight.add_(0.0)
    start = time.perf_counter()
    one = packs.refresh()
    return {"gemms": len(packs.gemms), "fused": len(packs.fused()), "mib": packs.nbytes() / 2**20,
            "all_ms": best * 1e3, "one_ms": (time.perf_counter() - start) * 1e3, "repacked_after_one_edit": one}


def engine_main(rounds: int, quick: bool, compile: bool = False) -> int:
    import statistics

    from flashpage.bench.models import load_bench_model

    bm = load_bench_model(None, quick=quick)
    print(f"{bm.name}; {torch.get_num_threads()} thread(s), compile={compile}, load avg {load_average():.2f}")
    runs: list[EngineRun] = []
    for name, (prompts, max_tokens) in _engine_workloads(bm.vocab_size).items():
        for r in range(rounds):
            for mode in MODES:
                run = engine_run(bm.model, name, prompts, max_tokens, mode, compile)
                runs.append(run)
                print(f"{name:12s} round {r} FLASHPAGE_CPU_PREPACK={mode:7s} wall {run.wall_s:7.3f} s  "
                      f"cpu {run.cpu_s:7.3f} s  load {load_average():.2f}", flush=True)
        base = [x for x in runs if x.workload == name and x.mode == "0"]
        for mode in MODES[1:]:
            got = [x for x in runs if x.workload == name and x.mode == mode]
            cpu = [b.cpu_s / g.cpu_s for b, g in zip(base, got, strict=True)]
            wall = [b.wall_s / g.wall_s for b, g in zip(base, got, strict=True)]
            same = all(g.tokens == base[0].tokens for g in got)
            print(f"{name}: {mode} vs 0: speed-up in CPU time median {statistics.median(cpu):.2f} "
                  f"[{', '.join(f'{c:.2f}' for c in cpu)}], wall median {statistics.median(wall):.2f}; "
                  f"tokens identical: {same}")
    cost = pack_cost(bm.model)
    print(f"packing: {cost['gemms']} GEMMs ({cost['fused']} fused), {cost['mib']:.1f} MiB, "
          f"all {cost['all_ms']:.1f} ms; after a one-tensor edit {cost['repacked_after_one_edit']} GEMM in "
          f"{cost['one_ms']:.2f} ms")
    print(f"load avg {load_average():.2f}")
    return 0


def format_table(results: Sequence[Row]) -> str:
    lines = [f"{'group':8s} {'rows':>5s} {'plain us':>10s} {'packed us':>10s} {'fused us':>10s} "
             f"{'packed/plain':>13s} {'fused/packed':>13s}"]
    for r in results:
        lines.append(f"{r.group:8s} {r.rows:5d} {r.plain_us:10.0f} {r.packed_us:10.0f} {r.fused_us:10.0f} "
                     f"{r.packed_us / r.plain_us:13.2f} {r.fused_us / r.packed_us:13.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per call, comma-separated")
    parser.add_argument("--groups", default=",".join(GROUPS), help="of: " + ", ".join(GROUPS))
    parser.add_argument("--repeats", type=int, default=15, help="alternating rounds (best one kept)")
    parser.add_argument("--engine", action="store_true", help="LLM runs with packing off / unfused / on instead")
    parser.add_argument("--rounds", type=int, default=3, help="with --engine: alternating rounds per workload")
    parser.add_argument("--quick", action="store_true", help="with --engine: the 4-layer bench model")
    parser.add_argument("--compile", action="store_true", help="with --engine: LLM(compile=True) (no fusion there)")
    parser.add_argument("--small-rows", action="store_true",
                        help="1-4 rows at Qwen3-0.6B's widths: packed (padded) vs small_linear on the originals")
    args = parser.parse_args(argv)
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        print("this torch has no oneDNN linear", file=sys.stderr)
        return 1
    if args.engine:
        return engine_main(args.rounds, args.quick, args.compile)
    if args.small_rows:
        return small_rows_main(min(args.repeats, 9))
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown --groups {unknown}: choose from {', '.join(GROUPS)}")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} thread(s), load avg {load_average():.2f}, pack batch hint {PACK_BATCH_HINT}")
    results = [measure(g, r, args.repeats) for g in groups for r in rows]
    print(format_table(results))
    print(f"load avg {load_average():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
