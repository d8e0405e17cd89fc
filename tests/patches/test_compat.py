"""transformers-version compatibility: the supported range, its refusal, and the feature tests.

- the range in ``flashpage.patches.compat`` is the one ``pyproject.toml`` declares;
- ``patch()``, ``LLM`` and the version check refuse a transformers outside it, naming the range
  and the fix, before touching the model;
- each feature test agrees with the installed transformers (cache keyword, mask interface, crop
  semantics), and the shims behind them (mask adapter for ``cache_position=``, tensor
  ``get_mask_sizes``, length-style ``crop``, ``get_max_cache_shape``, ``max_cache_len``) are exact;
- ``flashpage info`` reports the versions against the range.

The same equivalence tests run against the oldest supported transformers and a middle release in
CI (``.ci/compat``); this module is part of that set.
"""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from model_zoo import left_padded_batch, tiny_model
from transformers import masking_utils
from transformers.cache_utils import Cache, DynamicLayer

import flashpage
from flashpage.info import collect_info, format_info
from flashpage.patches import ATTN_NAME, HFPagedCache, compat, hf_cache
from flashpage.patches.attention import paged_mask, register
from flashpage.patches.compat import UnsupportedTransformersError

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ the declared range
def _declared(dist: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    match = re.search(rf'"{dist}([^"]*)"', deps)
    assert match, f"pyproject.toml declares no {dist} dependency"
    return match.group(1)


def test_pyproject_declares_the_range_compat_enforces() -> None:
    assert f"transformers{_declared('transformers')}" == compat.TRANSFORMERS_PIN
    assert _declared("torch") == f">={compat.MIN_TORCH}"


def test_installed_versions_are_in_range() -> None:
    assert compat.transformers_in_range(transformers.__version__)
    assert compat.torch_in_range(torch.__version__)
    compat.require_supported_transformers()


@pytest.mark.parametrize("version", ["5.0.0", "5.0.0rc1", "5.17.0", "5.24.0", "5.99.3.dev0"])
def test_versions_in_range(version: str) -> None:
    compat.require_supported_transformers(version)


@pytest.mark.parametrize("version", ["4.57.6", "4.46.0", "6.0.0", "not installed"])
def test_versions_out_of_range_are_refused(version: str) -> None:
    with pytest.raises(UnsupportedTransformersError) as info:
        compat.require_supported_transformers(version)
    message = str(info.value)
    assert f"transformers {version} is installed" in message
    assert 'pip install "transformers>=5.0,<6"' in message
    assert info.value.version == version
    assert isinstance(info.value, ImportError)


def test_torch_minimum() -> None:
    assert compat.torch_in_range("2.6.0") and compat.torch_in_range("2.13.0+cpu")
    assert not compat.torch_in_range("2.5.1") and not compat.torch_in_range("not installed")


def test_unreadable_version_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot read a version number"):
        compat.transformers_in_range("main")


@pytest.fixture
def old_transformers(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pretend transformers 4.57.6 is installed."""
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda dist: "4.57.6" if dist == "transformers" else real(dist))
    return "4.57.6"


def test_patch_refuses_unsupported_transformers_before_touching_the_model(old_transformers: str) -> None:
    model = tiny_model("llama")
    attn = model.config._attn_implementation
    with pytest.raises(UnsupportedTransformersError, match=r"needs transformers>=5\.0,<6, but transformers 4\.57\.6"):
        flashpage.patch(model)
    assert not flashpage.is_patched(model)
    assert model.config._attn_implementation == attn
    assert "_prepare_cache_for_generation" not in vars(model)


def test_llm_refuses_unsupported_transformers_before_loading(old_transformers: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTransformersError, match="4.57.6"):
        flashpage.LLM(tmp_path / "no-such-model")  # refused before any attempt to load it
    model = tiny_model("llama")
    with pytest.raises(UnsupportedTransformersError):
        flashpage.LLM(model)
    assert not flashpage.is_patched(model)


# ------------------------------------------------------------------------------ feature tests
def test_cache_kwarg_is_the_forward_keyword() -> None:
    model = tiny_model("llama")
    name = compat.cache_kwarg(model)
    params = inspect.signature(model.forward).parameters
    assert name in params and name in ("cache", "past_key_values")
    assert name == ("cache" if "cache" in params else "past_key_values")
    assert compat.cache_kwarg(object()) == "past_key_values"  # no forward to inspect: the 5.x-wide keyword


def test_patched_generate_uses_the_cache_keyword_of_this_transformers() -> None:
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    cache = HFPagedCache(model.config)
    with flashpage.patched(model):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True, **{compat.cache_kwarg(model): cache})
    assert torch.equal(out.sequences, ref)
    returned = out.cache if hasattr(out, "cache") else out.past_key_values
    assert returned is cache and cache.get_seq_length() == ids.shape[1] + 5
    assert flashpage.returned_cache(out) is cache  # the README's spelling, on every release
    assert flashpage.returned_cache(object()) is None


def test_mask_function_is_the_installed_sdpa_mask() -> None:
    """flashpage's mask function forwards whatever this transformers passes (cache_position before
    5.5, q_length/q_offset after) to transformers' own sdpa mask: same mask, whatever the release."""
    register()
    registered = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[ATTN_NAME]
    assert registered is paged_mask
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    if compat.mask_takes_cache_position():
        kwargs = {"cache_position": torch.arange(5, 6)}
    else:
        kwargs = {"q_length": 1, "q_offset": 5}
    native = masking_utils.sdpa_mask(batch_size=2, kv_length=6, attention_mask=pad, allow_is_causal_skip=False,
                                     **kwargs)
    got = registered(batch_size=2, kv_length=6, attention_mask=pad, allow_is_causal_skip=False, **kwargs)
    assert torch.equal(got, native) and not got[0, 0, 0, :2].any() and got[1].all()


def test_crop_feature_matches_transformers() -> None:
    assert compat.legacy_crop() == ("max_length" in inspect.signature(DynamicLayer.crop).parameters)


@pytest.fixture(scope="module")
def filled() -> tuple[torch.nn.Module, HFPagedCache, int]:
    """A patched llama and the HFPagedCache of a finished generate() (prompt width + 7 tokens)."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch([5, 9])
    flashpage.patch(model, block_size=4)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert isinstance(cache, HFPagedCache)
    return model, cache, ids.shape[1]


def test_length_style_crop_where_transformers_uses_it(monkeypatch: pytest.MonkeyPatch,
                                                      filled: tuple[torch.nn.Module, HFPagedCache, int]) -> None:
    _, cache, width = filled
    length = cache.get_seq_length()
    assert length == width + 7
    monkeypatch.setattr("flashpage.patches.hf_cache.legacy_crop", lambda: False)
    with pytest.raises(ValueError, match="pass a negative number"):
        cache.crop(length - 1)
    monkeypatch.setattr("flashpage.patches.hf_cache.legacy_crop", lambda: True)
    cache.crop(length + 3)  # longer than the cache: nothing to remove
    assert cache.get_seq_length() == length
    cache.crop(length - 2)  # keep length - 2 tokens
    assert cache.get_seq_length() == length - 2
    assert [cache.kv.num_tokens(s) for s in cache.rows] == [5 + 5, 9 + 5]
    cache.crop(-1)  # the negative form works under both conventions
    assert cache.get_seq_length() == length - 3
    cache.kv.blocks.check_invariants()


def test_cache_api_shims(filled: tuple[torch.nn.Module, HFPagedCache, int]) -> None:
    _, cache, _ = filled
    length = cache.get_seq_length()
    assert cache.get_mask_sizes(3, 0) == cache.get_mask_sizes(torch.arange(length, length + 3), 0) == (length + 3, 0)
    layer = cache.layers[1]
    assert layer.get_mask_sizes(torch.arange(2)) == layer.get_mask_sizes(2) == (length + 2, 0)
    assert layer.get_max_cache_shape() == layer.get_max_length() == -1
    assert cache.get_max_cache_shape() == cache.get_max_length() == -1
    fresh = HFPagedCache(num_layers=2, max_cache_len=64)
    assert fresh.max_cache_len == 64
    fresh.max_cache_len = 128  # a read-only property of transformers' Cache in 5.0-5.16: ours is settable
    assert fresh.max_cache_len == 128


# ------------------------------------------------------------------------------ flashpage info
def test_info_reports_versions_against_the_range() -> None:
    info = collect_info()
    rows = {row["name"]: row for row in info["supported_versions"]}
    assert rows["transformers"]["version"] == transformers.__version__
    assert rows["transformers"]["required"] == compat.TRANSFORMERS_PIN and rows["transformers"]["supported"]
    assert rows["torch"]["required"] == f"torch>={compat.MIN_TORCH}" and rows["torch"]["supported"]
    text = format_info(info)
    assert f"transformers {transformers.__version__}: in range (transformers>=5.0,<6)" in text


def test_info_flags_an_unsupported_transformers(old_transformers: str) -> None:
    info = collect_info()
    row = next(r for r in info["supported_versions"] if r["name"] == "transformers")
    assert row["version"] == "4.57.6" and row["supported"] is False
    assert 'transformers 4.57.6: NOT supported (install transformers>=5.0,<6)' in format_info(info)


# ------------------------------------------------------------------------------ releases newer than tested
def test_cache_takes_every_argument_this_transformers_passes() -> None:
    """Every Cache / CacheLayerMixin method flashpage's cache overrides takes the installed transformers' arguments
    (the check behind patch()'s refusal; .ci/smoke asserts the same on every 5.x minor line)."""
    assert hf_cache.cache_api_mismatches() == ()


def test_patch_refuses_cache_calls_it_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 5.25 crash, replayed: a cache method without the keywords transformers passes is refused at patch(),
    by name, before the model is touched; never a TypeError inside generate()."""
    def old_signature(self: HFPagedCache) -> None:  # flashpage's activate_past_recording before transformers 5.25
        return None

    def transformers_525(self: Cache, **kwargs: object) -> None:  # 5.25's Cache.activate_past_recording
        return None

    monkeypatch.setattr(Cache, "activate_past_recording", transformers_525, raising=False)  # any release
    monkeypatch.setattr(HFPagedCache, "activate_past_recording", old_signature)
    hf_cache.cache_api_mismatches.cache_clear()
    try:
        model = tiny_model("llama")
        attn = model.config._attn_implementation
        with pytest.raises(flashpage.UnsupportedModelError, match=r"Cache\.activate_past_recording\(\*\*kwargs\)"):
            flashpage.patch(model)
        assert not flashpage.is_patched(model) and model.config._attn_implementation == attn
    finally:
        hf_cache.cache_api_mismatches.cache_clear()


def test_untested_parameters_are_named() -> None:
    def theirs(self, a, b=1, *, c=2, **kwargs): ...  # noqa: ANN001, ANN202, ANN003
    def positional_only(self, a): ...  # noqa: ANN001, ANN202
    def takes_all(self, a, *args, **kwargs): ...  # noqa: ANN001, ANN202, ANN002, ANN003
    assert hf_cache._untaken_parameters(theirs, positional_only) == ["b", "c", "**kwargs"]
    assert hf_cache._untaken_parameters(theirs, takes_all) == []
    assert hf_cache._untaken_parameters(positional_only, lambda self: None) == ["1 positional arguments"]


@pytest.mark.parametrize("version, warns", [("5.0.0", False), (f"{compat.NEWEST_TESTED}.9", False),
                                            ("5.99.0", True)])
def test_a_release_newer_than_tested_warns_once(monkeypatch: pytest.MonkeyPatch, version: str, warns: bool) -> None:
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda dist: version if dist == "transformers" else real(dist))
    monkeypatch.setattr(compat, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.require_supported_transformers()
        compat.require_supported_transformers()
    untested = [w for w in seen if issubclass(w.category, compat.UntestedTransformersWarning)]
    assert len(untested) == (1 if warns else 0)
    if warns:
        message = str(untested[0].message)
        assert f"tested with transformers 5.0 to {compat.NEWEST_TESTED}.x; {version} is newer" in message
        assert 'pip install "transformers>=5.0,<' in message


def test_readme_release_list_is_every_minor_line_up_to_newest_tested() -> None:
    """README's release list is what .ci/smoke --readme wrote: one release per 5.x minor line, 5.0 to NEWEST_TESTED."""
    text = (ROOT / "docs" / "models.md").read_text()
    block = re.search(r"<!-- releases:begin.*?-->(.*?)<!-- releases:end -->", text, flags=re.S)
    assert block, "docs/models.md has no releases:begin / releases:end block"
    listed = re.findall(r"\b5\.(\d+)\.(\d+)\b", block.group(1))
    minors = [int(minor) for minor, _ in listed]
    newest = int(compat.NEWEST_TESTED.split(".")[1])
    assert minors == list(range(newest + 1)), f"README lists minor lines {minors}: run .ci/smoke --readme"
