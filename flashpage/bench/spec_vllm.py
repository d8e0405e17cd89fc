"""`flashpage bench spec --against vllm`: speculation's speedup in flashpage.LLM and in vLLM, side by side.

The same workloads as ``flashpage bench spec`` (:mod:`flashpage.bench.spec`: ``copy``, greedy; ``open``, sampled
at temperature 0.8 with seed 0) on the same saved model (the built-in model's checkpoint directory), with the
same engine settings for both systems: block size 128 (vLLM's CPU attention needs a multiple of 32), the same KV
pool in bytes, ``max_model_len``, ``max_num_seqs``, float32, prefix caching on, ``threads`` threads bound to the
same cores (:mod:`flashpage.bench.vs_vllm`). vLLM runs in its own interpreter (``--vllm-python``) on
``vllm_runner.py``'s :func:`measure_cases`: one engine without speculation and one with vLLM's n-gram speculation
(``speculative_config={"method": "ngram", ...}``, the same k / prompt_lookup_min / _max), each case warmed up once
and timed ``repeats`` times. Rounds alternate: flashpage (with and without, alternating), then vLLM without,
then vLLM with. Reported per (workload, batch): each system's tok/s with and without speculation and its
speedup, flashpage / vLLM ratios, acceptance length (vLLM's from its ``vllm:spec_decode_*`` counters:
``1 + accepted / drafts``), and whether the greedy tokens agree (flashpage without speculation against vLLM
without, and each system with speculation against itself without). Where vLLM refuses n-gram speculation, its
own error is reported in place of its speculative numbers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

KV_TOKENS_PER_SEQ = 512  # max_model_len of both systems: a prompt (<= 110 tokens) and up to ~400 output tokens
BLOCK = 128


def vllm_spec_config(spec_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's n-gram speculative_config for flashpage's (the same k / min / max); ValueError for a draft model."""
    from flashpage.engine.spec import SpeculativeConfig

    parsed = SpeculativeConfig.parse(spec_config)
    assert parsed is not None
    if parsed.method != "ngram":
        raise ValueError("--against vllm measures n-gram speculation; give a --speculative-config with "
                         "method 'ngram' (or leave it out)")
    return {"method": "ngram", "num_speculative_tokens": parsed.num_speculative_tokens,
            "prompt_lookup_max": parsed.prompt_lookup_max, "prompt_lookup_min": parsed.prompt_lookup_min}


def _cases(batches: list[int], max_tokens: int, tok: Any) -> list[dict[str, Any]]:
    from flashpage.bench.spec import WORKLOADS, params_for, prompts_for

    cases = []
    for workload in WORKLOADS:
        params = params_for(workload, max_tokens)
        for batch in batches:
            cases.append({"name": f"{workload}-{batch}", "workload": workload, "batch": batch,
                          "prompts": prompts_for(workload, batch, tok), "max_tokens": max_tokens,
                          "temperature": float(params.temperature), "seed": params.seed})
    return cases


def run_against_vllm(vllm_python: str | None, batches: list[int], max_tokens: int, threads: int,
                     spec_config: dict[str, Any], repeats: int = 3, rounds: int = 2) -> dict[str, Any]:
    """Alternate ``rounds`` rounds of flashpage (with / without speculation) and vLLM (without, with); see the
    module docstring. The fastest run of each (system, configuration, case) is kept."""
    import torch

    from flashpage import LLM, tiny_model_path
    from flashpage.bench.vs_vllm import _kv_bytes_per_token, check_vllm_python, cpu_bind_spec
    from flashpage.tiny import load_tiny_model

    vllm_config = vllm_spec_config(spec_config)
    version = check_vllm_python(vllm_python)
    assert vllm_python is not None
    torch.set_num_threads(threads)
    model, tok = load_tiny_model()
    cases = _cases(batches, max_tokens, tok)
    pool_bytes = max(batches) * KV_TOKENS_PER_SEQ * _kv_bytes_per_token(model)
    settings = {"max_num_seqs": max(batches), "max_num_batched_tokens": 2048, "enable_prefix_caching": True,
                "block_size": BLOCK, "dtype": "float32", "kv_cache_memory_bytes": pool_bytes,
                "max_model_len": KV_TOKENS_PER_SEQ, "threads": threads}
    common = {"max_num_seqs": max(batches), "block_size": BLOCK, "kv_cache_memory": pool_bytes,
              "max_model_len": KV_TOKENS_PER_SEQ, "max_num_batched_tokens": 2048}
    llms = (LLM(model, tok, **common), LLM(model, tok, speculative_config=spec_config, **common))
    runner_spec = {"model": str(Path(tiny_model_path()).resolve()), "cases": [
        {k: c[k] for k in ("name", "prompts", "max_tokens", "temperature", "seed")} for c in cases],
        "repeats": repeats, **settings}
    fp: dict[str, dict[str, Any]] = {}
    vl: dict[str, dict[str, Any]] = {"base": {}, "spec": {}}
    spec_error: str | None = None
    for _ in range(rounds):
        _flashpage_round(cases, llms, tok, max_tokens, repeats, threads, fp)
        for label in ("base", "spec") if spec_error is None else ("base",):
            got, error = _vllm_round(vllm_python, {**runner_spec, "speculative_config":
                                                   vllm_config if label == "spec" else None})
            if error is not None:
                spec_error = error
                continue
            _keep_best(vl[label], got["cases"])
    rows = [_row(c, fp[c["name"]], vl["base"].get(c["name"]), vl["spec"].get(c["name"])) for c in cases]
    return {"bench": "spec_vs_vllm", "model": "flashpage.tiny", "vllm_version": version, "threads": threads,
            "max_tokens": max_tokens, "repeats": repeats, "rounds": rounds, "speculative_config": spec_config,
            "vllm_speculative_config": vllm_config, "settings": {**settings, "cores": cpu_bind_spec(threads)},
            "vllm_spec_error": spec_error, "torch": torch.__version__, "rows": rows,
            "timing_note": "alternating rounds on a shared host; fastest run of each kept; generate() calls only"}


def _flashpage_round(cases: list[dict[str, Any]], llms: tuple[Any, Any], tok: Any, max_tokens: int, repeats: int,
                     threads: int, fp: dict[str, dict[str, Any]]) -> None:
    """flashpage's runs of every case (bench spec's measurement: warm-up, then base / spec alternating), bound to
    vLLM's cores; each case's fastest rates kept in ``fp``."""
    from flashpage.bench.spec import measure_with_tokens
    from flashpage.bench.vs_vllm import flashpage_bind_spec
    from flashpage.cpu_threads import bound_cpu_threads

    with bound_cpu_threads(flashpage_bind_spec(threads)):
        for c in cases:
            row, ids_base = measure_with_tokens(c["workload"], c["batch"], max_tokens, *llms, tok, repeats)
            old = fp.get(c["name"])
            fp[c["name"]] = {"base": max(row.tokens_per_s_base, old["base"] if old else 0.0),
                             "spec": max(row.tokens_per_s_spec, old["spec"] if old else 0.0),
                             "acceptance_length": row.acceptance_length, "identical": row.identical,
                             "tokens": ids_base}


def _vllm_round(python: str, spec: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """One vLLM engine over every case: its result, or (for a speculative engine that fails) vLLM's error."""
    from flashpage.bench.vs_vllm import VLLMRunError, run_vllm

    with tempfile.TemporaryDirectory(prefix="flashpage-spec-vllm-") as tmp:
        try:
            return run_vllm(python, spec, Path(tmp)), None
        except VLLMRunError as exc:
            if not spec.get("speculative_config"):
                raise
            return {}, str(exc)


def _keep_best(best: dict[str, dict[str, Any]], cases: list[dict[str, Any]]) -> None:
    for c in cases:
        rate = c["output_tokens"] / c["seconds"]
        old = best.get(c["name"])
        counts = c.get("spec") or {}
        drafts = counts.get("drafts", 0)
        accepted = counts.get("accepted_tokens", 0)
        best[c["name"]] = {"rate": max(rate, old["rate"] if old else 0.0), "tokens": c["tokens"],
                           "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                           "accepted_per_proposed": round(accepted / counts["draft_tokens"], 3)
                           if counts.get("draft_tokens") else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _row(case: dict[str, Any], fp: dict[str, Any], vb: dict[str, Any] | None, vs: dict[str, Any] | None) -> dict:
    greedy = case["temperature"] == 0.0
    vb_rate = vb["rate"] if vb else None
    vs_rate = vs["rate"] if vs else None
    return {"workload": case["workload"], "batch": case["batch"],
            "flashpage_tok_s_base": round(fp["base"], 1), "flashpage_tok_s_spec": round(fp["spec"], 1),
            "flashpage_speedup": _ratio(fp["spec"], fp["base"]),
            "flashpage_acceptance_length": fp["acceptance_length"],
            "vllm_tok_s_base": round(vb_rate, 1) if vb_rate else None,
            "vllm_tok_s_spec": round(vs_rate, 1) if vs_rate else None,
            "vllm_speedup": _ratio(vs_rate, vb_rate),
            "vllm_acceptance_length": vs["acceptance_length"] if vs else None,
            "flashpage_over_vllm_base": _ratio(fp["base"], vb_rate),
            "flashpage_over_vllm_spec": _ratio(fp["spec"], vs_rate),
            "flashpage_spec_identical": fp["identical"],
            "vllm_spec_identical": (vs["tokens"] == vb["tokens"]) if greedy and vs and vb else None,
            "tokens_agree_with_vllm": (fp["tokens"] == vb["tokens"]) if greedy and vb else None}


def _cell(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    return fmt.format(value)


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run_against_vllm`'s result."""
    lines = [f"flashpage bench spec --against vllm: {result['model']} (the same saved checkpoint), vLLM "
             f"{result['vllm_version']}, {result['threads']} thread(s) on cores {result['settings']['cores']}, "
             f"{result['max_tokens']} output tokens per request, best of {result['rounds']} rounds x "
             f"{result['repeats']} runs, alternating; host is shared: ratios, not absolute numbers",
             f"flashpage speculative_config={json.dumps(result['speculative_config'])}; vLLM "
             f"speculative_config={json.dumps(result['vllm_speculative_config'])}",
             f"{'workload':<9}{'batch':>6}{'fp base':>9}{'fp spec':>9}{'fp x':>7}{'fp acc':>8}{'vl base':>9}"
             f"{'vl spec':>9}{'vl x':>7}{'vl acc':>8}{'fp/vl':>7}{'fp/vl spec':>11}{'same tokens':>16}"]
    for r in result["rows"]:
        agree = "-" if r["tokens_agree_with_vllm"] is None else (
            f"{r['tokens_agree_with_vllm']}/{r['flashpage_spec_identical']}/{r['vllm_spec_identical']}")
        lines.append(f"{r['workload']:<9}{r['batch']:>6}{_cell(r['flashpage_tok_s_base']):>9}"
                     f"{_cell(r['flashpage_tok_s_spec']):>9}{_cell(r['flashpage_speedup'], '{:.2f}x'):>7}"
                     f"{_cell(r['flashpage_acceptance_length'], '{:.2f}'):>8}{_cell(r['vllm_tok_s_base']):>9}"
                     f"{_cell(r['vllm_tok_s_spec']):>9}{_cell(r['vllm_speedup'], '{:.2f}x'):>7}"
                     f"{_cell(r['vllm_acceptance_length'], '{:.2f}'):>8}"
                     f"{_cell(r['flashpage_over_vllm_base'], '{:.2f}x'):>7}"
                     f"{_cell(r['flashpage_over_vllm_spec'], '{:.2f}x'):>11}{agree:>16}")
    lines.append("x: speedup from speculation; acc: acceptance length (tokens per verified sequence-step); same "
                 "tokens (greedy): flashpage = vLLM without speculation / flashpage spec = base / vLLM spec = base")
    if result.get("vllm_spec_error"):
        lines.append("vLLM refused n-gram speculation; its error:\n" + result["vllm_spec_error"])
    return "\n".join(lines)
