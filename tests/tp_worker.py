"""One rank of the tensor-parallel tests (tests/engine/test_tp.py starts two under torchrun, gloo, CPU).

Loads the built-in tiny model with ``tp_plan="auto"``, runs every scenario of the TP tests on it and
writes what it saw to ``<out_dir>/rank<r>.json``; test_tp.py compares the ranks with each other and
with a single-process run. Shared with ``scenarios()`` so the single-process reference runs the very
same requests.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.engine.distributed import drive, end_rank, follow, sync_rng

PROMPTS = ["The list", "A module is", "If the file", "Return the number of", "The default value is",
           "This module provides"]
WATCHDOG_S = 180
PREEMPT = {"num_blocks": 10, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 256}
PREEMPT_PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def hf_generate(model: Any, tok: Any, rank: int) -> dict[str, Any]:
    """Greedy patched generate() on a left-padded batch; the pages each rank holds; sampling after
    sync_rng() (each rank's RNG seeded differently first)."""
    batch = tok(PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left")
    flashpage.patch(model)
    try:
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
        torch.manual_seed(4000 + rank)
        sync_rng(model)
        sampled = model.generate(**batch, max_new_tokens=12, do_sample=True, top_k=0)
    finally:
        flashpage.unpatch(model)
    stats = out.cache.memory_stats()
    return {"sequences": out.sequences.tolist(), "kv_heads": out.cache.kv.num_kv_heads,
            "bytes_in_use": stats.bytes_in_use, "tokens_stored": stats.tokens_stored, "sampled": sampled.tolist()}


def greedy_llm() -> dict[str, Any]:
    """LLM(path, tensor_parallel_size=2): loads its own shard, as vLLM's LLM(..., tensor_parallel_size=2)."""
    llm = LLM(flashpage.tiny_model_path(), max_num_seqs=8, kv_cache_memory=1 << 22, tensor_parallel_size=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    s = llm.stats()
    return {"tokens": [o.outputs[0].token_ids for o in outs], "num_blocks": s.blocks_total,
            "kv_heads": s.kv_heads, "kv_bytes": s.kv_bytes, "tp_rank": s.tp_rank, "tp_size": s.tp_size}


def preemption_llm(model: Any, tok: Any) -> dict[str, Any]:
    """Eight requests that need ~32 blocks in a 10-block pool: preempted over and over."""
    llm = LLM(model, tok, check_invariants=True, **PREEMPT)
    prompts = [p + " and the" * 3 for p in PROMPTS] + PROMPTS[:2]
    outs = llm.generate(prompts, PREEMPT_PARAMS, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": llm.stats().preemptions}


def sampling(llm: LLM, rank: int) -> dict[str, Any]:
    """Unseeded (each rank's global RNG seeded differently), seeded, n > 1, logprobs and stop strings."""
    torch.manual_seed(1000 + rank)
    unseeded = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0), use_tqdm=False)
    seeded = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=2,
                                                      logprobs=2), use_tqdm=False)
    stops = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, stop=[" the", "."],
                                                 repetition_penalty=1.2), use_tqdm=False)
    return {
        "unseeded": [o.outputs[0].token_ids for o in unseeded],
        "seeded": [[c.token_ids for c in o.outputs] for o in seeded],
        "logprobs": [[lp.logprob for lp in o.outputs[0].logprobs or []] for o in seeded],
        "stops": [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in stops],
    }


def aborts(llm: LLM, rank: int) -> dict[str, Any]:
    """Rank 0 alone aborts a request mid-stream (step API); then every rank leaves a stream early."""
    torch.manual_seed(2000 + rank)
    params = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    for i, rid in enumerate(("a", "b", "c")):
        llm.add_request(PROMPTS[i], params, request_id=rid)
    final: dict[str, Any] = {}
    steps = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        steps += 1
        if steps == 5 and rank == 0:
            llm.abort("b")
    streamed: list[list[int]] = []
    for i, delta in enumerate(llm.stream(PROMPTS[:2], SamplingParams(max_tokens=30, temperature=1.0))):
        streamed.append(delta.token_ids)
        if i == 6:
            break  # the stream's requests are aborted on every rank
    after = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return {"final": final, "streamed": streamed, "after": [o.outputs[0].token_ids for o in after],
            "running": llm.stats().running}


def driver(llm: LLM, rank: int) -> dict[str, Any]:
    """Rank 0 alone adds (and aborts) requests inside drive(); rank 1 follows; then SPMD again."""
    torch.manual_seed(3000 + rank)
    before = llm.stats()
    out: dict[str, Any] = {}
    if rank == 0:
        with drive(llm):
            outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=1.0), use_tqdm=False)
            out["tokens"] = [o.outputs[0].token_ids for o in outs]
            llm.add_request(PROMPTS[4], SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),
                            request_id="d")
            llm.step()
            llm.step()
            llm.abort("d")
            out["d"] = [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in llm.step()]
    else:
        out["follower_steps"] = follow(llm)
    after = llm.stats()
    out["steps"] = after.steps - before.steps
    out["generated"] = after.generated_tokens - before.generated_tokens
    out["spmd_after"] = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS[:2], SamplingParams(max_tokens=6, temperature=1.0), use_tqdm=False)]
    return out


SPEC_PROMPTS = [p + " of the list of the list" for p in PROMPTS]  # repeats: n-gram lookups find something
SPEC_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def spec_counts(llm: LLM) -> list[float]:
    s = llm.stats()
    return [s.spec_proposed_tokens, s.spec_accepted_tokens, s.spec_verifications, s.spec_mean_acceptance_length]


def speculative(model: Any, tok: Any, rank: int) -> dict[str, Any]:
    """Speculative decoding on the sharded model: n-gram (greedy, then unseeded sampling with each rank's RNG
    seeded differently: the verified tokens must be rank 0's) and a draft model loaded whole on every rank."""
    ngram = LLM(model, tok, max_num_seqs=8, kv_cache_memory=1 << 22, speculative_config=NGRAM,
                check_invariants=True)
    greedy = ngram.generate(SPEC_PROMPTS, SPEC_PARAMS, use_tqdm=False)
    out: dict[str, Any] = {"ngram": [o.outputs[0].token_ids for o in greedy], "ngram_counts": spec_counts(ngram)}
    torch.manual_seed(5000 + rank)
    sampled = ngram.generate(SPEC_PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),
                             use_tqdm=False)
    out["ngram_sampled"] = [o.outputs[0].token_ids for o in sampled]
    out["ngram_sampled_counts"] = spec_counts(ngram)
    draft = LLM(model, tok, max_num_seqs=8, kv_cache_memory=1 << 22, check_invariants=True,
                speculative_config={"model": flashpage.tiny_model_path(), "num_speculative_tokens": 3})
    outs = draft.generate(SPEC_PROMPTS, SPEC_PARAMS, use_tqdm=False)
    out["draft"], out["draft_counts"] = [o.outputs[0].token_ids for o in outs], spec_counts(draft)
    return out


def divergence(llm: LLM, rank: int) -> dict[str, Any]:
    """Rank 1 asks for another prompt: every rank must refuse the step, none may hang."""
    prompt = PROMPTS[0] if rank == 0 else PROMPTS[1]
    try:
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    except flashpage.RankDivergence as exc:
        return {"error": str(exc), "running": llm.stats().running, "waiting": llm.stats().waiting}
    return {"error": None}


def main(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang prints where, and the rank still exits
    dist.init_process_group("gloo", timeout=timedelta(seconds=WATCHDOG_S // 2))
    rank = dist.get_rank()
    path = flashpage.tiny_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    tok = AutoTokenizer.from_pretrained(path)
    report: dict[str, Any] = {"generate": hf_generate(model, tok, rank), "greedy": greedy_llm(),
                              "preemption": preemption_llm(model, tok), "speculative": speculative(model, tok, rank)}
    llm = LLM(model, tok, max_num_seqs=8, kv_cache_memory=1 << 22)
    report["sampling"] = sampling(llm, rank)
    report["aborts"] = aborts(llm, rank)
    report["driver"] = driver(llm, rank)
    report["divergence"] = divergence(llm, rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    end_rank(0)


if __name__ == "__main__":
    main(sys.argv[1])
