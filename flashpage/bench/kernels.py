"""Decode-step benchmark: flashpage's paged flash_attn_with_kvcache against dense torch SDPA.

One decode step (one query token per sequence, lengths uniform in [min_len, max_len]) over a paged
cache with shuffled block ids, against scaled_dot_product_attention on the same tokens laid out
densely as (B, Hk, Lmax, D) with a key-padding mask and enable_gqa=True (K/V not repeated).
The two outputs must agree. Run: python -m flashpage.bench.kernels [--json].
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from flashpage.kernels import backend_info, flash_attn_with_kvcache

_AGREE_TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _paged_layout(lengths: torch.Tensor, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table giving each sequence ceil(len / block_size) blocks of a shuffled pool."""
    used = (lengths + block_size - 1) // block_size
    num_blocks, width = int(used.sum()), int(used.max())
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    cols = torch.arange(width)[None, :]
    table[cols < used[:, None]] = ids  # row-major fill: sequence b gets the next used[b] ids
    return table, num_blocks


def _dense_copy(
    cache: torch.Tensor, table: torch.Tensor, lengths: list[int], block_size: int, max_len: int
) -> torch.Tensor:
    """The paged tokens as (B, Hk, Lmax, D), zero padded (setup only)."""
    batch, kv_heads, dim = len(lengths), cache.shape[2], cache.shape[3]
    dense = torch.zeros(batch, kv_heads, max_len, dim, dtype=cache.dtype)
    for b, n in enumerate(lengths):
        blocks = cache[table[b, : -(-n // block_size)].long()].reshape(-1, kv_heads, dim)[:n]
        dense[b, :, :n] = blocks.transpose(0, 1)
    return dense


def _time_ms(fn, repeats: int) -> tuple[float, float, torch.Tensor]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), out


def run(
    num_seqs: int = 256,
    min_len: int = 16,
    max_len: int = 2048,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    seed: int = 0,
) -> dict:
    """Time one decode step, paged (flashpage) vs dense SDPA, on CPU; returns plain numbers/strings."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=gen)
    table, num_blocks = _paged_layout(lengths, block_size, gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(num_seqs, 1, heads, head_dim, generator=gen).to(dtype)
    seqlens = lengths.to(torch.int32)
    lens, longest = lengths.tolist(), int(lengths.max())
    k_dense = _dense_copy(k_cache, table, lens, block_size, longest)
    v_dense = _dense_copy(v_cache, table, lens, block_size, longest)
    mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
    q_dense = q.transpose(1, 2)

    def paged() -> torch.Tensor:
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)

    def dense() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)

    paged_ms, paged_min, out_paged = _time_ms(paged, repeats)
    dense_ms, dense_min, out_dense = _time_ms(dense, repeats)
    diff = (out_paged.double() - out_dense.double()).abs().max().item()
    agree = diff <= _AGREE_TOL.get(dtype, 1e-2)
    result = {
        "paged_ms": paged_ms,
        "dense_sdpa_ms": dense_ms,
        "ratio": paged_ms / dense_ms,
        "paged_ms_min": paged_min,
        "dense_sdpa_ms_min": dense_min,
        "max_abs_diff": diff,
        "outputs_agree": agree,
        "num_seqs": num_seqs,
        "min_len": min_len,
        "max_len": max_len,
        "total_tokens": int(lengths.sum()),
        "padded_tokens": num_seqs * longest,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "dtype": str(dtype).replace("torch.", ""),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "paged_backend": backend_info("cpu", dtype, block_size)["flash_attn_with_kvcache"].reason,
        "dense_baseline": "torch SDPA, (B, Hk, Lmax, D) padded K/V, bool key-padding mask, enable_gqa=True",
    }
    if not agree:
        raise RuntimeError(
            f"paged and dense outputs disagree: max |diff| = {diff:.3g}\n{format_report(result)}"
        )
    return result


def format_report(result: dict) -> str:
    """A few human-readable lines for `run`'s result."""
    r = result
    return "\n".join(
        [
            f"decode step: {r['num_seqs']} seqs, lengths {r['min_len']}-{r['max_len']} "
            f"({r['total_tokens']} tokens, {r['padded_tokens']} padded), H={r['heads']} "
            f"Hk={r['kv_heads']} D={r['head_dim']}, {r['dtype']}, block_size {r['block_size']}, "
            f"{r['threads']} threads",
            f"  paged (flashpage)  {r['paged_ms']:9.1f} ms  (min {r['paged_ms_min']:.1f})  "
            f"[{r['paged_backend']}]",
            f"  dense SDPA         {r['dense_sdpa_ms']:9.1f} ms  (min {r['dense_sdpa_ms_min']:.1f})  "
            f"[{r['dense_baseline']}]",
            f"  ratio paged/dense  {r['ratio']:9.2f}    max |diff| {r['max_abs_diff']:.2e} "
            f"({'agree' if r['outputs_agree'] else 'DISAGREE'})",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    args = parser.parse_args(argv)
    result = run(
        num_seqs=args.num_seqs,
        max_len=args.max_len,
        block_size=args.block_size,
        dtype=getattr(torch, args.dtype),
        repeats=args.repeats,
    )
    print(json.dumps(result, indent=2) if args.json else format_report(result))


if __name__ == "__main__":
    main()
