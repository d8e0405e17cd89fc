"""GPU: compiled steps and CUDA-graph replay give the eager tokens.

``LLM(compile=True)`` on CUDA captures decode buckets as CUDA graphs (torch.compile's
"reduce-overhead" mode); a patched model's forward compiled with ``fullgraph=True`` serves
``generate()``. Both must produce eager flashpage's (and transformers') greedy tokens. Skipped
without CUDA; one command, a few minutes on one GPU:

    python -m pytest -q -m gpu tests/gpu/test_gpu_compile.py tests/gpu/test_kernels_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashpage
from flashpage import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW = 48


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 80, (12,), generator=gen).tolist()
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llm_cuda_graph_decode_equals_eager(dtype: torch.dtype) -> None:
    model = _model(dtype)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    eager = [o.token_ids for o in LLM(model, compile=False).generate(_prompts(), params, use_tqdm=False)]
    llm = LLM(model, compile=True)
    assert llm._compiled is not None
    first = [o.token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    replay = [o.token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]  # graphs replayed
    assert llm.stats().compiled_steps >= 2 * (NEW - 2)
    assert first == replay == eager


def test_compiled_generate_equals_eager_on_cuda() -> None:
    model = _model(torch.float32)
    ids = torch.tensor(_prompts()[:1], device="cuda")
    with torch.inference_mode():
        reference = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    flashpage.patch(model)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference)
