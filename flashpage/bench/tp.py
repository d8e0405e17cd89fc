"""`flashpage bench tp`: flashpage.LLM under tensor parallelism, per-rank KV memory and throughput.

Two ways to run it:

- plain ``flashpage bench tp`` (one machine): runs the same seeded greedy workload with 1 rank and
  with 2 ranks (``--tp-sizes``), each size a ``torchrun`` on a loopback rendezvous (gloo on CPU,
  NCCL on CUDA), and prints one row per rank: KV heads held, KV bytes per token, pool and peak KV
  bytes, output tokens/s, and whether the tokens equal the 1-rank run;
- under ``torchrun`` (any number of ranks and nodes: ``torchrun --nnodes ... -m flashpage.cli bench tp``),
  every rank runs the workload once at the launched size and rank 0 prints the rows.

The model is the seeded random bench Llama (:mod:`flashpage.bench.models`; saved once per rank to a
temporary directory, because ``tp_plan="auto"`` loads from a checkpoint) or ``--model PATH``.
Requests: ``NUM_REQUESTS`` random prompts, greedy, EOS ignored, every request submitted at t0; the
pool holds all of them at full length on every rank (a fixed block count, so a rank's pool is
``1 / tp`` of the single-rank bytes when the KV heads split evenly).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from flashpage.serve.ports import free_port

BLOCK_SIZE = 16
WORKLOAD = {"quick": (8, 32, 64, 32), "full": (16, 64, 128, 64)}  # requests, prompt min/max, new tokens


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run(tp_sizes: list[int], model_name: str | None = None, quick: bool = False) -> dict[str, Any]:
    """Under torchrun: this launch's measurement (rank 0 gets every rank's row). Otherwise: one
    torchrun per size in ``tp_sizes`` on this machine, and the rows of all of them."""
    if under_torchrun():
        import torch.distributed as dist

        result = run_rank(model_name, quick)
        result["this_rank"] = dist.get_rank()
        dist.barrier()
        dist.destroy_process_group()
        return result
    runs = [_launch(n, model_name, quick) for n in tp_sizes]
    base = next((r for r in runs if r["tp_size"] == 1), None)
    for r in runs:
        r["tokens_equal_tp1"] = None if base is None else r["tokens_digest"] == base["tokens_digest"]
    agree = all(r["ranks_agree"] and r["tokens_equal_tp1"] is not False for r in runs)
    return {"runs": runs, "quick": quick, "model": runs[0]["model"] if runs else model_name, "outputs_agree": agree}


def _launch(size: int, model_name: str | None, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flashpage-bench-tp-") as tmp:
        out = Path(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "flashpage.bench.tp", "--out", str(out)]
        cmd += (["--model", model_name] if model_name else []) + (["--quick"] if quick else [])
        print(f"flashpage bench tp: {size} rank(s) ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=1800, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"flashpage bench tp: the {size}-rank torchrun failed (exit {proc.returncode}); "
                               "its output is above")
        return json.loads(out.read_text())


def run_rank(model_name: str | None, quick: bool) -> dict[str, Any]:
    """One rank's part of a launch: every rank measures, rank 0 returns all rows (others: their own)."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="flashpage-bench-model-") as tmp:
        path = model_name or _save_bench_model(tmp, quick)  # before the process group exists: saved on every rank
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
    label = model_name or f"random Llama ({model.config.num_hidden_layers} layers, hidden 512, 2 KV heads)"
    row = _measure(model, quick)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {"model": label, "tp_size": dist.get_world_size(), "ranks": rows,
            "tokens_digest": rows[0]["tokens_digest"],
            "ranks_agree": len({r["tokens_digest"] for r in rows}) == 1, "quick": quick,
            "outputs_agree": len({r["tokens_digest"] for r in rows}) == 1}


def _save_bench_model(directory: str, quick: bool) -> str:
    """The seeded bench model as a checkpoint (same seed on every rank: same weights)."""
    from flashpage.bench.models import bench_model

    bench_model(seed=0, quick=quick).save_pretrained(directory)
    return directory


def _measure(model: Any, quick: bool) -> dict[str, Any]:
    import hashlib

    from flashpage import LLM, SamplingParams
    from flashpage.bench.models import random_prompts

    n, lo, hi, new = WORKLOAD["quick" if quick else "full"]
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    prompts = random_prompts(lengths, int(model.config.vocab_size), seed=6)
    blocks = sum(-(-(p + new) // BLOCK_SIZE) for p in lengths)
    llm = LLM(model, block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=n, max_model_len=hi + new)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    start, peak, tokens = time.perf_counter(), 0, {}
    for i, p in enumerate(prompts):
        llm.add_request(p, params, request_id=str(i))
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, llm.stats().blocks_used)
    seconds = time.perf_counter() - start
    s = llm.stats()
    per_token = llm.sizing.bytes_per_token
    digest = hashlib.sha256(json.dumps([tokens[str(i)] for i in range(n)]).encode()).hexdigest()[:16]
    return {"rank": s.tp_rank, "kv_heads": s.kv_heads, "kv_bytes_per_token": per_token,
            "pool_bytes": s.kv_bytes, "peak_kv_bytes": peak * BLOCK_SIZE * per_token,
            "output_tokens": n * new, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(n * new / seconds, 1), "tokens_digest": digest,
            "device": str(llm.device), "threads": torch.get_num_threads()}


def format_report(result: dict[str, Any]) -> str:
    runs = result["runs"] if "runs" in result else [result]
    lines = [f"flashpage bench tp: {result.get('model')} (greedy, {'quick' if result.get('quick') else 'full'} "
             "workload; KV bytes are per rank)",
             f"  {'tp':>2} {'rank':>4} {'kv heads':>8} {'KV B/token':>10} {'pool MiB':>9} {'peak KV MiB':>11} "
             f"{'tok/s':>8}  tokens"]
    for r in runs:
        equal = r.get("tokens_equal_tp1")
        verdict = "ranks agree" if r["ranks_agree"] else "RANKS DIFFER"
        if equal is not None:
            verdict += ", = 1 rank" if equal else ", differ from 1 rank"
        for row in r["ranks"]:
            lines.append(f"  {r['tp_size']:>2} {row['rank']:>4} {row['kv_heads']:>8} {row['kv_bytes_per_token']:>10} "
                         f"{row['pool_bytes'] / 2**20:>9.2f} {row['peak_kv_bytes'] / 2**20:>11.2f} "
                         f"{row['output_tokens_per_s']:>8.1f}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``torchrun -m flashpage.bench.tp --out FILE``: one launch; rank 0 writes the result to FILE."""
    parser = argparse.ArgumentParser(prog="flashpage.bench.tp")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = run_rank(args.model, args.quick)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from flashpage.engine.distributed import end_rank

    end_rank(main())
