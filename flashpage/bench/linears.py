"""The engine's CPU linears one GEMM at a time: oneDNN on the plain weight, on a packed weight, and sibling
linears fused into one packed GEMM (``python -m flashpage.bench.linears``; what ``LLM(cpu_prepack=...)``
chooses between, see ``flashpage/engine/linears.py``).

Shapes are the bench model's (hidden 512, 8 heads of 64, 2 KV heads, intermediate 1376, vocab 8192):
q/k/v (512 / 128 / 128 outputs from one input), o, gate/up (1376 each), down and the LM head, at
``rows`` tokens per call (1-32: decode steps; 256-2048: prefill chunks). Every variant computes the
same outputs; the three run alternately (``repeats`` rounds of ``iters`` calls each) and the best
round of each is reported: on a shared machine the minimum is the least disturbed estimate.
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
    args = parser.parse_args(argv)
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        print("this torch has no oneDNN linear", file=sys.stderr)
        return 1
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
