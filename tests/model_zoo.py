"""Tiny random-weight models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128
PAD, EOS, BOS = 0, 1, 2

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                               tie_word_embeddings=False)
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_LIKE,
    "mistral": {**_LLAMA_LIKE, "sliding_window": 8},
    "qwen2": {**_LLAMA_LIKE},
    "qwen3": {**_LLAMA_LIKE, "head_dim": 16},
    "qwen3_moe": {**_LLAMA_LIKE, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1},
    "gemma": {**_LLAMA_LIKE, "head_dim": 16},
    "gemma2": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16},
    "gemma3_text": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {**_LLAMA_LIKE},
    "gpt_neox": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256, rotary_pct=0.5),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, word_embed_proj_dim=64),
    "mixtral": {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmo2": {**_LLAMA_LIKE},
    "starcoder2": {**_LLAMA_LIKE, "sliding_window": 8},
    "cohere": {**_LLAMA_LIKE},
    "phi": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, partial_rotary_factor=0.5),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True),
    "granite": {**_LLAMA_LIKE},
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=1,
                   multi_query=True, new_decoder_architecture=False, alibi=False),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "gpt_oss": {**_LLAMA_LIKE, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=1, topk_group=1,
                        max_position_embeddings=256),
}


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A float32 random-weight causal LM of ``model_type``, in eval mode, with sdpa attention."""
    torch.manual_seed(seed)
    kwargs = {**_COMMON, **FAMILIES[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_up(model)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model.eval()


def _scale_up(model: torch.nn.Module) -> None:
    """Random init gives near-uniform logits (many near-ties); widen them so greedy is decisive."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("lm_head" in name or "embed" in name or "wte" in name):
                p.mul_(4.0)


def left_padded_batch(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths from ids 3..vocab-1, left-padded: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------
# Helpers added for the HuggingFace patch tests (tests/test_patch_*.py). Additive only: the
# functions above keep their behaviour.


def config_kwargs(model_type: str, **overrides: Any) -> dict[str, Any]:
    """The config keyword arguments ``tiny_model(model_type, **overrides)`` uses."""
    return {**_COMMON, **FAMILIES[model_type], **overrides}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The config ``tiny_model(model_type, **overrides)`` builds its model from."""
    return AutoConfig.for_model(model_type, **config_kwargs(model_type, **overrides))


def model_from_config(model_type: str, config: Any, seed: int = 0) -> torch.nn.Module:
    """Like ``tiny_model`` but from a ready config (same seed and config -> same weights)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_up(model)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model.eval()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op CPU threads, then restore the previous setting.

    The zoo's models are tiny: one thread is faster than several, and on a shared, oversubscribed
    machine several OpenMP threads per process spin and make generate() up to 100x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_tokenizer(vocab_size: int = VOCAB) -> Any:
    """A character-level fast tokenizer over exactly ``vocab_size`` ids (no downloads).

    ids 0/1/2 are ``<pad>``/``</s>``/``<s>`` (PAD/EOS/BOS); every other id is one character
    (ASCII letters and digits first, as transformers' stop-string machinery tokenizes
    "abcdef", then Latin Extended-A letters). Decoding concatenates the characters, so the
    text of a token sequence ends with a given character exactly when its last token is it.
    """
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    alphabet = string.ascii_letters + string.digits
    alphabet += "".join(chr(0x100 + i) for i in range(vocab_size - 3 - len(alphabet)))
    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS}
    vocab.update({c: 3 + i for i, c in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                   bos_token="<s>")
