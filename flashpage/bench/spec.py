"""`flashpage bench spec`: tokens/s of flashpage.LLM with n-gram speculation against the same LLM without it.

Two workloads on the built-in tiny model, each at several batch sizes (one request per sequence):

- ``copy``: a pydoc help topic's first 96 tokens, a blank line, then its first 8 tokens again (the model is
  asked to repeat the text); greedy. The tiny model does not copy its prompt faithfully, but it repeats
  its own phrases, which the n-gram lookup finds.
- ``open``: the first 8 tokens of a help topic, sampled at temperature 0.8 (seeded): open-ended text.

Each (workload, batch) runs once untimed (warm-up: the flat step's verification, the prompts' prefix
cache) and then ``--repeats`` times timed, alternating with and without speculation (the fastest of each kept: the
machine may be shared), on one LLM per configuration. Reported: output tokens per second, the ratio, speculation's
mean acceptance length (tokens per verified sequence-step) and, for
greedy runs, whether the outputs are token-identical. Torch runs on ``--threads`` threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

WORKLOADS = ("copy", "open")
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class Row:
    """One (workload, batch) measurement."""

    workload: str
    batch: int
    tokens_per_s_base: float
    tokens_per_s_spec: float
    ratio: float
    acceptance_length: float
    accepted_per_proposed: float
    identical: bool | None  # greedy: outputs token-identical; None for sampled workloads


def prompts_for(workload: str, batch: int, tok: Any) -> list[list[int]]:
    """``batch`` prompts (token ids) of a workload, one help topic each (cycled)."""
    from flashpage.tiny.corpus import help_topics

    topics = help_topics()
    out = []
    for i in range(batch):
        ids = tok(topics[i % len(topics)])["input_ids"]
        out.append(ids[:96] + tok("\n\n")["input_ids"] + ids[:8] if workload == "copy" else ids[:8])
    return out


def params_for(workload: str, max_tokens: int) -> Any:
    from flashpage import SamplingParams

    if workload == "copy":
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0, ignore_eos=True)


def _timed(llms: tuple[Any, Any], prompts: list[list[int]], params: Any,
           repeats: int) -> tuple[list[float], list[list[list[int]]]]:
    """A warm-up run of each LLM, then ``repeats`` timed rounds alternating between them (drifting load on a
    shared machine hits both alike): each one's output tokens per second in its fastest round, and its
    outputs' token ids."""
    best = [math.inf] * len(llms)
    ids: list[list[list[int]]] = [[] for _ in llms]
    for llm in llms:
        llm.generate(prompts, params, use_tqdm=False)
    for _ in range(repeats):
        for i, llm in enumerate(llms):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best[i] = min(best[i], time.perf_counter() - start)
            ids[i] = [o.outputs[0].token_ids for o in outs]
    return [sum(len(t) for t in ids[i]) / best[i] for i in range(len(llms))], ids


def measure(workload: str, batch: int, max_tokens: int, base: Any, spec: Any, tok: Any, repeats: int = 5) -> Row:
    """Tokens/s of ``base`` and ``spec`` (LLMs on the same model) on one workload and batch size; acceptance
    counted over the warm-up and timed runs of ``spec``."""
    prompts, params = prompts_for(workload, batch, tok), params_for(workload, max_tokens)
    before = spec.stats()
    (rate_base, rate_spec), (ids_base, ids_spec) = _timed((base, spec), prompts, params, repeats)
    after = spec.stats()
    verified = after.spec_verifications - before.spec_verifications
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return Row(workload, batch, round(rate_base, 1), round(rate_spec, 1), round(rate_spec / rate_base, 3),
               round((accepted + verified) / verified, 3) if verified else 0.0,
               round(accepted / proposed, 3) if proposed else 0.0,
               ids_base == ids_spec if params.greedy else None)


def run(batches: list[int], max_tokens: int, threads: int, spec_config: dict[str, Any],
        repeats: int = 5) -> dict[str, Any]:
    """Every workload at every batch size; returns the rows and the settings."""
    import torch

    from flashpage import LLM
    from flashpage.tiny import load_tiny_model

    torch.set_num_threads(threads)
    model, tok = load_tiny_model()
    base = LLM(model, tok, max_num_seqs=max(batches))
    spec = LLM(model, tok, max_num_seqs=max(batches), speculative_config=spec_config)
    rows = [measure(w, b, max_tokens, base, spec, tok, repeats) for w in WORKLOADS for b in batches]
    return {"model": "flashpage.tiny", "threads": threads, "max_tokens": max_tokens, "repeats": repeats,
            "speculative_config": spec_config,
            "torch": torch.__version__, "rows": [asdict(r) for r in rows]}


def format_report(result: dict[str, Any]) -> str:
    lines = [f"flashpage bench spec: {result['model']}, {result['threads']} thread(s), {result['max_tokens']} "
             f"output tokens per request, best of {result['repeats']}, "
             f"speculative_config={json.dumps(result['speculative_config'])}",
             f"{'workload':<9}{'batch':>6}{'base tok/s':>12}{'spec tok/s':>12}{'ratio':>8}{'accept len':>12}"
             f"{'acc/prop':>10}{'identical':>11}"]
    for r in result["rows"]:
        same = "-" if r["identical"] is None else str(r["identical"])
        lines.append(f"{r['workload']:<9}{r['batch']:>6}{r['tokens_per_s_base']:>12.1f}{r['tokens_per_s_spec']:>12.1f}"
                     f"{r['ratio']:>7.2f}x{r['acceptance_length']:>12.2f}{r['accepted_per_proposed']:>10.2f}"
                     f"{same:>11}")
    return "\n".join(lines)


def add_arguments(b: argparse.ArgumentParser) -> None:
    """``flashpage bench spec``'s options."""
    b.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    b.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    b.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    b.add_argument("--repeats", type=int, default=5, help="timed runs per measurement, the fastest kept (default 5)")
    b.add_argument("--speculative-config", default=None, metavar="JSON",
                   help=f"the speculative_config to measure (default {json.dumps(DEFAULT_SPEC)})")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run (batch 1 and 8, 48 tokens)")


def _config(text: str | None) -> dict[str, Any]:
    """``--speculative-config``: JSON with LLM's speculative_config keys, checked before any model loads."""
    from flashpage.engine.spec import SpeculativeConfig

    if not text:
        return dict(DEFAULT_SPEC)
    try:
        config = json.loads(text)
        SpeculativeConfig.parse(config)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"flashpage bench spec: --speculative-config {text!r}: {exc}") from None
    return config


def run_cli(args: argparse.Namespace) -> int:
    """``flashpage bench spec``; exit 1 when a greedy run's outputs differ with speculation."""
    batches = [1, 8] if args.quick else [int(x) for x in str(args.batch_sizes).split(",") if x.strip()]
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch-sizes must list positive ints, got {args.batch_sizes!r}")
    config = _config(args.speculative_config)
    result = run(batches, 48 if args.quick else args.max_tokens, args.threads, config, max(1, args.repeats))
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if all(r["identical"] is not False for r in result["rows"]) else 1
