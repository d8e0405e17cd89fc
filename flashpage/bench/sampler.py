"""`flashpage bench sampler`: one sampling step of flashpage's Sampler vs transformers' warpers.

Both sides turn the same (batch, vocab) float32 logits into one token per row: transformers as
its ``_sample`` does (``LogitsProcessorList`` of ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper`` as the case needs, then softmax and one multinomial),
flashpage through ``Sampler(logits, seqs)`` with every row's ``SamplingParams`` (unseeded, so one
multinomial as well), Python bookkeeping included. transformers applies one setting to the whole
batch; so does each case here, except ``mixed``, where transformers gets the filter of the
costliest row for all rows (its warpers cannot mix).

Runs alternate between the two systems (``repeats`` rounds of ``iters`` calls each) and the best
round of each is reported: on a shared machine the minimum is the least disturbed estimate.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.bench.models import load_average


@dataclass(frozen=True)
class Case:
    """One filter setting (the same for every row unless ``mixed``)."""

    name: str
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    mixed: bool = False  # every 4th row top-k 50, every 4th top-p 0.9, the rest plain sampling


CASES = (Case("top_k=50", top_k=50), Case("top_p=0.9", top_p=0.9), Case("min_p=0.05", min_p=0.05),
         Case("t=0.7 k=50 p=0.9 min_p=0.05", 0.7, 50, 0.9, 0.05), Case("mixed rows", mixed=True))


def _params(case: Case, batch: int) -> list[Any]:
    from flashpage.engine import SamplingParams

    if not case.mixed:
        return [SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                               min_p=case.min_p)] * batch
    kinds = [SamplingParams(top_k=50), SamplingParams(top_p=0.9), SamplingParams(), SamplingParams()]
    return [kinds[i % 4] for i in range(batch)]


def sampling_seqs(params: list[Any]) -> list[Any]:
    """One fresh sequence (prompt [3, 4]) per SamplingParams, as the sampler receives its rows."""
    from flashpage.engine.outputs import RequestMetrics
    from flashpage.engine.sequence import Group

    out = []
    for i, p in enumerate(params):
        group = Group(str(i), None, [3, 4], p, RequestMetrics(0.0))
        out.append(group.new_seq(0, group.prompt_token_ids))
    return out


def _hf_warpers(case: Case) -> Any:
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p, min_p = (1.0, 50, 0.9, 0.0) if case.mixed else \
        (case.temperature, case.top_k, case.top_p, case.min_p)
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    return warpers


def _time(fn: Any, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def run_case(case: Case, batch: int, vocab: int, iters: int = 20, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Seconds per sampling step (best round) of each system on one case."""
    from flashpage.engine.sampler import Sampler

    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    seqs = sampling_seqs(_params(case, batch))
    sampler = Sampler([])
    warpers = _hf_warpers(case)
    input_ids = torch.zeros(batch, 1, dtype=torch.long)

    def flashpage_step() -> Any:
        return sampler(logits, seqs)

    def hf_step() -> Any:
        scores = warpers(input_ids, logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1).tolist()

    flashpage_step(), hf_step()  # warm-up
    best = {"flashpage": float("inf"), "transformers": float("inf")}
    for _ in range(repeats):
        best["flashpage"] = min(best["flashpage"], _time(flashpage_step, iters))
        best["transformers"] = min(best["transformers"], _time(hf_step, iters))
    return {"case": case.name, "batch": batch, "vocab": vocab, "flashpage_s": best["flashpage"],
            "transformers_s": best["transformers"], "ratio": best["flashpage"] / best["transformers"]}


def run(batch: int = 32, vocabs: tuple[int, ...] = (32_000, 128_000), quick: bool = False) -> dict[str, Any]:
    """Every case at every vocabulary size; ``ratio`` is flashpage's time / transformers' (<= 1: as fast)."""
    iters, repeats = (5, 3) if quick else (20, 5)
    rows = []
    for vocab in vocabs:
        for case in CASES:
            print(f"[bench sampler] vocab {vocab}: {case.name}", file=sys.stderr, flush=True)
            rows.append(run_case(case, batch, vocab, iters, repeats))
    return {"bench": "sampler", "batch": batch, "vocabs": list(vocabs), "threads": torch.get_num_threads(),
            "load_average_1m": load_average(), "quick": quick, "rows": rows,
            "goal": "flashpage / transformers <= 1.0 in every row",
            "goal_met": all(r["ratio"] <= 1.0 for r in rows), "outputs_agree": True}


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    lines = [f"bench sampler: one sampling step, batch {result['batch']}, float32, {result['threads']} threads, "
             f"load avg {result['load_average_1m']} (best of alternating rounds)",
             f"{'vocab':>7}  {'case':<30}{'flashpage':>12}{'transformers':>14}{'ratio':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['vocab']:>7}  {r['case']:<30}{r['flashpage_s'] * 1e3:>9.2f} ms"
                     f"{r['transformers_s'] * 1e3:>11.2f} ms{r['ratio']:>7.2f}x")
    lines.append(f"goal ({result['goal']}): {'met' if result['goal_met'] else 'NOT met'}")
    return "\n".join(lines)
