"""`flashpage bench breakdown`: self times go to the innermost label, Python is the rest of the wall time,
the labelled regions catch the real model's parts and are all undone."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashpage import LLM, SamplingParams
from flashpage.bench import breakdown
from flashpage.patches import unpatch


@dataclass
class _Evt:
    name: str
    self_cpu_time_total: float
    cpu_parent: _Evt | None = None


def test_attribute_uses_the_innermost_label():
    step = _Evt("fp::schedule", 1.0)
    lin = _Evt("fp::linear", 2.0)
    mlp = _Evt("fp::act", 3.0)
    lin_in_mlp = _Evt("fp::linear", 0.0, mlp)
    events = [step, lin, mlp, lin_in_mlp, _Evt("aten::mm", 40.0, lin_in_mlp), _Evt("aten::silu", 5.0, mlp),
              _Evt("aten::index", 7.0, step), _Evt("aten::add", 11.0), _Evt("aten::copy_", 3.0, _Evt("x", 0.0, lin))]
    got = breakdown.attribute(events, wall_us=100.0)
    assert got["linears"] == 43.0 and got["norms/rotary/activations"] == 5.0
    assert got["scheduler + inputs"] == 7.0 and got["other ops"] == 11.0 and got["python"] == 34.0


def test_labelled_regions_see_every_part_and_are_undone(model):
    llm = LLM(model, max_num_seqs=4)
    try:
        before = {name: "forward" in vars(m) for name, m in model.named_modules()}
        sampler = llm.sampler
        with breakdown.labelled_regions(llm), torch.profiler.profile() as prof:
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        names = {e.name for e in prof.events()}
        assert {"fp::linear", "fp::attention", "fp::norm", "fp::act", "fp::sampler", "fp::schedule"} <= names
        assert {name: "forward" in vars(m) for name, m in model.named_modules()} == before
        assert llm.sampler is sampler and "schedule" not in vars(llm.scheduler) and "plan" not in vars(llm.kv)
    finally:
        unpatch(model)


def test_labelled_regions_label_the_flat_eager_step(model):
    """The flat step binds module forwards when built: the breakdown rebuilds it on the labelled ones, so
    its linears, norms and attention are not counted as 'other ops'; the engine's own flat step comes back."""
    llm = LLM(model, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # its second step verifies the flat step
        flat, flat_steps = llm._flat, llm.stats().flat_steps
        assert flat is not None and flat.usable() and flat_steps > 0, llm.flat_step
        with breakdown.labelled_regions(llm), torch.profiler.profile() as prof:
            start = time.perf_counter()
            llm.generate([[9, 10, 11, 12, 13]], params, use_tqdm=False)
            wall_us = (time.perf_counter() - start) * 1e6
        assert llm.stats().flat_steps >= flat_steps + 3 and llm._flat is flat
        names = {e.name for e in prof.events()}
        assert {"fp::linear", "fp::attention", "fp::norm", "fp::rotary", "fp::act"} <= names
        totals = breakdown.attribute(prof.events(), wall_us)
        assert totals["linears"] > totals["other ops"] and totals["attention"] > 0
    finally:
        unpatch(model)


def test_vllm_categories_count_the_lm_head_as_a_linear():
    """vLLM computes logits after its model's forward (compute_logits): that GEMM is a linear, not 'other ops'."""
    from flashpage.bench import vllm_runner

    assert vllm_runner._category("_C::onednn_mm", None) == "linears"
    assert vllm_runner._category("_C::onednn_mm", "vl::model") == "linears"
    assert vllm_runner._category("_C::cpu_attention_with_kv_cache", "vl::model") == "attention"
    assert vllm_runner._category("aten::index", None) == "other ops"
    assert vllm_runner._category("aten::argmax", "vl::sampler") == "sampler"
