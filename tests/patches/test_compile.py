"""GPU-readiness on CPU: a patched model's forward compiles with ``torch.compile(fullgraph=True)``.

``fullgraph=True`` fails on any graph break, and a graph break is what a data-dependent host read
(``.tolist()``, ``.item()``, ``bool(tensor)``) in the layer loop would cause; zero recompiles over
warm decode steps is what CUDA graphs need (static shapes). Outputs must equal eager flashpage and
unpatched transformers token for token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import flashpage

NEW_TOKENS = 40  # decode steps per generate(): 39 warm steps after the first


@pytest.fixture()
def model() -> Iterator[torch.nn.Module]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.compiler.reset()
    yield LlamaForCausalLM(cfg).eval()
    torch.compiler.reset()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: the kvcache path with bottom-right alignment
    mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model: torch.nn.Module, **kw) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(**_batch(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kw)


def test_patched_forward_compiles_fullgraph_without_recompiles(model: torch.nn.Module) -> None:
    reference = _generate(model)
    flashpage.patch(model)
    eager = _generate(model)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    counters.clear()
    compiled = _generate(model)  # prefill graph + decode graph, then NEW_TOKENS - 2 warm decode steps
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"expected one prefill and one decode graph, got {graphs}"
    assert not counters["recompiles"], dict(counters["recompiles"])
    again = _generate(model)  # a second call with the same shapes reuses both graphs
    assert counters["stats"]["unique_graphs"] == graphs, "the warm compiled forward recompiled"
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert torch.equal(eager, reference)
    assert torch.equal(compiled, reference)
    assert torch.equal(again, reference)


def test_transformers_compiled_static_cache_generate_on_patched_model(model: torch.nn.Module) -> None:
    """transformers' own auto-compile path (static cache, CompileConfig(fullgraph=True)) through
    flashpage's attention and mask functions: what its test_generate_compile_model_forward_fullgraph runs."""
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    kw = {"cache_implementation": "static", "compile_config": config}
    reference = _generate(model, **kw)
    torch.compiler.reset()
    flashpage.patch(model)
    counters.clear()
    out = _generate(model, **kw)
    assert hasattr(model, "_compiled_call")
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(out, reference)


def _engine_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 9, 30, 70)]


def _reference(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_llm_compiled_steps_of_every_kind(model: torch.nn.Module) -> None:
    """LLM(compile=True) on CPU: prefill, chunked-prefill + decode (mixed) and decode-only steps all
    run through ONE compiled graph (fullgraph, T dynamic, attention and store opaque); no recompile
    when warm; tokens equal to eager LLM and to transformers' generate()."""
    from flashpage import LLM, SamplingParams

    prompts = _engine_prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reference = _reference(model, prompts, NEW_TOKENS)
    kw = {"num_blocks": 64, "max_num_batched_tokens": 32, "enable_prefix_caching": False}  # the 70-token prompt chunks
    eager = [o.token_ids for o in LLM(model, compile=False, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, compile=True, **kw)
    counters.clear()
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.stats()
    assert stats.compiled_steps == stats.steps  # every step ran compiled
    step = llm._compiled_step
    assert set(step.kinds) == {"prefill", "mixed", "decode"}, dict(step.kinds)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(step.shapes) > 3  # many step sizes, one graph
    second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert counters["stats"]["unique_graphs"] == 1, "the warm compiled step recompiled"
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert first == second == eager == reference


def test_llm_compiled_steps_sliding_window_and_softcap() -> None:
    """Gemma 2 (sliding-window layers, attention softcap, its own norms): the layer options reach the
    packed attention op, tokens equal generate(). transformers' sliding mask code branches on T
    against the window, so T splits into two ranges: at most two graphs, none added when warm."""
    from model_zoo import tiny_model

    from flashpage import LLM, SamplingParams

    torch.compiler.reset()
    model = tiny_model("gemma2").eval()  # sliding_window 8, attn_logit_softcapping 5.0
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 9, 30)]
    reference = _reference(model, prompts, 12)
    llm = LLM(model, num_blocks=64, block_size=4, compile=True, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    counters.clear()
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = counters["stats"]["unique_graphs"]
    assert llm.stats().compiled_steps == llm.stats().steps and set(llm._compiled_step.kinds) == {
        "prefill", "mixed", "decode"}
    assert 1 <= graphs <= 2
    second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert counters["stats"]["unique_graphs"] == graphs, "the warm compiled step recompiled"
    assert first == second == reference
    torch.compiler.reset()


def test_llm_compiled_step_follows_weight_updates(model: torch.nn.Module) -> None:
    """Weights are graph inputs, never frozen: after an in-place update (what an RL trainer's
    optimizer or load_state_dict does) the compiled step computes with the new weights, without
    recompiling, and its tokens equal generate() of the updated model."""
    from flashpage import LLM, SamplingParams

    prompts = _engine_prompts()[:3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected_before = _reference(model, prompts, 8)
    torch.manual_seed(5)
    other = LlamaForCausalLM(model.config).eval()  # the updated weights (unpatched: the oracle)
    expected_after = _reference(other, prompts, 8)
    llm = LLM(model, num_blocks=64, compile=True)
    before = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert before == expected_before
    model.load_state_dict(other.state_dict())  # copy_ into the same tensors
    counters.clear()
    after = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert llm.stats().compiled_steps == llm.stats().steps
    assert after == expected_after
    assert after != before  # the update changed the tokens, so the check above could fail
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert llm._prepack.state == "packed" and len(llm._prepack.compiled_table()) == len(linears)  # repacked weights


def test_layer_ops_pass_opcheck() -> None:
    """flashpage::attend and flashpage::store: schemas, fake kernels and mutation annotations agree
    with what the ops do (what torch.compile relies on)."""
    from flashpage.kernels import paged

    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    table = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    seqlens = torch.tensor([6, 9], dtype=torch.int32)
    qh = torch.randn(2, 4, 3, 8, generator=g)
    torch.library.opcheck(paged.attend_op, (qh, k_pages, v_pages, table, seqlens, -1.0, True, -1, -1, 0.0, None, True))
    torch.library.opcheck(paged.store_op, (k_pages, v_pages, torch.randn(3, 2, 8, generator=g),
                                           torch.randn(3, 2, 8, generator=g), torch.tensor([5, -1, 9]), False))
    out = paged.attend_op(qh, k_pages, v_pages, table, seqlens, -1.0, True, -1, -1, 0.0, None, True)
    ref = paged.attend_static(qh, k_pages, v_pages, table, seqlens, paged.LayerOptions())
    assert torch.allclose(out, ref, atol=1e-6)


def test_packed_step_ops_pass_opcheck() -> None:
    """flashpage::attend_packed (the packed step's attention, through the current step) and
    flashpage::onednn_linear: schemas and fake kernels agree with what they compute; padding rows
    of the packed query come back as zeros, the real ones as the eager step's attention."""
    from flashpage.engine.linears import onednn_available, onednn_linear_op
    from flashpage.kernels import packed, paged
    from flashpage.plan import build_plan

    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    plan = build_plan(["a", "b"], [3, 1], [2, 5], [[3, 1], [5, 2]], block_size=4)  # a prefill chunk and a decode
    step = plan.to("cpu")
    q = torch.randn(6, 4, 8, generator=g)  # 4 real tokens, 2 padding rows
    args = (q, k_pages, v_pages, -1.0, True, -1, -1, 0.0, None, None, 0)
    with packed.current_step(step):
        torch.library.opcheck(packed.attend_packed_op, args)
        out = packed.attend_packed_op(*args)
    ref = step.attend(q[:4].transpose(0, 1).unsqueeze(0), k_pages, v_pages, paged.LayerOptions())
    assert torch.equal(out[:4], ref[0])
    assert not out[4:].any()
    with pytest.raises(RuntimeError, match="current_step"):
        packed.attend_packed_op(*args)
    if onednn_available():
        x, w, b = torch.randn(1, 5, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
        torch.library.opcheck(onednn_linear_op, (x, w, b))
        assert torch.allclose(onednn_linear_op(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
