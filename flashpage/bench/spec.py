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
``--against vllm --vllm-python PATH``: vLLM's n-gram speculation beside it (:mod:`flashpage.bench.spec_vllm`).
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
    return measure_with_tokens(workload, batch, max_tokens, base, spec, tok, repeats)[0]


def measure_with_tokens(workload: str, batch: int, max_tokens: int, base: Any, spec: Any, tok: Any,
                        repeats: int = 5) -> tuple[Row, list[list[int]]]:
    """:func:`measure`, and the token ids ``base`` generated (one list per request)."""
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
               ids_base == ids_spec if params.greedy else None), ids_base


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


FIGURES_HEADER = f"{'base tok/s':>12}{'spec tok/s':>12}{'ratio':>8}{'accept len':>12}{'acc/prop':>10}{'identical':>11}"


def row_figures(r: dict[str, Any]) -> str:
    """One result row's figures, in the columns of :data:`FIGURES_HEADER`."""
    same = "-" if r["identical"] is None else str(r["identical"])
    return (f"{r['tokens_per_s_base']:>12.1f}{r['tokens_per_s_spec']:>12.1f}{r['ratio']:>7.2f}x"
            f"{r['acceptance_length']:>12.2f}{r['accepted_per_proposed']:>10.2f}{same:>11}")


def format_report(result: dict[str, Any]) -> str:
    lines = [f"flashpage bench spec: {result['model']}, {result['threads']} thread(s), {result['max_tokens']} "
             f"output tokens per request, best of {result['repeats']}, "
             f"speculative_config={json.dumps(result['speculative_config'])}",
             f"{'workload':<9}{'batch':>6}{FIGURES_HEADER}"]
    lines += [f"{r['workload']:<9}{r['batch']:>6}{row_figures(r)}" for r in result["rows"]]
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
    b.add_argument("--against", choices=["vllm"], default=None,
                   help="also run vLLM with and without its n-gram speculation on the same saved model "
                        "(flashpage/bench/spec_vllm.py); needs --vllm-python")
    b.add_argument("--vllm-python", default=None, metavar="PATH", help="python of a virtual environment with vLLM")
    b.add_argument("--model-shape", default=None, metavar="NAME",
                   help="a real model shape (flashpage bench shapes) as the target, random weights; n-gram and a "
                        "draft of its first --draft-layers layers (flashpage/bench/spec_shape.py)")
    b.add_argument("--dtype", default="bfloat16", help="with --model-shape: its dtype (default bfloat16)")
    b.add_argument("--num-layers", type=int, default=None,
                   help="with --model-shape: the target's layers (default 8)")
    b.add_argument("--draft-layers", type=int, default=None,
                   help="with --model-shape: the draft's layers, the target's first ones (default 2)")
    b.add_argument("--rounds", type=int, default=2,
                   help="with --against vllm: alternating rounds of both systems, the fastest kept (default 2)")


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


def dumps(result: dict[str, Any]) -> str:
    """``--json``: the result with its ``recorded_with`` (command, commit, versions, CPU, load, date)."""
    from flashpage.bench.record import dumps as recorded

    return recorded(result)


def run_cli(args: argparse.Namespace) -> int:
    """``flashpage bench spec``; exit 1 when a greedy run's outputs differ with speculation."""
    batches = [1, 8] if args.quick else [int(x) for x in str(args.batch_sizes).split(",") if x.strip()]
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch-sizes must list positive ints, got {args.batch_sizes!r}")
    config = _config(args.speculative_config)
    max_tokens = 48 if args.quick else args.max_tokens
    if args.against == "vllm" or args.vllm_python:
        return _run_against_vllm(args, batches, max_tokens, config)
    if args.model_shape is not None:
        return _run_shape(args, batches, max_tokens, config)
    result = run(batches, max_tokens, args.threads, config, max(1, args.repeats))
    print(dumps(result) if args.json else format_report(result))
    return 0 if all(r["identical"] is not False for r in result["rows"]) else 1


def _run_against_vllm(args: argparse.Namespace, batches: list[int], max_tokens: int, config: dict[str, Any]) -> int:
    """``--against vllm``: flashpage/bench/spec_vllm.py; bad options are refused (exit 2) before any model loads."""
    import sys

    from flashpage.bench import spec_vllm

    if args.against != "vllm":
        print("flashpage bench spec: --vllm-python is for --against vllm; add --against vllm", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.threads < 1:
        print(f"flashpage bench spec: --rounds {args.rounds} / --threads {args.threads}: give at least 1",
              file=sys.stderr)
        return 2
    try:
        result = spec_vllm.run_against_vllm(args.vllm_python, batches, max_tokens, args.threads, config,
                                            max(1, args.repeats), args.rounds)
    except ValueError as exc:
        print(f"flashpage bench spec --against vllm: {exc}", file=sys.stderr)
        return 2
    print(dumps(result) if args.json else spec_vllm.format_report(result))
    return 0 if all(r["flashpage_spec_identical"] is not False for r in result["rows"]) else 1


def _run_shape(args: argparse.Namespace, batches: list[int], max_tokens: int, config: dict[str, Any]) -> int:
    """``--model-shape``: flashpage/bench/spec_shape.py. Exit 1 only for a float32 greedy mismatch (half
    precision has no token contract: a verification row and a one-token step round differently)."""
    import sys

    from flashpage.bench import spec_shape
    from flashpage.engine.spec import SpeculativeConfig

    parsed = SpeculativeConfig.parse(config)
    if parsed is None or parsed.method != "ngram":
        print("flashpage bench spec --model-shape: --speculative-config is the n-gram one (the draft is the "
              "target's first --draft-layers layers)", file=sys.stderr)
        return 2
    try:
        result = spec_shape.run_shape(args.model_shape, args.dtype, args.num_layers or spec_shape.DEFAULT_LAYERS,
                                      args.draft_layers or spec_shape.DEFAULT_DRAFT_LAYERS, batches, max_tokens,
                                      args.threads, config, max(1, args.repeats))
    except ValueError as exc:
        print(f"flashpage bench spec --model-shape: {exc}", file=sys.stderr)
        return 2
    print(dumps(result) if args.json else spec_shape.format_report(result))
    exact = result["shape"]["dtype"] != "float32" or all(r["identical"] is not False for r in result["rows"])
    return 0 if exact else 1
