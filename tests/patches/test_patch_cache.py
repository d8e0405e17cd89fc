"""HFPagedCache under generate(): what it stores, how it shares, continues, rolls back and fails.

- a left-padded batch stores exactly its real tokens, in ``sum(ceil(len / block_size))`` blocks;
- beam search shares the prompt's blocks between beams (well under a dense copy per beam);
- a cache returned by ``generate(return_dict_in_generate=True)`` continues in a second call
  computing only the new tokens, with the unpatched model's result;
- ``crop`` rolls back (and generation continues correctly); an explicit ``HFPagedCache`` works
  as ``cache=`` and ``past_key_values=``;
- misuse fails clearly: a paged cache on an unpatched model (RuntimeError naming
  ``flashpage.patch``), a different batch size (ValueError), an exhausted non-growable pool
  (NoFreeBlocksError); a growable pool grows;
- memory: bytes in use never exceed the dense cache's for a left-padded batch; pages sit on
  their layer's device.
The block manager's invariants are checked after every generate().
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from model_zoo import left_padded_batch, tiny_model

import flashpage
from flashpage import NoFreeBlocksError, PagedKVCache
from flashpage.patches import HFPagedCache

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

BS = 4  # small blocks, so block accounting is visible in short sequences
PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW = 10
CACHE_MODELS = ["llama", "falcon"]  # generic interface path, and the dense-view adapter path


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, torch.nn.Module]]:
    built = {name: tiny_model(name) for name in ("llama", "falcon", "mistral")}
    yield built
    built.clear()


@pytest.fixture(autouse=True)
def _unpatched_after(models: dict[str, torch.nn.Module]) -> Iterator[None]:
    yield
    for model in models.values():
        flashpage.unpatch(model)


def _check(cache: Any) -> HFPagedCache:
    assert isinstance(cache, HFPagedCache), f"generate() did not use the paged cache: {type(cache).__name__}"
    assert cache.kv is not None
    cache.kv.blocks.check_invariants()
    return cache


def _gen(model: torch.nn.Module, **kwargs: Any) -> Any:
    """Greedy generate() returning a dict output (and its cache); checks the block invariants."""
    kwargs.setdefault("do_sample", False)
    out = model.generate(return_dict_in_generate=True, **kwargs)
    if flashpage.is_patched(model) or isinstance(kwargs.get("cache"), HFPagedCache):
        _check(out.cache)
    return out


def _unpatched(model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
    was = flashpage.is_patched(model)
    flashpage.unpatch(model)
    try:
        kwargs.setdefault("do_sample", False)
        return model.generate(**kwargs)
    finally:
        if was:
            flashpage.patch(model)


def _extend(seqs: torch.Tensor, mask: torch.Tensor, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``extra`` tokens to every row (the mask covers the whole, left-padded sequence)."""
    tail = torch.tensor([extra] * seqs.shape[0], dtype=seqs.dtype)
    ids = torch.cat([seqs, tail], dim=1)
    full_mask = torch.cat([mask, torch.ones((mask.shape[0], ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], 1)
    return ids, full_mask


def _blocks(lengths: list[int]) -> int:
    return sum(math.ceil(n / BS) for n in lengths)


# ------------------------------------------------------------------------------ what is stored
@pytest.mark.parametrize("name", CACHE_MODELS)
def test_left_padded_batch_stores_only_real_tokens(models: dict[str, torch.nn.Module], name: str) -> None:
    model = models[name]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model, block_size=BS)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    cache = out.cache
    assert out.sequences.shape[1] == ids.shape[1] + MAX_NEW
    # the last sampled token is never fed back, so each row holds prompt + MAX_NEW - 1 tokens
    expected = [n + MAX_NEW - 1 for n in PROMPT_LENGTHS]
    assert [cache.kv.num_tokens(seq) for seq in cache.rows] == expected
    stats = cache.memory_stats()
    assert stats.tokens_stored == sum(expected)
    assert stats.blocks_in_use == _blocks(expected)
    assert stats.block_size == BS and stats.token_slots_in_use == stats.blocks_in_use * BS
    assert cache.get_seq_length() == ids.shape[1] + MAX_NEW - 1  # transformers sees the padded length
    torch.testing.assert_close(out.sequences, _unpatched(model, input_ids=ids, attention_mask=mask,
                                                         max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW),
                               atol=0, rtol=0)


@pytest.mark.parametrize("name", CACHE_MODELS)
def test_beam_search_shares_blocks(models: dict[str, torch.nn.Module], name: str) -> None:
    model = models[name]
    num_beams = 4
    ids, mask = left_padded_batch([9, 19, 14])
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=num_beams)
    flashpage.patch(model, block_size=BS)
    out = _gen(model, **gen)
    cache = out.cache
    assert cache.batch_size == num_beams * ids.shape[0]
    lengths = [cache.kv.num_tokens(seq) for seq in cache.rows]
    dense_copy = _blocks(lengths)  # every beam its own blocks
    stats = cache.memory_stats()
    assert stats.blocks_in_use < 0.75 * dense_copy, f"{stats.blocks_in_use} blocks for {dense_copy} unshared"
    assert cache.kv.stats().cow_copies > 0, "beams never diverged inside a shared block"
    assert torch.equal(out.sequences, _unpatched(model, **gen))


# ------------------------------------------------------------------------------ continuing, rolling back
@pytest.mark.parametrize("name", ["llama", "falcon", "mistral"])
def test_second_generate_continues_without_recompute(models: dict[str, torch.nn.Module], name: str) -> None:
    model = models[name]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model, block_size=BS)
    first = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    cache = first.cache
    cached = cache.get_seq_length()
    stored = cache.memory_stats().tokens_stored
    ids2, mask2 = _extend(first.sequences, mask, [7, 8, 9])

    positions: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: positions.append(int(args[0].shape[1])))
    try:
        second = _gen(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=5, min_new_tokens=5, cache=cache)
    finally:
        handle.remove()
    assert second.cache is cache
    new_in_prompt = ids2.shape[1] - cached  # the last token of call 1 plus the 3 appended ones
    assert new_in_prompt == 4
    assert positions == [new_in_prompt] + [1] * 4, f"computed positions per forward: {positions}"
    assert sum(positions) < ids2.shape[1]
    assert cache.memory_stats().tokens_stored == stored + ids.shape[0] * (new_in_prompt + 4)
    ref = _unpatched(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(second.sequences, ref)


@pytest.mark.parametrize("name", CACHE_MODELS)
def test_crop_rolls_back_and_generation_continues(models: dict[str, torch.nn.Module], name: str) -> None:
    model = models[name]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    width = ids.shape[1]
    flashpage.patch(model, block_size=BS)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    cache = out.cache
    assert cache.get_seq_length() == width + MAX_NEW - 1
    keep_new = 2  # generated tokens kept in the cache
    with pytest.raises(ValueError, match="negative"):
        cache.crop(width + keep_new)  # transformers 5 semantics: only crop(-n) removes tokens
    cache.crop(-(MAX_NEW - 1 - keep_new))
    _check(cache)
    assert cache.get_seq_length() == width + keep_new
    kept = [n + keep_new for n in PROMPT_LENGTHS]
    assert [cache.kv.num_tokens(seq) for seq in cache.rows] == kept
    stats = cache.memory_stats()
    assert stats.tokens_stored == sum(kept) and stats.blocks_in_use == _blocks(kept)

    # continue from the crop point: feed one more of the tokens generated before
    ids2 = out.sequences[:, : width + keep_new + 1]
    mask2 = torch.cat([mask, torch.ones((3, keep_new + 1), dtype=mask.dtype)], 1)
    again = _gen(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=6, min_new_tokens=6, cache=cache)
    ref = _unpatched(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(again.sequences, ref)
    # greedy is deterministic: continuing from the rolled-back cache reproduces the first run
    n = again.sequences.shape[1]
    assert n == width + keep_new + 1 + 6 <= out.sequences.shape[1]
    assert torch.equal(again.sequences, out.sequences[:, :n])


def test_crop_zero_removes_nothing(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model, block_size=BS)
    cache = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4).cache
    before = (cache.get_seq_length(), cache.memory_stats().tokens_stored)
    cache.crop(0)
    _check(cache)
    assert (cache.get_seq_length(), cache.memory_stats().tokens_stored) == before


# ------------------------------------------------------------------------------ explicit caches
@pytest.mark.parametrize("kwarg", ["cache", "past_key_values"])
def test_explicit_cache_argument(models: dict[str, torch.nn.Module], kwarg: str) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model)
    cache = HFPagedCache(model.config, block_size=BS)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
               **{kwarg: cache})
    assert out.cache is cache
    assert cache.memory_stats().tokens_stored == sum(PROMPT_LENGTHS) + 3 * (MAX_NEW - 1)
    assert cache.memory_stats().block_size == BS
    ref = _unpatched(model, input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    assert torch.equal(out.sequences, ref)


def test_paged_cache_on_unpatched_model_raises(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    assert not flashpage.is_patched(model)
    with pytest.raises(RuntimeError, match=r"flashpage\.patch"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, cache=HFPagedCache(model.config))


def test_reusing_cache_with_other_batch_size_raises(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model, block_size=BS)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
    cache = out.cache
    before = (cache.get_seq_length(), cache.memory_stats())
    ids2, mask2 = _extend(out.sequences, mask, [7, 8])
    with pytest.raises(ValueError, match="batch size"):
        model.generate(input_ids=ids2[:2], attention_mask=mask2[:2], max_new_tokens=3, cache=cache)
    _check(cache)
    assert (cache.get_seq_length(), cache.memory_stats()) == before, "the failed call changed the cache"
    # the model recovers: a fresh generate() is exact, and the old cache still continues its batch
    fresh = _gen(model, input_ids=ids2[:2], attention_mask=mask2[:2], max_new_tokens=3)
    assert torch.equal(fresh.sequences, _unpatched(model, input_ids=ids2[:2], attention_mask=mask2[:2],
                                                   max_new_tokens=3))
    again = _gen(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=3, cache=cache)
    assert torch.equal(again.sequences, _unpatched(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=3))


def test_reset_frees_blocks_for_a_new_batch(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model, block_size=BS)
    cache = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=4).cache
    assert cache.memory_stats().blocks_in_use > 0
    cache.reset()
    _check(cache)
    assert cache.memory_stats().blocks_in_use == 0 and cache.get_seq_length() == 0
    ids2, mask2 = left_padded_batch([6, 3], seed=1)
    out = _gen(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=5, cache=cache)
    assert cache.batch_size == 2
    assert torch.equal(out.sequences, _unpatched(model, input_ids=ids2, attention_mask=mask2, max_new_tokens=5))


# ------------------------------------------------------------------------------ pool size
@pytest.mark.parametrize("where", ["patch-options", "explicit-cache"])
def test_pool_grows_when_too_small(models: dict[str, torch.nn.Module], where: str) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    if where == "patch-options":
        flashpage.patch(model, num_blocks=2, block_size=BS)
        out = _gen(model, **gen)
    else:
        flashpage.patch(model)
        out = _gen(model, **gen, cache=HFPagedCache(model.config, num_blocks=2, block_size=BS))
    stats = out.cache.memory_stats()
    assert stats.num_blocks > 2
    assert stats.blocks_in_use == _blocks([n + MAX_NEW - 1 for n in PROMPT_LENGTHS])
    assert torch.equal(out.sequences, _unpatched(model, **gen))


@pytest.mark.parametrize("where", ["patch-options", "explicit-cache"])
def test_pool_not_growable_raises(models: dict[str, torch.nn.Module], where: str) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    if where == "patch-options":
        flashpage.patch(model, num_blocks=2, block_size=BS, growable=False)
        with pytest.raises(NoFreeBlocksError):
            model.generate(**gen)
        flashpage.unpatch(model)
        flashpage.patch(model)
    else:
        flashpage.patch(model)
        cache = HFPagedCache(model.config, num_blocks=2, block_size=BS, growable=False)
        with pytest.raises(NoFreeBlocksError):
            model.generate(**gen, cache=cache)
        _check(cache)
        assert cache.kv.num_blocks == 2
    # the failure leaves the model usable
    out = _gen(model, **gen)
    assert torch.equal(out.sequences, _unpatched(model, **gen))


# ------------------------------------------------------------------------------ memory and devices
def test_bytes_in_use_at_most_dense(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    lengths = [3, 20, 9]
    ids, mask = left_padded_batch(lengths, seed=2)
    flashpage.patch(model, block_size=BS)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20)
    stats = out.cache.memory_stats()
    logical = out.cache.get_seq_length()
    assert stats.dense_bytes > 0
    assert stats.bytes_in_use <= stats.dense_bytes, stats
    assert stats.tokens_stored < len(lengths) * logical  # the pads are not stored
    assert stats.bytes_allocated >= stats.bytes_in_use
    assert stats.saving >= 1.0


def test_pages_follow_layer_devices(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with pytest.raises(ValueError, match="layer devices"):
        PagedKVCache(layers, kv_heads, head_dim, num_blocks=8, block_size=BS, dtype=torch.float32,
                     device=["cpu"] * (layers + 1))
    kv = PagedKVCache(layers, kv_heads, head_dim, num_blocks=64, block_size=BS, dtype=torch.float32,
                      device=["cpu"] * layers, enable_prefix_caching=False)
    for layer in range(layers):  # allocated eagerly, one device per layer
        assert kv.layer_device(layer) == torch.device("cpu")
        assert kv.k_pages(layer).shape == (64, BS, kv_heads, head_dim)
        assert kv.v_pages(layer).device == torch.device("cpu")

    ids, mask = left_padded_batch(PROMPT_LENGTHS)
    flashpage.patch(model)
    cache = HFPagedCache.wrap(kv, cfg)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, cache=cache)
    assert torch.equal(out.sequences, _unpatched(model, input_ids=ids, attention_mask=mask, max_new_tokens=6))
    for layer in range(layers):
        assert kv.k_pages(layer).abs().sum() > 0, f"layer {layer} wrote nothing to its pages"

    # lazily placed pages (the default) land on the device of the layer's parameters
    lazy = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=3).cache
    for layer, block in enumerate(model.model.layers):
        assert lazy.kv.layer_device(layer) == next(block.parameters()).device


def test_prefix_caching_shares_equal_prompts(models: dict[str, torch.nn.Module]) -> None:
    model = models["llama"]
    ids, mask = left_padded_batch([12])
    ids, mask = ids.repeat(3, 1), mask.repeat(3, 1)
    flashpage.patch(model, block_size=BS, enable_prefix_caching=True)
    out = _gen(model, input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3)
    assert torch.equal(out.sequences, _unpatched(model, input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                                 min_new_tokens=3))
    lengths = [out.cache.kv.num_tokens(seq) for seq in out.cache.rows]
    assert out.cache.memory_stats().blocks_in_use < _blocks(lengths), "equal prompts did not share a block"
