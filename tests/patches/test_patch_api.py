"""The public patching API: patch / unpatch / patched / is_patched and their error handling.

- patching twice is harmless (same outputs, hooks not doubled);
- unpatch restores the attention implementation, removes every hook, the per-module state and the
  generate() override, and the model then generates exactly as before patching;
- ``with flashpage.patched(model):`` restores on exit, also when the block raises, and leaves an
  already patched model patched;
- unsupported models (encoder-decoder, plain modules) raise UnsupportedModelError naming the type;
  unknown cache options raise TypeError and change nothing;
- ``use_cache=False`` runs flashpage's dense attention path and matches the unpatched model;
- the attention implementation's name contains no "flash" (transformers would try flash-attn).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import MethodType
from typing import Any

import pytest
import torch
from model_zoo import left_padded_batch, tiny_model

import flashpage
import flashpage.patches.attention as attention
from flashpage.patches import ATTN_NAME, HFPagedCache, UnsupportedModelError
from flashpage.patches.patching import patch_state

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MAX_NEW = 10


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(autouse=True)
def _restore(model: torch.nn.Module) -> Iterator[None]:
    yield
    flashpage.unpatch(model)
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch([5, 11, 8])


@pytest.fixture(scope="module")
def reference(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The unpatched model's greedy output (computed before any test patches it)."""
    assert not flashpage.is_patched(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _greedy(model, batch)


def _greedy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    ids, mask = batch
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)


def _hook_counts(model: torch.nn.Module) -> dict[str, int]:
    """Forward (pre-)hooks on every module of the model, by kind."""
    counts = {"pre": 0, "post": 0, "always": 0}
    for module in model.modules():
        counts["pre"] += len(module._forward_pre_hooks)
        counts["post"] += len(module._forward_hooks)
        counts["always"] += len(module._forward_hooks_always_called)
    return counts


def _flashpage_leftovers(model: torch.nn.Module) -> list[str]:
    names = [name or "<model>" for name, module in model.named_modules() if "_flashpage_state" in vars(module)]
    if "_flashpage_patch" in vars(model):
        names.append("_flashpage_patch")
    if "_prepare_cache_for_generation" in vars(model):
        names.append("_prepare_cache_for_generation")
    return names


@pytest.fixture
def paged_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = HFPagedCache.begin_forward

    def counting(self: HFPagedCache, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HFPagedCache, "begin_forward", counting)
    return calls


# ------------------------------------------------------------------------------ patch / unpatch
def test_patch_twice_is_harmless(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                                 reference: torch.Tensor, paged_forwards: list[int]) -> None:
    before = _hook_counts(model)
    assert flashpage.patch(model) is model
    once = _hook_counts(model)
    state = patch_state(model)
    assert once["pre"] > before["pre"] and once["post"] > before["post"]
    first = _greedy(model, batch)
    assert paged_forwards, "patched generate() did not use the paged cache"
    assert flashpage.patch(model) is model
    assert _hook_counts(model) == once, "patching again added hooks"
    assert patch_state(model) is state
    second = _greedy(model, batch)
    assert torch.equal(first, second) and torch.equal(second, reference)
    flashpage.unpatch(model)
    assert _hook_counts(model) == before, "one unpatch did not undo a double patch"
    assert not flashpage.is_patched(model)


def test_patch_again_updates_cache_options(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    flashpage.patch(model, block_size=4)
    flashpage.patch(model, block_size=8)
    ids, mask = batch
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    assert out.cache.memory_stats().block_size == 8


def test_patch_again_with_unknown_option_raises(model: torch.nn.Module,
                                                batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    flashpage.patch(model)
    with pytest.raises(TypeError, match="bogus"):
        flashpage.patch(model, bogus=1)
    _greedy(model, batch)  # and the model still generates


@pytest.mark.parametrize("previous", ["sdpa", "eager"])
def test_unpatch_restores_everything(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                                     reference: torch.Tensor, previous: str) -> None:
    model.set_attn_implementation(previous)
    hooks = _hook_counts(model)
    assert _flashpage_leftovers(model) == []
    flashpage.patch(model)
    assert model.config._attn_implementation == ATTN_NAME
    assert "_prepare_cache_for_generation" in vars(model)
    assert torch.equal(_greedy(model, batch), reference)
    assert flashpage.unpatch(model) is model
    assert model.config._attn_implementation == previous
    assert model.model.config._attn_implementation == previous
    assert _hook_counts(model) == hooks
    assert "_prepare_cache_for_generation" not in vars(model)
    assert _flashpage_leftovers(model) == []
    assert not flashpage.is_patched(model)
    out = _greedy(model, batch, return_dict_in_generate=True)
    assert not isinstance(out.cache, HFPagedCache)
    assert torch.equal(out.sequences, reference)


def test_unpatch_of_unpatched_model_is_a_noop(model: torch.nn.Module) -> None:
    hooks = _hook_counts(model)
    assert flashpage.unpatch(model) is model
    assert _hook_counts(model) == hooks and model.config._attn_implementation == "sdpa"


def test_unpatch_restores_a_user_prepare_cache_override(model: torch.nn.Module,
                                                        batch: tuple[torch.Tensor, torch.Tensor],
                                                        reference: torch.Tensor) -> None:
    calls: list[int] = []

    def user_override(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return type(self)._prepare_cache_for_generation(self, *args, **kwargs)

    model._prepare_cache_for_generation = MethodType(user_override, model)
    original = vars(model)["_prepare_cache_for_generation"]
    flashpage.patch(model)
    flashpage.unpatch(model)
    assert vars(model).get("_prepare_cache_for_generation") == original
    assert torch.equal(_greedy(model, batch), reference)
    assert calls


# ------------------------------------------------------------------------------ patched()
def test_patched_context_restores_on_exit(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                                          reference: torch.Tensor, paged_forwards: list[int]) -> None:
    hooks = _hook_counts(model)
    with flashpage.patched(model) as m:
        assert m is model and flashpage.is_patched(model)
        assert model.config._attn_implementation == ATTN_NAME
        assert torch.equal(_greedy(model, batch), reference)
    assert paged_forwards
    assert not flashpage.is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert _hook_counts(model) == hooks and _flashpage_leftovers(model) == []


def test_patched_context_restores_when_the_block_raises(model: torch.nn.Module) -> None:
    hooks = _hook_counts(model)
    with pytest.raises(KeyError, match="boom"), flashpage.patched(model, block_size=4):
        assert flashpage.is_patched(model)
        raise KeyError("boom")
    assert not flashpage.is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert _hook_counts(model) == hooks and _flashpage_leftovers(model) == []


def test_patched_context_keeps_an_outer_patch(model: torch.nn.Module) -> None:
    flashpage.patch(model)
    hooks = _hook_counts(model)
    with flashpage.patched(model):
        assert _hook_counts(model) == hooks
    assert flashpage.is_patched(model), "the inner scope unpatched a model patched outside it"
    assert model.config._attn_implementation == ATTN_NAME and _hook_counts(model) == hooks


def test_patched_context_restores_outer_cache_options(model: torch.nn.Module,
                                                      batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, mask = batch

    def block_size() -> int:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True)
        return out.cache.memory_stats().block_size

    flashpage.patch(model, block_size=4)
    with flashpage.patched(model, block_size=8):
        assert block_size() == 8
    assert block_size() == 4


# ------------------------------------------------------------------------------ errors
def _tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                      decoder_start_token_id=0)
    return T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize(("make", "type_name"), [(_tiny_t5, "T5ForConditionalGeneration"),
                                                 (lambda: torch.nn.Linear(4, 4), "Linear")])
def test_unsupported_model_raises(make: Any, type_name: str) -> None:
    bad = make()
    hooks = _hook_counts(bad)
    with pytest.raises(UnsupportedModelError, match=type_name) as info:
        flashpage.patch(bad)
    assert isinstance(info.value, TypeError)
    assert not flashpage.is_patched(bad) and _hook_counts(bad) == hooks and _flashpage_leftovers(bad) == []
    with pytest.raises(UnsupportedModelError, match=type_name), flashpage.patched(bad):
        pass  # pragma: no cover


def test_unknown_cache_option_raises_type_error(model: torch.nn.Module) -> None:
    hooks = _hook_counts(model)
    with pytest.raises(TypeError, match="blocksize"):
        flashpage.patch(model, blocksize=16)
    assert not flashpage.is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert _hook_counts(model) == hooks and _flashpage_leftovers(model) == []
    with pytest.raises(TypeError, match="bogus"), flashpage.patched(model, bogus=True):
        pass  # pragma: no cover
    assert not flashpage.is_patched(model)


# ------------------------------------------------------------------------------ paths and names
def test_use_cache_false_runs_dense_path(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                                         paged_forwards: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _greedy(model, batch, use_cache=False)
    dense_calls: list[int] = []
    original = attention.run_unpatched  # without a paged cache: the unpatched model's attention (unpatched.py)

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        dense_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "run_unpatched", counting)
    flashpage.patch(model)
    got = _greedy(model, batch, use_cache=False)
    assert torch.equal(got, ref)
    assert not paged_forwards, "use_cache=False still created a paged cache"
    assert dense_calls, "use_cache=False did not run the unpatched attention through flashpage's function"


def test_base_model_called_directly_plans_its_forward(model: torch.nn.Module,
                                                      batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, mask = batch
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        flashpage.patch(model)
        cache = HFPagedCache(model.config, block_size=4)
        got = model.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-4, rtol=0)
    assert cache.get_seq_length() == ids.shape[1]
    assert cache.memory_stats().tokens_stored == int(mask.sum())
    cache.kv.blocks.check_invariants()


def test_attention_name_has_no_flash(model: torch.nn.Module) -> None:
    assert "flash" not in ATTN_NAME.lower()
    flashpage.patch(model)
    assert model.config._attn_implementation == ATTN_NAME
    assert "flash" not in model.config._attn_implementation.lower()
    assert flashpage.patch is flashpage.patches.patch and flashpage.unpatch is flashpage.patches.unpatch
