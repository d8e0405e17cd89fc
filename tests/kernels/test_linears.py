"""oneDNN linears in the engine: used only inside an engine step on its own thread, F.linear (bit for bit
the unpatched model) everywhere else, the switch to turn them off, and LLM tokens still transformers'."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_matches_hf, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.engine import linears
from flashpage.patches import unpatch

pytestmark = pytest.mark.skipif(not linears.onednn_available(), reason="this torch has no oneDNN linear")


def _layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    holder = torch.nn.Sequential(layer)
    assert linears.install_onednn_linears(holder) == 1
    assert linears.install_onednn_linears(holder) == 1  # idempotent
    return layer


def test_scoped_to_the_engine_step_and_its_thread():
    layer = _layer()
    x = torch.randn(2, 7, 64)
    plain = F.linear(x, layer.weight, layer.bias)
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
    assert torch.equal(layer(x), plain)
    seen: list[torch.Tensor] = []
    with linears.onednn_scope():
        assert torch.equal(layer(x), onednn)
        other = threading.Thread(target=lambda: seen.append(layer(x)))
        other.start()
        other.join()
        with linears.onednn_scope(False):
            assert torch.equal(layer(x), onednn)  # an inner disabled scope leaves the outer one on
    assert torch.equal(seen[0], plain), "another thread is not in the engine's scope"
    assert torch.equal(layer(x), plain)
    assert torch.allclose(onednn, plain, atol=1e-5, rtol=1e-5)


def test_few_rows_skip_onednn_inside_the_scope(monkeypatch):
    """A step of at most SMALL_ROWS rows (decodes of one to four sequences) takes the C++ small-M kernel once the
    fused ops are loaded, else F.linear for one row (MKL's GEMV); more rows take oneDNN (README, Against vLLM)."""
    from flashpage.kernels import cpu_fused

    layer = _layer()
    few, one = torch.randn(1, linears.SMALL_ROWS, 64), torch.randn(1, 1, 64)
    many = torch.randn(1, linears.SMALL_ROWS + 1, 64)
    monkeypatch.setattr(cpu_fused, "loaded", lambda: None)
    with linears.onednn_scope():
        assert torch.equal(layer(one), F.linear(one, layer.weight, layer.bias))
        assert torch.equal(layer(few), torch.ops.mkldnn._linear_pointwise(few, layer.weight, layer.bias, "none",
                                                                           [], ""))
    monkeypatch.undo()
    ops = cpu_fused.load()
    if ops is None:
        pytest.skip("no C++ compiler here: the small-M kernel is not built")
    with linears.onednn_scope():
        assert torch.equal(layer(few), ops.small_linear(few, layer.weight, layer.bias))
        assert torch.equal(layer(one), ops.small_linear(one, layer.weight, layer.bias))
        assert torch.equal(layer(many), torch.ops.mkldnn._linear_pointwise(many, layer.weight, layer.bias, "none",
                                                                            [], ""))
    assert torch.allclose(ops.small_linear(few, layer.weight, layer.bias), F.linear(few, layer.weight, layer.bias),
                          atol=1e-5, rtol=1e-5)


def test_switch_off_and_ineligible_layers(monkeypatch):
    monkeypatch.setenv(linears.ENV, "torch")
    assert linears.install_onednn_linears(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
    monkeypatch.delenv(linears.ENV)
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 4))
    mixed[1].forward = lambda x: x  # someone else's override is left alone
    assert linears.install_onednn_linears(mixed) == 0


def test_llm_installs_them_and_the_model_outside_is_unchanged(model):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    llm = LLM(model, max_num_seqs=4)
    try:
        assert llm._onednn
        assert llm._prepack is not None and llm._prepack.state == "probe"  # packs after its first step
        prompts = random_prompts(3, 5, 40, seed=3)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert_matches_hf(model, prompts, [o.outputs[0] for o in outs], 8, eos=False)
        assert llm._prepack.state == "packed", llm._prepack.reason
    finally:
        unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before), "outside the engine: F.linear, bit for bit"


def test_info_reports_threads_and_linears(monkeypatch):
    from flashpage.info import collect_info, format_info

    info = collect_info()
    assert info["cpu_threads"]["torch_threads"] == torch.get_num_threads()
    assert info["cpu_threads"]["usable_cores"] >= 1
    assert "CPU threads:" in format_info(info) and "oneDNN in LLM steps" in format_info(info)
    assert "siblings fused when the copies fit" in format_info(info)
    monkeypatch.setenv(linears.PREPACK_ENV, "0")
    assert "weights not packed (FLASHPAGE_CPU_PREPACK=0)" in collect_info()["cpu_threads"]["cpu_linears"]
    monkeypatch.setenv(linears.ENV, "torch")
    assert "F.linear" in collect_info()["cpu_threads"]["cpu_linears"]
