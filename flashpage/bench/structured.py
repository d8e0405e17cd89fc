"""`flashpage bench structured`: what structured outputs cost per generated token, in the engine.

The same ``--num-requests`` prompts run three times through one ``LLM`` (greedy, all at once): without
constraints, every request under a JSON schema, and half of them under it (mixed). The grammar's
work is timed where the engine does it: :meth:`GrammarEngine.apply` (fill the bitmask of the
constrained rows, mask their logits) and :meth:`GrammarEngine.accept` (advance the matchers). The
report gives that time per constrained token (the structured-output cost per token), the engine's
time per output token of each run, and checks that every constrained output that ended with "stop"
parses and validates. The schema has free-text strings (up to 48 characters), the expensive case
for a token mask: inside a string almost every token is allowed and must be checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 48}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["title", "year", "tags"], "additionalProperties": False}


def _timed(engine: Any, totals: dict[str, float]) -> None:
    """Wrap the grammar engine's per-step methods with timers (on this instance only)."""
    for name in ("apply", "accept"):
        inner = getattr(engine, name)

        def timed(*args: Any, _inner: Any = inner, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(engine, name, timed)


def run(num_requests: int = 64, max_tokens: int = 64, quick: bool = False) -> dict[str, Any]:
    import jsonschema

    from flashpage import LLM, SamplingParams, StructuredOutputsParams, load_tiny_model
    from flashpage.bench.serve import make_prompts

    if quick:
        num_requests, max_tokens = min(num_requests, 16), min(max_tokens, 32)
    model, tok = load_tiny_model()
    llm = LLM(model, tok, max_num_seqs=num_requests)
    prompts = make_prompts(num_requests, seed=0)
    plain = SamplingParams(max_tokens=max_tokens, temperature=0)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    totals = {"apply": 0.0, "accept": 0.0}
    _timed(llm._grammar_engine(), totals)
    llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm up (and compile the schema once)
    rows, invalid = [], 0
    for label, params in (("plain", [plain] * num_requests), ("json schema", [constrained] * num_requests),
                          ("mixed (half json)", [constrained if i % 2 else plain for i in range(num_requests)])):
        totals.update(apply=0.0, accept=0.0)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ctokens = sum(len(o.outputs[0].token_ids) for o, p in zip(outs, params, strict=True)
                      if p.structured_outputs is not None)
        stops = 0
        for o, p in zip(outs, params, strict=True):
            c = o.outputs[0]
            if p.structured_outputs is not None and c.finish_reason == "stop":
                stops += 1
                try:
                    jsonschema.validate(json.loads(c.text), SCHEMA)
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
        grammar = totals["apply"] + totals["accept"]
        rows.append({"workload": label, "requests": num_requests, "output_tokens": tokens,
                     "constrained_tokens": ctokens, "constrained_stopped": stops,
                     "ms_per_output_token": round(1e3 * wall / tokens, 3),
                     "grammar_ms_per_constrained_token": round(1e3 * grammar / ctokens, 3) if ctokens else None,
                     "mask_ms_per_constrained_token": round(1e3 * totals["apply"] / ctokens, 3) if ctokens else None,
                     "grammar_share_of_wall": round(grammar / wall, 3)})
        print(f"[bench structured] {rows[-1]}", file=sys.stderr)
    return {"bench": "structured", "quick": quick, "model": "flashpage-tiny", "max_tokens": max_tokens,
            "rows": rows, "invalid_outputs": invalid, "outputs_agree": invalid == 0,
            "workload": f"{num_requests} requests at once, greedy, max_tokens {max_tokens}, schema with "
                        "free-text strings; grammar time = GrammarEngine.apply + accept (one llguidance thread "
                        "per core it is given)"}


def format_report(result: dict[str, Any]) -> str:
    lines = [f"bench structured: {result['model']}; {result['workload']}", ""]
    head = (f"{'workload':<20} {'tokens':>7} {'constr.':>7} {'ms/token':>9} {'grammar ms/constr. token':>25} "
            f"{'of which mask':>14} {'grammar share':>14}")
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        g = "-" if r["grammar_ms_per_constrained_token"] is None else f"{r['grammar_ms_per_constrained_token']:.3f}"
        m = "-" if r["mask_ms_per_constrained_token"] is None else f"{r['mask_ms_per_constrained_token']:.3f}"
        lines.append(f"{r['workload']:<20} {r['output_tokens']:>7} {r['constrained_tokens']:>7} "
                     f"{r['ms_per_output_token']:>9.3f} {g:>25} {m:>14} {r['grammar_share_of_wall']:>14.1%}")
    lines += ["", f"constrained outputs that ended 'stop' and do not validate: {result['invalid_outputs']}"]
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``flashpage bench structured``; exit 1 when a constrained output does not validate."""
    result = run(args.num_requests, args.max_tokens, args.quick)
    from flashpage.bench.record import dumps

    print(dumps(result) if args.json else format_report(result))
    return 0 if result["outputs_agree"] else 1
