"""The engine's fused norms / rotary / gated MLPs (flashpage/engine/fastpath.py): a probe decides which
modules get them, they act only inside the engine's scope on its thread (bit for bit the module's own
code elsewhere), ``FLASHPAGE_FASTPATH=0`` turns them off, and LLM's greedy tokens and logprobs still
equal transformers' generate() for the families that take them."""

from __future__ import annotations

import dataclasses
import sys
import threading
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import hf_greedy, random_prompts
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams
from flashpage.engine import fastpath
from flashpage.kernels import cpu_fused
from flashpage.patches import unpatch
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def _norm(model_type: str) -> torch.nn.Module:
    norm = tiny_model(model_type).model.norm
    with torch.no_grad():
        norm.weight.normal_()  # not the init's ones/zeros: the offset must matter
    return norm


@pytest.mark.parametrize(("model_type", "offset", "centred"), [("llama", 0.0, False), ("gemma", 1.0, False),
                                                                 ("cohere", 0.0, True)])
def test_probe_finds_each_norm_form_and_the_scope_confines_it(model_type, offset, centred):
    norm = _norm(model_type)
    fused = fastpath.probe_norm(norm)
    assert fused is not None and (fused.offset, fused.centred) == (offset, centred)
    holder = torch.nn.Sequential(norm)
    assert fastpath.install_fastpath(holder).norms == 1
    assert fastpath.install_fastpath(holder).norms == 1  # idempotent
    x = torch.randn(2, 5, norm.weight.shape[0]) * 3
    own = type(norm).forward(norm, x)
    assert torch.equal(norm(x), own), "outside the scope: the module's own forward"
    seen: list[torch.Tensor] = []
    with fastpath.fastpath_scope():
        inside = norm(x)
        worker = threading.Thread(target=lambda: seen.append(norm(x)))
        worker.start()
        worker.join()
        assert torch.equal(norm(x.double()).float(), type(norm).forward(norm, x.double()).float()), \
            "float64 is not fused"
    assert torch.equal(seen[0], own), "another thread is not in the engine's scope"
    assert torch.allclose(inside, own, atol=1e-5, rtol=1e-5)
    assert not torch.equal(inside, F.rms_norm(x, x.shape[-1:], None, fused.eps)), "the weight is applied"


class _ShiftedNorm(torch.nn.Module):
    """Looks like an RMSNorm (1-D weight, eps) but adds a shift: no fused form computes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps) + 0.01


def test_probe_refuses_what_it_cannot_reproduce_and_the_switch_turns_it_off(monkeypatch):
    assert fastpath.probe_norm(_ShiftedNorm(16)) is None
    assert fastpath.probe_norm(torch.nn.LayerNorm(16)) is None  # already one op
    from flashpage.info import collect_info, format_info

    assert "LLM eager steps: fused norms" in format_info(collect_info())
    model = tiny_model("llama")
    monkeypatch.setenv(fastpath.ENV, "0")
    assert not fastpath.install_fastpath(model).any
    assert "forward" not in vars(model.model.norm)
    assert "FLASHPAGE_FASTPATH=0" in collect_info()["cpu_threads"]["eager_fastpath"]


def test_rotary_dispatch_is_the_original_outside_and_refuses_other_rotations():
    model = tiny_model("phi3")  # its apply_rotary_pos_emb also rotates a leading part (partial rotary)
    assert fastpath.install_fastpath(model).rotary
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    dispatch = module.apply_rotary_pos_emb
    original = dispatch.__wrapped__
    q, k = torch.randn(1, 6, 4, 16).transpose(1, 2), torch.randn(1, 6, 2, 16).transpose(1, 2)  # (B, H, L, D)
    cos, sin = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    want = original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(dispatch(q, k, cos, sin), want, strict=True))
    with fastpath.fastpath_scope():
        got = dispatch(q, k, cos, sin)
        again = dispatch(q, k, cos, sin)  # the step's sin table reused
        partial = dispatch(q, k, cos[..., :8], sin[..., :8])  # not full width: the original's own code
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(partial, original(q, k, cos[..., :8], sin[..., :8]), strict=True))
    assert fastpath._STATE.rotary is None, "the step's tables are dropped at the scope's end"

    def interleaved(q, k, cos, sin):  # GPT-J style rotation: not the half-rotation the fused form computes
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)
    assert not fastpath._probe_rotary(interleaved)


def test_rotary_dispatch_passes_other_call_forms_to_the_original():
    """A rotary function with optional k (Qwen4-Exp's indexer rotates its query alone: ``f(q, cos=c, sin=s)``)
    keeps working once the dispatch replaces it, inside the engine's scope and outside (the dispatch replaces the
    modeling module's function for the whole process)."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

    def optional_k(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        q_out = q * cos + rotate_half(q) * sin
        return q_out if k is None else (q_out, k * cos + rotate_half(k) * sin)

    assert fastpath._probe_rotary(optional_k)
    dispatch = fastpath._rotary_dispatch(optional_k, cpp=False)
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    cos, sin = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    for scope in (fastpath.fastpath_scope, mock.MagicMock):
        with scope():
            assert torch.equal(dispatch(q, cos=cos, sin=sin), optional_k(q, cos=cos, sin=sin))
            assert torch.equal(dispatch(q, None, cos, sin), optional_k(q, None, cos, sin))
            both = dispatch(q, k, cos, sin)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(both, optional_k(q, k, cos, sin), strict=True))


def test_gated_mlp_probe_and_in_place_product():
    mlp = tiny_model("gemma").model.layers[0].mlp
    children = dict(mlp.named_children())
    assert fastpath.probe_mlp(mlp).act == "gelu_tanh"
    assert dict(mlp.named_children()) == children, "the probe works on narrowed copies, never on the MLP itself"
    fastpath.install_fastpath(torch.nn.Sequential(mlp))
    x = torch.randn(3, 7, mlp.gate_proj.in_features)
    own = type(mlp).forward(mlp, x)
    with torch.inference_mode(), fastpath.fastpath_scope():
        inside = mlp(x)
    assert torch.equal(mlp(x), own)
    assert torch.allclose(inside, own, atol=1e-5, rtol=1e-5)


def test_packed_gate_up_mlp_probe_and_forms():
    mlp = tiny_model("phi3").model.layers[0].mlp  # gate_up_proj, chunk(2), up * activation_fn(gate)
    fused = fastpath.probe_mlp(mlp)
    assert fused is not None and fused.packed and fused.act == "silu"
    assert fused.cpp == (cpu_fused.status().name == "cpp")
    fastpath.install_fastpath(torch.nn.Sequential(mlp))
    x = torch.randn(3, 7, mlp.gate_up_proj.in_features)
    own = type(mlp).forward(mlp, x)
    for mode in ("torch", "1"):
        with mock.patch.dict("os.environ", {fastpath.ENV: mode}), torch.inference_mode(), fastpath.fastpath_scope():
            assert torch.allclose(mlp(x), own, atol=1e-5, rtol=1e-5), mode
    assert fastpath.probe_mlp(_UpFirst(mlp)) is None


class _UpFirst(torch.nn.Module):
    """A gate_up_proj MLP whose first half is the up projection: not the packed form's order."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = mlp.gate_up_proj, mlp.down_proj, mlp.activation_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def test_silu_in_place_never_writes_into_a_view():
    mlp = tiny_model("llama").model.layers[0].mlp
    assert fastpath.probe_mlp(mlp).act == "silu"
    fastpath.install_fastpath(torch.nn.Sequential(mlp))
    x = torch.randn(2, 5, mlp.gate_proj.in_features)
    own = type(mlp).forward(mlp, x)
    kept: list[torch.Tensor] = []
    plain = mlp.gate_proj.forward

    def fused_output_view(t):  # as a fused gate|up GEMM would hand back its gate half
        both = torch.cat([plain(t), plain(t)], dim=-1)
        kept.append(both.clone())
        kept.append(both)
        return both[..., :mlp.gate_proj.out_features]
    mlp.gate_proj.forward = fused_output_view
    with torch.inference_mode(), fastpath.fastpath_scope():
        inside = mlp(x)
    assert torch.equal(kept[0], kept[1]), "the other tensor's memory is untouched"
    assert torch.allclose(inside, own, atol=1e-5, rtol=1e-5)


FAMILIES = ["llama", "qwen3", "gemma", "gemma2", "gemma3_text", "mistral", "phi3", "olmo2", "cohere", "gpt_neox"]
NO_GATED_MLP = {"gpt_neox"}  # fc -> gelu -> fc (phi3's one gate_up_proj is a gated MLP)
CPP = cpu_fused.status().name == "cpp"
# every family with the C++ ops where they build (the default), and a few on the torch forms (the A/B switch)
CASES = [(m, "cpp" if CPP else "torch") for m in FAMILIES] + [(m, "torch") for m in ("llama", "gemma")] * CPP


def _counted_ops(calls: dict[str, int]) -> cpu_fused.Ops | None:
    """The C++ ops with each call counted under its name."""
    real = cpu_fused.load()
    if real is None:
        return None

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper
    return cpu_fused.Ops(*(counted(f, getattr(real, f)) for f in ("rms_norm", "act_and_mul", "rotary",
                                                                           "small_linear")))


@pytest.mark.parametrize(("model_type", "ops"), CASES)
def test_llm_tokens_and_logprobs_equal_transformers(model_type, ops, monkeypatch):
    calls = {"norm": 0, "rotary": 0, "rms_norm": 0, "act_and_mul": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(fastpath, "_fused_norm", counted("norm", fastpath._fused_norm))
    monkeypatch.setattr(fastpath, "fused_rotary", counted("rotary", fastpath.fused_rotary))
    cpp_ops = _counted_ops(calls)
    calls["rotary_cpp"] = 0
    if cpp_ops is not None:
        cpp_ops = dataclasses.replace(cpp_ops, rotary=counted("rotary_cpp", cpp_ops.rotary))
    monkeypatch.setattr(fastpath, "cpp_ops", lambda: cpp_ops if fastpath.cpp_wanted() else None)
    monkeypatch.setattr(fastpath, "_scope_ops", lambda: cpp_ops if fastpath.cpp_wanted() else None)
    monkeypatch.setenv(fastpath.ENV, "1" if ops == "cpp" else "torch")
    if model_type == "gpt_neox":  # full-width rotary (the fused forms' condition), no RMS norm, no gated MLP
        model = tiny_model(model_type, max_position_embeddings=512, rotary_pct=1.0)
    else:
        model = tiny_model(model_type, max_position_embeddings=512)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    prompts = random_prompts(3, 5, 40, seed=3)
    llm = LLM(model, max_num_seqs=4)
    try:
        # what each family's modules are: a probe that stopped recognising them would make this test vacuous
        assert (llm.fastpath.norms > 0) == (model_type != "gpt_neox")
        assert (llm.fastpath.mlps > 0) == (model_type not in NO_GATED_MLP)
        assert bool(llm.fastpath.rotary) == (model_type != "cohere")  # cohere: interleaved rotary
        assert llm.fastpath.cpp > 0 or ops == "torch", llm.fastpath.describe()  # probed: the C++ forms pass
        calls.update(dict.fromkeys(calls, 0))  # from here: the engine's steps only, not the probes
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        unpatch(model)
    assert calls["norm"] > 0 or model_type == "gpt_neox", "the engine's steps took the fused norms"
    assert calls["rotary"] > 0 or model_type == "cohere"
    cpp = ops == "cpp"
    # which steps ran in C++: every RMS norm (cohere's are centred: torch), gated MLP and rotary
    assert (calls["rms_norm"] > 0) == (cpp and model_type not in ("cohere", "gpt_neox")), calls
    assert (calls["act_and_mul"] > 0) == (cpp and model_type not in NO_GATED_MLP), calls
    assert (calls["rotary_cpp"] > 0) == (cpp and model_type != "cohere"), calls
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy(model, prompt, 8, eos=False)
        got = out.outputs[0]
        assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
        match = compare_greedy(ref, got.token_ids, logits)
        assert match.ok, f"{model_type}: {match.explain()}"
        same = len(ref) if match.position is None else match.position  # logprobs of the shared prefix
        for tok, lp, step in zip(got.token_ids[:same], got.logprobs, logits, strict=False):
            want = torch.log_softmax(step.float(), -1)[tok].item()
            assert abs(lp.logprob - want) < 1e-4, f"{model_type}: logprob {lp.logprob} vs transformers' {want}"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before), "outside the engine the model is untouched"


def test_bench_counts_fewer_ops_for_each_fused_part():
    from flashpage.bench import fastpath as bench
    from flashpage.tiny import tiny_model_path

    result = bench.run(str(tiny_model_path()), tokens=(8,), reps=10)
    rows = {r["part"]: r for r in result["rows"]}
    assert rows["norm"]["ops_fused"] == 1 < rows["norm"]["ops_own"]
    assert rows["rotary"]["ops_fused"] < rows["rotary"]["ops_own"]
    assert rows["decoder layer"]["ops_fused"] < rows["decoder layer"]["ops_own"]
    assert all(r["us_fused"] > 0 and r["us_own"] > 0 for r in rows.values())
    assert "decoder layer" in bench.format_report(result)


def test_engine_ab_alternates_the_switch_with_identical_tokens(monkeypatch):
    from flashpage.bench import fastpath as bench
    from flashpage.tiny import tiny_model_path

    monkeypatch.setenv(fastpath.ENV, "1")
    result = bench.engine_ab(str(tiny_model_path()), pairs=1, quick=True, modes=("torch", "1"))
    assert [r["mode"] for r in result["runs"]] == ["torch", "1"]
    assert all(r["identical"] == r["requests"] > 0 and r["tok_s"] > 0 for r in result["runs"])
    assert "ratios 1/torch per pair (CPU time)" in bench.format_engine_report(result)
    assert all(0 < r["cpu_seconds"] for r in result["runs"])
    assert fastpath.cpp_wanted(), "the switch is restored"
