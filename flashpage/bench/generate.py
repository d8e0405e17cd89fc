"""`flashpage bench generate`: patched vs unpatched ``model.generate()`` on one model, in one process.

The same left-padded batch of random prompts is generated greedily, EOS disabled
(``eos_token_id=None``: every row produces exactly ``max_new_tokens``), first with transformers'
own cache (DynamicCache, the model's sdpa attention) and then with ``flashpage.patch(model)``
(HFPagedCache), for a short and a long generation. Each system is warmed up once on the batch
before anything is timed. Reported per case: wall time of each, their ratio (patched /
unpatched: < 1 means flashpage is faster), new tokens/s, KV bytes (the DynamicCache returned by
``return_dict_in_generate`` vs ``HFPagedCache.memory_stats()``), the bound "real tokens rounded up
to whole blocks" and whether the pages stay within it, and whether the outputs agree token for
token (a difference only at a reference tie is accepted, see :func:`flashpage.testing.compare_greedy`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.bench.models import left_pad, random_prompts
from flashpage.testing import compare_greedy


@dataclass(frozen=True)
class GenerateWorkload:
    batch: int
    min_prompt: int
    max_prompt: int
    cases: tuple[tuple[str, int], ...]  # (name, new tokens)
    warmup_tokens: int


FULL = GenerateWorkload(batch=8, min_prompt=32, max_prompt=256, cases=(("short", 64), ("long", 1024)),
                        warmup_tokens=8)
QUICK = GenerateWorkload(batch=4, min_prompt=32, max_prompt=128, cases=(("short", 64), ("long", 256)),
                         warmup_tokens=4)


def _log(msg: str) -> None:
    print(f"[bench generate] {msg}", file=sys.stderr, flush=True)


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, pad_id: int) -> tuple[Any, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=pad_id, return_dict_in_generate=True,
                             output_logits=True)
    return out, time.perf_counter() - start


def dense_cache_bytes(cache: Any) -> int:
    """Bytes a transformers DynamicCache holds: keys + values of every layer."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


def _kv_report(cache: Any, prompt_lengths: list[int], new_tokens: int) -> dict[str, Any]:
    """Paged KV use of a returned HFPagedCache against the dense bound (real tokens -> whole blocks)."""
    stats = cache.memory_stats()
    bs = stats.block_size
    per_token = cache.kv.bytes_per_block() // bs
    stored = [cache.kv.num_tokens(s) for s in cache.rows]
    # the last generated token is never fed back, so each row stores prompt + new - 1 tokens
    expected = [n + new_tokens - 1 for n in prompt_lengths]
    bound = sum(math.ceil(n / bs) * bs * per_token for n in stored)
    return {
        "paged_kv_bytes_in_use": stats.bytes_in_use,
        "paged_kv_bytes_allocated": stats.bytes_allocated,
        "kv_bound_bytes": bound,
        "kv_within_bound": stats.bytes_in_use <= bound,
        "kv_real_tokens": sum(stored),
        "kv_real_tokens_expected": sum(expected),
        "kv_tokens_as_expected": stored == expected,
        "kv_bytes_per_token": per_token,
        "block_size": bs,
        "blocks_in_use": stats.blocks_in_use,
        "dense_bytes_estimate": stats.dense_bytes,
    }


def _run_case(model: Any, ids: torch.Tensor, mask: torch.Tensor, prompt_lengths: list[int], name: str,
              new_tokens: int, pad_id: int) -> dict[str, Any]:
    from flashpage.patches import is_patched, patch, returned_cache, unpatch

    width, batch = ids.shape[1], ids.shape[0]
    assert not is_patched(model)
    repeats = 3 if new_tokens <= 128 else 1  # short runs alternate, best of each: load changes hit both alike
    t_ref = t_got = float("inf")
    for _ in range(repeats):
        _log(f"{name}: unpatched, {batch} x {new_tokens} new tokens")
        ref, seconds = _generate(model, ids, mask, new_tokens, pad_id)
        t_ref = min(t_ref, seconds)
        patch(model)
        try:
            _log(f"{name}: patched, {batch} x {new_tokens} new tokens")
            got, seconds = _generate(model, ids, mask, new_tokens, pad_id)
            t_got = min(t_got, seconds)
        finally:
            unpatch(model)
    dense = dense_cache_bytes(returned_cache(ref))
    ref_tokens = ref.sequences[:, width:].tolist()
    ref_logits = torch.stack(ref.logits, dim=1)  # (B, new, V)
    del ref
    kv = _kv_report(returned_cache(got), prompt_lengths, new_tokens)
    got_tokens = got.sequences[:, width:].tolist()
    del got
    matches = [compare_greedy(r, g, list(ref_logits[i])) for i, (r, g) in enumerate(zip(ref_tokens, got_tokens,
                                                                                        strict=True))]
    useful = batch * new_tokens
    return {
        "new_tokens": new_tokens,
        "batch": batch,
        "seconds_unpatched": t_ref,
        "seconds_patched": t_got,
        "ratio": t_got / t_ref,
        "tok_s_unpatched": useful / t_ref,
        "tok_s_patched": useful / t_got,
        "dense_kv_bytes": dense,
        **kv,
        "kv_saving": dense / kv["paged_kv_bytes_in_use"] if kv["paged_kv_bytes_in_use"] else 0.0,
        "outputs_identical": all(m.identical for m in matches),
        "outputs_agree": all(m.ok for m in matches),
        "rows_identical": sum(m.identical for m in matches),
        "mismatches": [f"row {i}: {m.explain()}" for i, m in enumerate(matches) if not m.identical],
    }


def run(model_name: str | None = None, quick: bool = False, seed: int = 0, model_shape: str | None = None,
        dtype: str = "bfloat16", num_layers: int | None = None) -> dict[str, Any]:
    """Run every case; returns a JSON-friendly dict (see the module docstring). ``model_shape``: a real shape
    (flashpage/bench/shapes.py) in ``dtype`` with ``num_layers`` instead of ``model_name``. Token identity is
    the contract in float32 only (half-precision runs report their agreement; see docs/engine.md)."""
    from flashpage.bench.engine import load_model
    from flashpage.patches import patch, unpatch

    work = QUICK if quick else FULL
    bm, shape = load_model(model_name, quick, seed, model_shape, dtype, num_layers)
    model = bm.model
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(work.min_prompt, work.max_prompt + 1, (work.batch,), generator=gen).tolist()
    prompts = random_prompts(lengths, bm.vocab_size, seed + 2)
    pad_id = model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else 0
    ids, mask = left_pad(prompts, pad_id)

    _log(f"model: {bm.name}, {bm.parameters / 1e6:.1f}M parameters; warm-up ({work.warmup_tokens} tokens each)")
    _generate(model, ids, mask, work.warmup_tokens, pad_id)
    patch(model)
    try:
        _generate(model, ids, mask, work.warmup_tokens, pad_id)
    finally:
        unpatch(model)

    cases = {name: _run_case(model, ids, mask, lengths, name, n, pad_id) for name, n in work.cases}
    short, long_ = cases[work.cases[0][0]], cases[work.cases[-1][0]]
    goals = {
        "short_no_slower": short["ratio"] <= 1.0,
        "long_faster": long_["ratio"] < 1.0,
        "kv_within_bound": all(c["kv_within_bound"] for c in cases.values()),
        "outputs_agree": all(c["outputs_agree"] for c in cases.values()),
    }
    return {
        "bench": "generate",
        "quick": quick,
        **bm.run_facts(),
        "shape": shape,
        "token_contract": bm.dtype == "float32",
        "attn_unpatched": model.config._attn_implementation,
        "batch": work.batch,
        "prompt_lengths": lengths,
        "padded_width": int(ids.shape[1]),
        "cases": cases,
        "goals": goals,
        "outputs_agree": goals["outputs_agree"],
        "kv_within_bound": goals["kv_within_bound"],
        "timing_note": "wall clock after one warm-up each; short case best of 3 alternating runs, long case one run",
    }


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    lines = [
        f"bench generate: {result['model']} ({result['parameters'] / 1e6:.1f}M params, {result['dtype']}, "
        f"{result['device']}, {result['threads']} threads, load avg {result['load_average_1m']}"
        f"{', quick' if result['quick'] else ''})",
        f"batch {result['batch']}, left-padded to {result['padded_width']}, prompt lengths {result['prompt_lengths']}, "
        "greedy, EOS ignored; unpatched = transformers DynamicCache + "
        f"{result['attn_unpatched']}, patched = flashpage.patch (HFPagedCache)",
        "",
        f"{'case':<7}{'new':>6}{'unpatched s':>13}{'patched s':>11}{'ratio':>8}{'tok/s unp':>11}{'tok/s pat':>11}"
        f"   outputs",
    ]
    for name, c in result["cases"].items():
        differ = "DIFFER" if result.get("token_contract", True) else "differ"
        agree = "identical" if c["outputs_identical"] else ("agree (ties)" if c["outputs_agree"] else differ)
        lines.append(f"{name:<7}{c['new_tokens']:>6}{c['seconds_unpatched']:>13.2f}{c['seconds_patched']:>11.2f}"
                     f"{c['ratio']:>8.2f}{c['tok_s_unpatched']:>11.1f}{c['tok_s_patched']:>11.1f}   {agree} "
                     f"({c['rows_identical']}/{c['batch']} rows identical)")
    lines += ["", "KV memory at the end of generation:"]
    for name, c in result["cases"].items():
        lines.append(
            f"  {name:<6} dense {_kib(c['dense_kv_bytes'])}, paged in use {_kib(c['paged_kv_bytes_in_use'])} "
            f"({c['kv_saving']:.2f}x less), allocated {_kib(c['paged_kv_bytes_allocated'])}; bound "
            f"{_kib(c['kv_bound_bytes'])} ({c['kv_real_tokens']} real tokens -> blocks of {c['block_size']}): "
            f"{'ok' if c['kv_within_bound'] else 'EXCEEDED'}")
    for name, c in result["cases"].items():
        for m in c["mismatches"]:
            lines.append(f"  {name}: {m}")
    g = result["goals"]
    s, lg = result["cases"]["short"], result["cases"]["long"]
    lines += [
        "",
        "goals:",
        f"  short no slower than unpatched (ratio <= 1): {'met' if g['short_no_slower'] else 'NOT met'} "
        f"(ratio {s['ratio']:.2f})",
        f"  long faster than unpatched (ratio < 1):      {'met' if g['long_faster'] else 'NOT met'} "
        f"(ratio {lg['ratio']:.2f})",
        f"  paged KV <= real tokens rounded to blocks:  {'met' if g['kv_within_bound'] else 'NOT met'}",
        f"  outputs agree (tie-aware):                  {'yes' if g['outputs_agree'] else 'NO'}"
        + ("" if result.get("token_contract", True) else f" (no token contract in {result['dtype']}: its GEMMs "
           "and softmax round differently from transformers'; the closeness contract is in docs/engine.md)"),
        f"  ({result['timing_note']})",
    ]
    return "\n".join(lines)
