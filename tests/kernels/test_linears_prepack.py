"""Packed and fused oneDNN weights in the engine (engine/linears.py ``Prepacked``): siblings found by a
probe (same input tensor object, same parent), fused outputs equal to the separate calls, fallback when
the input is not the one expected, repacking of exactly what changed, the memory policy, and LLM tokens
and logprobs still those of transformers / the unpacked engine."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_matches_hf, random_prompts
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams
from flashpage.engine import linears
from flashpage.patches import unpatch

pytestmark = [pytest.mark.skipif(not linears.onednn_available(), reason="this torch has no oneDNN linear"),
              pytest.mark.usefixtures("one_thread")]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


class _Block(torch.nn.Module):
    """a, b, c read the same x (siblings); d reads a's output; ``mode`` varies what b and c read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False)
        self.c, self.d = torch.nn.Linear(16, 6), torch.nn.Linear(8, 5)
        self.e = torch.nn.Linear(16, 3)  # called only in mode "late" (an expert the probe step did not route to)
        self.mode = "siblings"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ya = self.a(x)
        if self.mode == "in_place":
            x.mul_(2.0)  # same tensor object, other values: not siblings
        yb = self.b(x + 1.0 if self.mode == "other_input" else x)
        yc = self.c(x)
        late = [self.e(x)] if self.mode == "late" else []
        return torch.cat([self.d(ya), yb, yc, *late], -1)


def _run(block: _Block, packs: linears.Prepacked, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), linears.onednn_scope(True, packs):
        return block(x.clone())


def _reference(block: _Block, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return block(x.clone())  # outside the scope: F.linear


def test_probe_fuses_siblings_and_falls_back_on_another_input():
    torch.manual_seed(0)
    block = _Block()
    assert linears.install_onednn_linears(block) == 5
    packs = linears.Prepacked(block, True)
    x = torch.randn(1, 7, 16)
    first = _run(block, packs, x)  # the probe step: unpacked
    assert packs.state == "packed"
    assert packs.fused() == [(block.a, block.b, block.c)]
    assert {g.members for g in packs.gemms if len(g.members) == 1} == {(block.d,), (block.e,)}
    fused = packs.gemms[0]
    assert fused.sizes == (8, 4, 6) and fused.bias[8:12].abs().sum() == 0  # b has no bias: zeros stacked
    ref = _reference(block, x)
    for mode in ("siblings", "other_input", "late"):
        block.mode = mode
        got = _run(block, packs, x)
        assert torch.allclose(got, _reference(block, x), atol=1e-5, rtol=1e-5), mode
    assert torch.allclose(first, ref, atol=1e-5, rtol=1e-5)
    assert packs._pending is None  # nothing kept past the step


def test_probe_does_not_fuse_an_input_written_in_place():
    block = _Block()
    block.mode = "in_place"
    linears.install_onednn_linears(block)
    packs = linears.Prepacked(block, True)
    _run(block, packs, torch.randn(3, 16))
    assert packs.fused() == [(block.b, block.c)]  # a saw x before it was doubled


def test_repack_only_what_changed_then_everything_after_an_optimizer_step():
    block = _Block()
    linears.install_onednn_linears(block)
    packs = linears.Prepacked(block, True)
    x = torch.randn(5, 16)
    _run(block, packs, x)
    before = {g.members: g.weight for g in packs.gemms}
    with torch.no_grad():
        block.d.weight.add_(1.0)
    assert packs.refresh() == 1
    assert [g.members for g in packs.gemms if g.weight is not before[g.members]] == [(block.d,)]
    assert torch.allclose(_run(block, packs, x), _reference(block, x), atol=1e-5, rtol=1e-5)
    block.b.weight = torch.nn.Parameter(torch.randn(4, 16))  # a new tensor: its group is repacked
    assert packs.refresh() == 1
    assert torch.allclose(_run(block, packs, x), _reference(block, x), atol=1e-5, rtol=1e-5)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    for p in block.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # counted by the global hook: every GEMM repacked
    assert packs.refresh() == len(packs.gemms)
    assert torch.allclose(_run(block, packs, x), _reference(block, x), atol=1e-5, rtol=1e-5)


def test_memory_policy_and_bad_values(monkeypatch):
    monkeypatch.delenv(linears.PREPACK_ENV, raising=False)
    avail = linears.available_memory()
    assert avail is not None and avail > 0
    assert linears.prepack_wanted("auto", 1 << 20)[0]
    assert not linears.prepack_wanted("auto", avail)[0]  # all of memory: more than the 25% share
    assert linears.prepack_wanted(True, 1 << 60)[0] and not linears.prepack_wanted(False, 1)[0]
    monkeypatch.setenv(linears.PREPACK_ENV, "0")
    assert linears.prepack_wanted("auto", 1) == (False, f"{linears.PREPACK_ENV}=0")
    assert linears.prepack_wanted(True, 1)[0]  # an explicit choice wins over the environment
    with pytest.raises(ValueError, match="cpu_prepack='yes'.*'auto', True or False"):
        LLM(tiny_model("llama", seed=5), cpu_prepack="yes")


def test_llm_packed_matches_unpacked_and_follows_weight_changes():
    model = tiny_model("llama", seed=7, max_position_embeddings=512)
    prompts = random_prompts(4, 5, 40, seed=11)
    packed = LLM(model, max_num_seqs=4, cpu_prepack=True)
    try:
        outs = packed.generate(prompts, GREEDY, use_tqdm=False)
        layer = model.model.layers[0]
        assert (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) in packed._prepack.fused()
        assert (layer.mlp.gate_proj, layer.mlp.up_proj) in packed._prepack.fused()
        assert packed._prepack.nbytes() == sum(m.weight.numel() * 4 for m in model.modules()
                                               if isinstance(m, torch.nn.Linear))
        _same_as_unpacked(model, prompts, outs)
        with torch.no_grad():  # in place between two generate() calls (an RL update)
            layer.self_attn.k_proj.weight.mul_(1.5)
            model.lm_head.weight.add_(0.01)
        outs = packed.generate(prompts, GREEDY, use_tqdm=False)
        _same_as_unpacked(model, prompts, outs)
    finally:
        unpatch(model)
    assert_matches_hf(model, prompts, [o.outputs[0] for o in outs], GREEDY.max_tokens, eos=False)


def _same_as_unpacked(model: torch.nn.Module, prompts: list[list[int]], outs: list) -> None:
    """A fresh LLM without packing on the model as it is now: same tokens, logprobs within 1e-5."""
    plain = LLM(model, max_num_seqs=4, cpu_prepack=False)
    try:
        ref = plain.generate(prompts, GREEDY, use_tqdm=False)
        assert plain._prepack.state == "off"
    finally:
        unpatch(model)
    for got, want in zip(outs, ref, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert a.top.keys() == b.top.keys() and all(abs(a.top[k] - b.top[k]) < 1e-5 for k in a.top)


def test_bench_linears_runs_and_its_variants_agree(capsys):
    from flashpage.bench import linears as bench

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 32, generator=gen) for n in (16, 8, 8)]
    assert bench.check_equal(weights, torch.randn(1, 5, 32, generator=gen)) < 1e-4
    row = bench.measure("q/k/v", 4, repeats=1)
    assert min(row.plain_us, row.packed_us, row.fused_us) > 0
    assert bench.main(["--rows", "2", "--groups", "o", "--repeats", "1"]) == 0
    assert "packed/plain" in capsys.readouterr().out
    model = tiny_model("llama", seed=2)
    runs = [bench.engine_run(model, "w", [[5, 6, 7], [8, 9]], [3, 4], mode) for mode in bench.MODES]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens and runs[0].cpu_s > 0
    cost = bench.pack_cost(model)
    assert cost["fused"] == 2 * model.config.num_hidden_layers and cost["repacked_after_one_edit"] == 1


def test_a_first_step_of_few_rows_still_probes():
    """A first step of at most SMALL_ROWS rows runs the small-M kernel, not the packs; its probe still records
    the siblings, so the engine packs after its first step whatever its size (and its flat step can verify)."""
    from flashpage.kernels import cpu_fused

    if cpu_fused.load() is None:
        pytest.skip("no C++ compiler here: few-row steps take oneDNN, which the probe sees anyway")
    block = _Block()
    linears.install_onednn_linears(block)
    packs = linears.Prepacked(block, True)
    x = torch.randn(1, linears.SMALL_ROWS, 16)
    got = _run(block, packs, x)
    assert packs.state == "packed" and packs.fused() == [(block.a, block.b, block.c)]
    assert torch.allclose(got, _reference(block, x), atol=1e-5, rtol=1e-5)
