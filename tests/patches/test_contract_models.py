"""Contract tests end to end: patched ``generate()`` and ``LLM`` on tiny models of several families,
with every kernel call going through flash-attn's real interface files over the stand-ins of
tests/flash_standins.py (fp16 on CPU), against the same runs on flashpage's reference.

Each run must reach the stand-in (the flash-attn path really ran), pass its checks, and produce
the reference's greedy tokens (a first difference is allowed only at a near-tie of the reference's
logits: fp16 kernels round differently)."""

from __future__ import annotations

import flash_standins as fs
import pytest
import torch
from model_zoo import left_padded_batch, tiny_model

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.kernels import dispatch
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("fresh_backends")  # _load skips when a release's file is missing
GAP = 0.05  # fp16: the largest top-2 logit gap at which the first differing token counts as a tie
RUNS = [("llama", "fa2", "v2.5.9", 256), ("llama", "fa3", fs.FA3_RELEASED, 16), ("gemma2", "fa2", fs.FA2_NEWEST, 256),
        ("gemma2", "fa4", "100", 16), ("gpt_bigcode", "fa3", fs.FA3_RELEASED, 16), ("mistral", "fa4", "90", 16),
        ("qwen2", "fa2", "v2.6.1", 256)]




def _load(key: str, tag: str):
    if key == "fa2":
        return fs.load_fa2(tag)
    if key == "fa3":
        return fs.load_fa3(tag)
    return fs.load_fa4(int(tag))


def _generate(model, batch, block_size: int):
    ids, mask = batch
    with flashpage.patched(model, block_size=block_size):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    new = out.sequences[:, ids.shape[1]:]
    return new, out.logits


@pytest.mark.parametrize("family,key,tag,block_size", RUNS, ids=lambda x: str(x))
def test_patched_generate_through_real_flash_attn(family, key, tag, block_size):
    model = tiny_model(family).half()
    batch = left_padded_batch([5, 9, 3], seed=1)
    mod, ext = _load(key, tag)  # first: a missing release skips before any work
    with dispatch.force_backend("reference", None):
        want, logits = _generate(model, batch, block_size)
    with dispatch.force_backend(key, mod):
        got, _ = _generate(model, batch, block_size)
    assert len(ext.calls) > 0, "the flash-attn path never ran"
    for row in range(want.shape[0]):
        match = compare_greedy(want[row].tolist(), got[row].tolist(), [step[row] for step in logits], tol=GAP)
        assert match.ok, f"row {row}: {match}"


@pytest.mark.parametrize("family,key,tag,block_size", RUNS[::2], ids=lambda x: str(x))
def test_llm_through_real_flash_attn(family, key, tag, block_size):
    model = tiny_model(family, max_position_embeddings=512).half()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 11, 7, 2)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    mod, ext = _load(key, tag)  # first: a missing release skips before any work
    with dispatch.force_backend("reference", None):
        want = [o.token_ids for o in LLM(model, block_size=block_size, num_blocks=16).generate(prompts, params)]
    with dispatch.force_backend(key, mod):
        got = [o.token_ids for o in LLM(model, block_size=block_size, num_blocks=16).generate(prompts, params)]
    assert len(ext.calls) > 0, "the flash-attn path never ran"
    assert want == got
