"""patch()'s checks before the first forward (patches/checks.py), one model type per reason.

The sweep (test_sweep.py) covers every type; these pin each mechanism on its own, quickly: MLA
recognised by what its attention does (under names the DeepSeek adapter never listed), K/V changed
after ``cache.update`` sent to the dense view, an ``is_causal=False`` module handed a causal mask made
causal while patched and restored after, and refusals that name the model type and the reason.
"""

from __future__ import annotations

import pytest
import sweep_models as sm
import torch

import flashpage
from flashpage.patches import ATTN_NAME, UnsupportedModelError
from flashpage.patches.deepseek import NOTE as MLA_NOTE
from flashpage.patches.patching import patch_state

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def _greedy_equal(model: torch.nn.Module) -> None:
    prompts = sm._prompts(99)
    ref_tokens, ref_logits = sm._greedy(model, prompts)
    with flashpage.patched(model):
        tokens, logits = sm._greedy(model, prompts)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits, strict=True)) <= sm.LOGIT_ATOL


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "minicpm3", "sarvam_mla"])
def test_mla_recognised_by_what_it_does(model_type: str) -> None:
    model = sm.build_model(model_type)
    flashpage.patch(model)
    family = patch_state(model).family
    assert family.path == "dense-view" and family.note == MLA_NOTE
    flashpage.unpatch(model)
    _greedy_equal(model)


@pytest.mark.parametrize("model_type", ["diffllama", "jetmoe"])
def test_kv_changed_after_update_goes_dense(model_type: str) -> None:
    model = sm.build_model(model_type)
    flashpage.patch(model)
    family = patch_state(model).family
    assert family.path == "dense-view" and "K/V transformed after cache.update" in family.note
    flashpage.unpatch(model)
    _greedy_equal(model)  # flashpage.LLM on the dense view: test_dense_view_llm.py


def test_causal_mask_on_non_causal_module() -> None:
    model = sm.build_model("bigbird_pegasus")
    attn = [m for m in model.modules() if type(m).__name__ == "BigBirdPegasusDecoderAttention"]
    before = [m.is_causal for m in attn]
    assert not any(before)
    with flashpage.patched(model):
        assert any(m.is_causal for m in attn)
    assert [m.is_causal for m in attn] == before
    _greedy_equal(model)


@pytest.mark.parametrize(("model_type", "reason"), [
    ("deepseek_v4", r"compressed sparse attention .*cache\.store_compression_weights\(\)"),
    ("mllama", r"cross-attention layers"),
    ("moshi", r"sliding window of 5 tokens that its attention call does not pass"),
    ("git", r"test forward through flashpage's cache failed"),
    ("dory", r"looped / recurrent-depth layers"),
    ("rwkv", r"no attention: its recurrent \(time-mixing\) state"),
])
def test_refusals_name_type_and_reason(model_type: str, reason: str) -> None:
    model = sm.build_model(model_type)
    with pytest.raises(UnsupportedModelError, match=rf"model_type='{model_type}.*{reason}"):  # mllama: its text
        flashpage.patch(model)  # model's type, the config of MllamaForCausalLM
    assert not flashpage.is_patched(model)
    assert model.config._attn_implementation != ATTN_NAME  # left as it was


def test_probe_runs_once_per_model() -> None:
    model = sm.build_model("llama")
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    flashpage.patch(model)
    first = len(calls)
    flashpage.unpatch(model)
    flashpage.patch(model)
    flashpage.unpatch(model)
    handle.remove()
    assert first == 2 and len(calls) == first  # a prefill and a decode step, the first time only
