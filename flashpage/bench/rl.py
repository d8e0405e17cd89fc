"""`flashpage bench rl`: GRPO rollouts with flashpage vs TRL's own generation, and on-policy numbers.

One model, one GRPOTrainer configuration (``prompts`` x ``num_generations`` samples, completions up
to ``max_completion_length``, temperature 1, top_p 0.95), generation only (the trainer's own
``_generate``: tokenization, generation, the completion bookkeeping a GRPO step does), for
- ``flashpage``: ``rollout_func=flashpage_rollout()`` (KV pool made and released per rollout),
- ``flashpage_keep_kv``: the same with ``release_kv=False`` (the measurement behind the default),
- ``trl_generate``: TRL's default, padded ``model.generate()``,
- ``trl_continuous_batching``: ``use_transformers_continuous_batching=True`` (``generate_batch``,
  its pool given as many pages as the samples need at full length: its default takes half of the
  machine's memory on CPU),
alternating (each repeat starts with the next system), after one warm-up each. Reported: seconds
per GRPO step's generation, completion tokens/s, peak memory during the generation (CUDA: peak
allocated; CPU: peak RSS above the RSS before, via /proc/self/clear_refs), and

- a seeded two-sample test that flashpage samples from the same distribution as TRL's generate():
  chi-square homogeneity of the first completion token per prompt (rare tokens pooled) and a
  Kolmogorov-Smirnov test of the completions' mean per-token logprob under the trainer (p-values;
  they are expected to be large, not 1);
- on-policy numbers: rollout logprobs against the trainer's own recomputation of the same tokens
  (``GRPOTrainer._get_per_token_logps_and_entropies`` on the padded batch TRL builds; what TRL's
  importance-sampling ratio compares), max and mean |difference|, float32 and bfloat16; and how
  much the trainer's own recomputation moves when the batch changes (each row alone vs the batch).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LogprobGap:
    """|rollout logprob - trainer logprob| over every completion token."""

    max_abs: float
    mean_abs: float
    tokens: int


def trainer_logprobs(trainer: Any, rollout: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's per-token logprobs of the rollout's completions, computed as GRPOTrainer computes
    them for the loss (prompts left-padded, completions right-padded, one batch, ``logits / temperature``).

    Returns:
        ``(logps (B, Lc) float32, mask (B, Lc) bool)`` on the CPU.
    """
    from trl.trainer.utils import pad

    pad_id = trainer._tokenizer.pad_token_id
    device = trainer.accelerator.device
    prompts = [torch.tensor(p) for p in rollout["prompt_ids"]]
    completions = [torch.tensor(c) for c in rollout["completion_ids"]]
    prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
    completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right").to(device)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, completion_ids.size(1))
    return logps.float().cpu(), completion_mask.bool().cpu()


def onpolicy_gap(trainer: Any, rollout: dict[str, list]) -> LogprobGap:
    """Max and mean |rollout logprob - trainer recomputation| over all completion tokens."""
    ref, mask = trainer_logprobs(trainer, rollout)
    got = torch.zeros_like(ref)
    for i, lps in enumerate(rollout["logprobs"]):
        got[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    diff = (got - ref).abs()[mask]
    if diff.numel() == 0:
        return LogprobGap(0.0, 0.0, 0)
    return LogprobGap(float(diff.max()), float(diff.mean()), int(diff.numel()))


def batch_composition_gap(trainer: Any, rollout: dict[str, list]) -> LogprobGap:
    """How much the trainer's own recomputation moves when a row is scored alone instead of in the batch."""
    batch, mask = trainer_logprobs(trainer, rollout)
    diffs = []
    for i in range(len(rollout["completion_ids"])):
        one = {k: [v[i]] for k, v in rollout.items()}
        alone, _ = trainer_logprobs(trainer, one)
        n = int(mask[i].sum())
        diffs.append((alone[0, :n] - batch[i, :n]).abs())
    diff = torch.cat(diffs) if diffs else torch.zeros(0)
    if diff.numel() == 0:
        return LogprobGap(0.0, 0.0, 0)
    return LogprobGap(float(diff.max()), float(diff.mean()), int(diff.numel()))


# ------------------------------------------------------------------------------------------- the bench
@dataclass(frozen=True)
class RLWorkload:
    prompts: int
    generations: int
    max_new: int
    repeats: int
    test_rounds: int  # extra rollouts of flashpage and TRL generate() for the distribution test


FULL = RLWorkload(prompts=8, generations=8, max_new=128, repeats=3, test_rounds=4)
QUICK = RLWorkload(prompts=4, generations=4, max_new=24, repeats=2, test_rounds=2)
PROMPTS = ["The function", "Return the", "If the value", "A list of", "This module", "When the", "Note that",
           "The default"]
SYSTEMS = ("flashpage", "flashpage_keep_kv", "trl_generate", "trl_continuous_batching")


def _log(msg: str) -> None:
    print(f"[bench rl] {msg}", file=sys.stderr, flush=True)


def _load(model_name: str | None, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    from flashpage.engine.loading import load_model

    return load_model(model_name, dtype=dtype, device=device)


def _trainer(model: Any, tok: Any, w: RLWorkload, system: str, out_dir: str, bf16: bool = False) -> Any:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from flashpage.integrations.trl import FlashpageRollout

    rollout = None
    if system.startswith("flashpage"):
        rollout = FlashpageRollout(release_kv=system == "flashpage")
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=w.prompts * w.generations,
                      num_generations=w.generations, max_completion_length=w.max_new, temperature=1.0, top_p=0.95,
                      report_to="none", use_cpu=not torch.cuda.is_available(), save_strategy="no", disable_tqdm=True,
                      bf16=bf16, seed=0, use_transformers_continuous_batching=system == "trl_continuous_batching",
                      transformers_continuous_batching_config=_cb_config(w) if system == "trl_continuous_batching"
                      else None)
    dataset = Dataset.from_dict({"prompt": PROMPTS[: w.prompts]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                           train_dataset=dataset, processing_class=tok, rollout_func=rollout)


def _cb_config(w: RLWorkload, page: int = 256, longest_prompt: int = 32) -> dict[str, Any]:
    """transformers' continuous batching sized for the workload (its default takes half of the machine's memory
    on CPU, TRL's default on GPU): every sample's pages at full length, as flashpage's pool."""
    rows = w.prompts * w.generations
    return {"num_blocks": rows * -(-(longest_prompt + w.max_new) // page) + 4}


@contextmanager
def _peak_memory(device: torch.device, into: dict[str, int]):
    """Peak bytes above the level at entry: CUDA allocated, or CPU resident set (Linux VmHWM)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)
        into["peak"] = torch.cuda.max_memory_allocated(device) - base
        return
    base = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        ok = True
    except OSError:
        ok = False
    yield
    into["peak"] = (_status_kib("VmHWM") - base) * 1024 if ok and base >= 0 else -1


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _generate(trainer: Any, batch: list[str]) -> tuple[list[list[int]], list[list[int]], float]:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer._generate(batch)
    return out[0], out[1], time.perf_counter() - start


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_homogeneity(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples of categories (rare ones pooled)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cats = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    cells: list[tuple[int, int]] = []
    other = [0, 0]
    for k in cats:
        if (ca[k] + cb[k]) * min(na, nb) / (na + nb) >= min_expected:
            cells.append((ca[k], cb[k]))
        else:
            other[0] += ca[k]
            other[1] += cb[k]
    if sum(other):
        cells.append((other[0], other[1]))
    if len(cells) < 2:
        return 0.0, 0
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def ks_two_sample(a: list[float], b: list[float]) -> tuple[float, float]:
    """Kolmogorov-Smirnov statistic and asymptotic p-value of two samples."""
    xa, xb = sorted(a), sorted(b)
    na, nb = len(xa), len(xb)
    i = j = 0
    d = 0.0
    while i < na and j < nb:
        v = min(xa[i], xb[j])
        while i < na and xa[i] <= v:
            i += 1
        while j < nb and xb[j] <= v:
            j += 1
        d = max(d, abs(i / na - j / nb))
    en = math.sqrt(na * nb / (na + nb))
    lam = (en + 0.12 + 0.11 / en) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


def distribution_test(trainer: Any, samples: dict[str, tuple[list[list[int]], list[list[int]]]]) -> dict[str, Any]:
    """flashpage vs trl_generate samples of the same prompts: first tokens (chi-square per prompt, summed)
    and mean per-token logprob under the trainer (KS)."""
    firsts: dict[str, dict[tuple[int, ...], list[int]]] = {}
    means: dict[str, list[float]] = {}
    for name, (prompt_ids, completion_ids) in samples.items():
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            if c:
                by_prompt.setdefault(tuple(p), []).append(c[0])
        firsts[name] = by_prompt
        keep = [i for i, c in enumerate(completion_ids) if c]
        rollout = {"prompt_ids": [prompt_ids[i] for i in keep], "completion_ids": [completion_ids[i] for i in keep],
                   "logprobs": [[] for _ in keep]}
        logps, mask = trainer_logprobs(trainer, rollout)
        means[name] = ((logps * mask).sum(1) / mask.sum(1)).tolist()
    stat, dof = 0.0, 0
    for prompt, a in firsts["flashpage"].items():
        s, d = chi2_homogeneity(a, firsts["trl_generate"].get(prompt, []))
        stat, dof = stat + s, dof + d
    ks_d, ks_p = ks_two_sample(means["flashpage"], means["trl_generate"])
    return {"first_token_chi2": stat, "first_token_dof": dof, "first_token_p": chi2_sf(stat, dof),
            "mean_logprob_ks": ks_d, "mean_logprob_p": ks_p,
            "samples": {k: len(v[1]) for k, v in samples.items()}}


def _onpolicy(model_name: str | None, device: str, w: RLWorkload, out_dir: str) -> dict[str, Any]:
    """Rollout logprobs vs the trainer's recomputation, float32 and bfloat16 (the model loaded in that dtype;
    bf16 also with TRL's cast_lm_head_to_fp32-equivalent: not applied here, reported as is)."""
    from flashpage.integrations.trl import FlashpageRollout

    out: dict[str, Any] = {}
    batch = [p for p in PROMPTS[: w.prompts] for _ in range(w.generations)]
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(0)
        model, tok = _load(model_name, dtype, device)
        trainer = _trainer(model, tok, w, "flashpage", out_dir)
        rollout = FlashpageRollout()
        res = rollout(batch, trainer)
        out[name] = {"rollout_vs_trainer": asdict(onpolicy_gap(trainer, res)),
                     "trainer_row_alone_vs_batch": asdict(batch_composition_gap(trainer, res))}
        _log(f"on-policy {name}: {out[name]}")
    return out


def run(model_name: str | None = None, quick: bool = False, systems: tuple[str, ...] = SYSTEMS,
        workload: RLWorkload | None = None) -> dict[str, Any]:
    """Run the bench; see the module docstring. Needs TRL >= 1.0. ``systems`` must include "flashpage"."""
    import tempfile

    from flashpage.integrations.trl import check_trl

    trl_version = check_trl()
    w = workload or (QUICK if quick else FULL)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = tempfile.mkdtemp(prefix="flashpage-bench-rl-")
    torch.manual_seed(0)
    model, tok = _load(model_name, torch.float32 if device == "cpu" else torch.bfloat16, device)
    trainers = {name: _trainer(model, tok, w, name, out_dir) for name in systems}
    batch = [p for p in PROMPTS[: w.prompts] for _ in range(w.generations)]
    seconds: dict[str, list[float]] = {n: [] for n in systems}
    tokens: dict[str, list[int]] = {n: [] for n in systems}
    peaks: dict[str, int] = {n: 0 for n in systems}
    samples: dict[str, tuple[list[list[int]], list[list[int]]]] = {n: ([], []) for n in systems}
    for name in systems:  # warm-up
        _log(f"warm-up {name}")
        _generate(trainers[name], batch[: w.generations])
    for r in range(w.repeats):
        order = systems[r % len(systems):] + systems[: r % len(systems)]
        for name in order:
            mem: dict[str, int] = {}
            with _peak_memory(torch.device(device), mem):
                p_ids, c_ids, sec = _generate(trainers[name], batch)
            seconds[name].append(sec)
            tokens[name].append(sum(len(c) for c in c_ids))
            peaks[name] = max(peaks[name], mem["peak"])
            samples[name][0].extend(p_ids)
            samples[name][1].extend(c_ids)
            _log(f"repeat {r + 1}/{w.repeats} {name}: {sec:.2f} s, {tokens[name][-1]} completion tokens")
    for _ in range(w.test_rounds):  # more samples for the distribution test (flashpage and TRL's default only)
        for name in ("flashpage", "trl_generate"):
            if name in systems:
                p_ids, c_ids, _ = _generate(trainers[name], batch)
                samples[name][0].extend(p_ids)
                samples[name][1].extend(c_ids)
    result: dict[str, Any] = {
        "model": model_name or "flashpage-tiny", "device": device, "dtype": str(next(model.parameters()).dtype),
        "trl": trl_version, "threads": torch.get_num_threads(), "quick": quick, "workload": asdict(w),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "systems": {}, "memory_method": "cuda max_memory_allocated" if device == "cuda" else "VmHWM - VmRSS",
    }
    for name in systems:
        sec = sorted(seconds[name])[len(seconds[name]) // 2]
        result["systems"][name] = {"seconds_median": sec, "seconds": seconds[name],
                                   "completion_tokens_per_s": sum(tokens[name]) / sum(seconds[name]),
                                   "mean_completion_tokens": sum(tokens[name]) / len(tokens[name]),
                                   "peak_memory_bytes": peaks[name]}
    fp = result["systems"]["flashpage"]["seconds_median"]
    result["speedup"] = {n: result["systems"][n]["seconds_median"] / fp for n in systems if n != "flashpage"}
    if "trl_generate" in systems:
        result["distribution"] = distribution_test(trainers["flashpage"], {n: samples[n] for n in
                                                                           ("flashpage", "trl_generate")})
        _log(f"distribution test: {result['distribution']}")
    result["onpolicy"] = _onpolicy(model_name, device, w, out_dir)
    dist = result.get("distribution", {})
    result["outputs_agree"] = bool(min(dist.get("first_token_p", 1.0), dist.get("mean_logprob_p", 1.0)) > 1e-3
                                   and result["onpolicy"]["float32"]["rollout_vs_trainer"]["max_abs"] <= 1e-4)
    return result


def _mib(n: int) -> str:
    return "n/a" if n < 0 else f"{n / 2**20:.1f} MiB"


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    w = result["workload"]
    lines = [f"bench rl: {result['model']} ({result['dtype']}, {result['device']}, {result['threads']} threads, "
             f"load avg {result['load_average_1m']}, trl {result['trl']}{', quick' if result['quick'] else ''})",
             f"one GRPO step's generation: {w['prompts']} prompts x {w['generations']} generations, completions up "
             f"to {w['max_new']} tokens, temperature 1, top_p 0.95; median of {w['repeats']} alternating repeats",
             "", f"{'system':<26}{'s/step':>9}{'tok/s':>9}{'mean len':>10}{'peak memory':>14}{'flashpage faster':>18}"]
    for name, s in result["systems"].items():
        speed = f"{result['speedup'][name]:.2f}x" if name in result["speedup"] else "-"
        lines.append(f"{name:<26}{s['seconds_median']:>9.2f}{s['completion_tokens_per_s']:>9.1f}"
                     f"{s['mean_completion_tokens'] / w['prompts'] / w['generations']:>10.1f}"
                     f"{_mib(s['peak_memory_bytes']):>14}{speed:>18}")
    lines.append(f"(peak memory: {result['memory_method']}, during the generation)")
    d = result.get("distribution")
    if d:
        lines += ["", f"same sampling distribution as TRL generate() ({d['samples']} samples): first token chi2 "
                      f"{d['first_token_chi2']:.1f} on {d['first_token_dof']} dof, p = {d['first_token_p']:.3f}; "
                      f"mean logprob KS D = {d['mean_logprob_ks']:.3f}, p = {d['mean_logprob_p']:.3f}"]
    lines.append("")
    for name, o in result["onpolicy"].items():
        g, b = o["rollout_vs_trainer"], o["trainer_row_alone_vs_batch"]
        lines.append(f"on-policy {name}: rollout vs trainer logprobs max |diff| {g['max_abs']:.2e}, mean "
                     f"{g['mean_abs']:.2e} ({g['tokens']} tokens); the trainer itself, row alone vs batch: max "
                     f"{b['max_abs']:.2e}, mean {b['mean_abs']:.2e}")
    return "\n".join(lines)
