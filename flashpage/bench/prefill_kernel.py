"""Prefill microbenchmark of the C++ CPU paged-attention kernel (flashpage/kernels/cpu_attention.py).

Two prefill steps of the bench engine's model shape (H=8 query heads, Hk=2 KV heads, head size 64,
float32, causal), one kernel call each over pages in shuffled order:

- ``shared-prefix``: 32 sequences adding 58 tokens each after 512 cached ones (the first 512 keys on pages
  every sequence shares, as prefix caching leaves them): the ``bench engine --workload shared-prefix``
  prefill step;
- ``prompts``: 16 prompts of 32-256 tokens without cache (a mixed workload's prefill).

Reports the median / minimum wall and the median CPU milliseconds per call (``getrusage``: on a busy
machine the CPU time is the steadier number), GFLOP/s over the visible (query, key) pairs (4 * D flops
each per head: QK and P.V), and the largest difference from a float64 dense reference, which must stay
within 1e-4. Run: ``OMP_NUM_THREADS=1 taskset -c 1 python -m flashpage.bench.prefill_kernel [--json]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from flashpage.kernels import cpu_attention

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
CASES = ("shared-prefix", "prompts")
_AGREE_TOL = 1e-4


@dataclass
class PrefillCase:
    """One packed prefill step: q (T, H, D), pages (NB, P, Hk, D), table (B, M), key lengths (B,),
    query-row prefix sums (B + 1,)."""

    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    table: torch.Tensor
    seqlens_k: torch.Tensor
    cu_q: torch.Tensor

    def flops(self) -> int:
        """4 * D * H per visible (query, key) pair, causal aligned bottom-right."""
        sq = self.cu_q.diff().tolist()
        pairs = sum(sum(k - s + i + 1 for i in range(s)) for s, k in zip(sq, self.seqlens_k.tolist(), strict=True))
        return pairs * HEADS * 4 * HEAD_DIM


def make_case(name: str, block_size: int, quick: bool = False, seed: int = 0) -> PrefillCase:
    """The ``name`` step (see the module docstring) on pages of ``block_size``; ``quick`` shrinks it."""
    g = torch.Generator().manual_seed(seed)
    if name == "shared-prefix":
        batch, new, cached = (4, 20, 128) if quick else (32, 58, 512)
        sq, sk = [new] * batch, [cached + new] * batch
        shared = cached // block_size  # whole pages of the prefix: every sequence's table starts with them
    elif name == "prompts":
        batch = 3 if quick else 16
        sq = torch.randint(32, (64 if quick else 256) + 1, (batch,), generator=g).tolist()
        sk, shared = list(sq), 0
    else:
        raise ValueError(f"unknown case {name!r}: choose from {CASES}")
    own = [-(-k // block_size) - shared for k in sk]
    ids = torch.randperm(shared + sum(own), generator=g)
    table = torch.zeros(batch, shared + max(own), dtype=torch.int32)
    pos = shared
    for b, n in enumerate(own):
        table[b, :shared] = ids[:shared]
        table[b, shared:shared + n] = ids[pos:pos + n]
        pos += n
    shape = (len(ids), block_size, KV_HEADS, HEAD_DIM)
    return PrefillCase(q=torch.randn(sum(sq), HEADS, HEAD_DIM, generator=g), k_pages=torch.randn(shape, generator=g),
                       v_pages=torch.randn(shape, generator=g), table=table, seqlens_k=torch.tensor(sk),
                       cu_q=torch.tensor([0, *sq]).cumsum(0))


def reference(c: PrefillCase) -> torch.Tensor:
    """float64 dense causal attention, sequence by sequence: (T, H, D)."""
    outs = []
    page = c.k_pages.shape[1]
    for b, (q0, q1) in enumerate(zip(c.cu_q[:-1].tolist(), c.cu_q[1:].tolist(), strict=True)):
        sk = int(c.seqlens_k[b])
        j = torch.arange(sk)
        blk = c.table[b].long()[j // page]
        k = c.k_pages[blk, j % page].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # (Sk, H, D)
        v = c.v_pages[blk, j % page].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        q = c.q[q0:q1].double()
        s = torch.einsum("ihd,jhd->hij", q, k) * HEAD_DIM**-0.5
        visible = j[None, :] <= (torch.arange(q1 - q0) + sk - (q1 - q0))[:, None]
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hij,jhd->ihd", p, v))
    return torch.cat(outs)


def _call(c: PrefillCase) -> torch.Tensor:
    res = cpu_attention.paged_attention(c.q, c.k_pages, c.v_pages, c.table, c.seqlens_k, c.cu_q, HEAD_DIM**-0.5,
                                        0.0, (-1, 0), None)
    if res is None:
        raise RuntimeError(f"the C++ CPU attention kernel is unavailable: {cpu_attention.status().reason}")
    return res[0]


def run(case: str = "shared-prefix", block_size: int = 16, repeats: int = 15, quick: bool = False) -> dict:
    """Time ``repeats`` kernel calls on ``case`` (after one warm-up); returns plain numbers/strings."""
    c = make_case(case, block_size, quick=quick)
    diff = (_call(c).double() - reference(c)).abs().max().item()
    wall, cpu = [], []
    for _ in range(repeats):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        _call(c)
        wall.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    flops = c.flops()
    result = {
        "case": case, "block_size": block_size, "sequences": len(c.seqlens_k), "query_rows": int(c.cu_q[-1]),
        "keys": int(c.seqlens_k.sum()), "gflop": flops / 1e9, "ms": statistics.median(wall) * 1e3,
        "ms_min": min(wall) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3,
        "gflops_wall": flops / statistics.median(wall) / 1e9,
        "gflops_cpu": flops / max(statistics.median(cpu), 1e-9) / 1e9,
        "max_abs_diff": diff, "outputs_agree": diff <= _AGREE_TOL, "threads": torch.get_num_threads(),
        "repeats": repeats, "kernel": cpu_attention.status().reason,
    }
    if not result["outputs_agree"]:
        raise RuntimeError(f"kernel and float64 reference disagree: max |diff| = {diff:.3g}")
    return result


def format_report(results: list[dict]) -> str:
    """One line per result of :func:`run`."""
    lines = [f"prefill attention, H={HEADS} Hk={KV_HEADS} D={HEAD_DIM} float32 causal, "
             f"{results[0]['threads']} thread(s): median wall / CPU ms per call"]
    for r in results:
        lines.append(f"  {r['case']:13s} block {r['block_size']:3d}: {r['sequences']:2d} seqs, "
                     f"{r['query_rows']:5d} rows, {r['gflop']:.2f} GFLOP  {r['ms']:7.2f} ms "
                     f"(min {r['ms_min']:.2f}, CPU {r['cpu_ms']:.2f})  {r['gflops_wall']:5.1f} GFLOP/s wall, "
                     f"{r['gflops_cpu']:5.1f} CPU  max |diff| {r['max_abs_diff']:.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    cases = CASES if args.case == "all" else (args.case,)
    results = [run(c, b, args.repeats, args.quick) for c in cases for b in args.block_size]
    print(json.dumps(results, indent=2) if args.json else format_report(results))


if __name__ == "__main__":
    main()
