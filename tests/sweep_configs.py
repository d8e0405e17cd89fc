"""Tiny random configs for every causal-LM type of the installed transformers, built the way
transformers' own model testers build theirs (hidden 32, 2-4 layers, 4 heads / 2 KV heads,
intermediate 48, vocab 99, experts 4 / top-2), with every sliding window, chunk and sparse top-k
small enough that a 12-token continuation of a short prompt crosses it.

:func:`sweep_config` shrinks the type's default config generically (every size-like key the
config has), keeps one layer of each distinct layer type (``layer_types`` and the per-layer lists
that go with it), then applies the few per-type overrides in :data:`OVERRIDES` that a generic
rule cannot know (layer-index lists, patterns written as strings, encoder-decoder decoders used
stand-alone).
"""

from __future__ import annotations

import copy
from typing import Any

VOCAB = 99
PAD, BOS, EOS = 0, 1, 2
WINDOW = 5  # sliding windows / chunks / sparse top-k: below a prompt + 12 new tokens

# size-like keys, set wherever the default config has them (and they are not None)
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "emb_dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "num_decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2,
    "intermediate_size": 48, "ffn_dim": 48, "decoder_ffn_dim": 48, "encoder_ffn_dim": 48, "n_inner": 48,
    "ffn_hidden_size": 48, "dim_ff": 48, "d_inner": 48, "feed_forward_size": 48,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16,
    "expert_ffn_hidden_size": 16, "dense_intermediate_size": 48, "intermediate_size_mlp": 48,
    "shared_experts_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
    "prefix_dense_intermediate_size": 48,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "head_dim": 8, "attention_head_dim": 8, "d_head": 8, "dim_head": 8,
    "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512, "max_target_positions": 512,
    "max_source_positions": 512,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
    "o_lora_rank": 16,
    "index_topk": WINDOW, "index_n_heads": 2, "index_head_dim": 16, "indexer_n_heads": 2, "indexer_head_dim": 16,
    "indexer_kv_heads": 1,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    "attention_chunk_size": WINDOW, "window_size": WINDOW,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_heads": 4, "linear_head_dim": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_ngroups": 1, "n_mamba_heads": 4,
    "state_size": 8, "ssm_state_size": 8, "time_step_rank": 4, "mamba_dt_rank": 4,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "laurel_rank": 4,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "num_nextn_predict_layers": 0,
    "embedding_size": 32, "input_embedding_size": 32, "output_embedding_size": 32, "word_embed_proj_dim": 32,
    "attention_hidden_size": 32, "cross_attention_hidden_size": 32, "backbone_hidden_size": 32,
    "rotary_dim": 4, "chunk_size": 16, "mamba_chunk_size": 16,
    "unpadded_vocab_size": VOCAB, "n_groups": 1,
    "pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS, "decoder_start_token_id": BOS,
}
# keys whose default None means "derive it" (not "off"): set them anyway
_EVEN_IF_NONE = {"head_dim", "num_key_value_heads"}
# per-layer list keys that follow the kept layers
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_PER_LAYER = ("layer_types", "layers_block_type", "attention_layers", "mlp_layer_types", "per_layer_config",
              "block_types",
              "no_rope_layers", "num_attention_heads_per_layer", "mtp_layer_types", "layer_rope_theta",
              "attention_types_per_layer")

# what a generic rule cannot know: (sub)config keyword arguments per model type
_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
        "indexer_compress_ratio": 2}
_HYBRID_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2}
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {**_HYBRID_MAMBA, "num_hidden_layers": 2, "attn_layer_indices": [1]},
    "jamba": {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "granitemoehybrid": {**_HYBRID_MAMBA, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"num_hidden_layers": 2, "block_types": ["recurrent", "attention"], "lru_width": 32,
                        "num_key_value_heads": 1},
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
              "attention_hidden_size": 64},
    "zamba2": {"num_hidden_layers": 4, "hybrid_layer_ids": [1, 3], "mamba_headdim": 16, "n_mamba_heads": 4,
               "attention_hidden_size": 64,
               "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "falcon_h1": {**_HYBRID_MAMBA, "mamba_d_ssm": 64},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": _QSA},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "zaya": {"num_experts_per_tok": 1},
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    "gemma4_assistant": {"_defaults": {"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input": 0},
    "xlstm": {"hidden_size": 64, "embedding_dim": 64, "num_heads": 4, "chunk_size": 16, "qk_dim_factor": 1.0},
    "ernie4_5_moe": {"moe_k": 2},
    "mamba2": {"head_dim": 16},
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "dots3_note_text": {"num_key_value_heads": 4},
    "dots3_note": {"text_config": {"num_key_value_heads": 4},  # its vision / audio adapters take the towers' width
                   "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 32},
                   "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32}},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # BERT-like decoders as transformers' testers build them for causal LM (prepare_config_and_inputs_for_decoder):
    # is_decoder=True; BigBird with a cache runs original_full attention (it switches to it by itself)
    "megatron-bert": {"is_decoder": True},
    "rembert": {"is_decoder": True},
    "roformer": {"is_decoder": True},
    "big_bird": {"is_decoder": True, "attention_type": "original_full"},
    "dory": {"layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
             "num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2},
}


def layers_to_keep(layer_types: list[Any], at_least: int = 2) -> list[int]:
    """Indices of the first layer of each distinct type (then the next layers, up to ``at_least``)."""
    keep: list[int] = []
    seen: set[str] = set()
    for i, kind in enumerate(layer_types):
        key = repr(kind)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    for i in range(len(layer_types)):
        if len(keep) >= at_least:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for a tiny config from a default config's ``to_dict()`` (recursive)."""
    kwargs: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:
            kwargs[key] = shrink(value)
        elif key in SIZES and (value is not None or key in _EVEN_IF_NONE) and not isinstance(value, (list, dict)):
            kwargs[key] = SIZES[key]
    if defaults.get("kv_lora_rank") is not None:  # MLA: the rotary head dim is qk_rope_head_dim
        if "head_dim" in kwargs:
            kwargs["head_dim"] = SIZES["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]
    n_layers = next((defaults[k] for k in _LAYER_COUNTS if isinstance(defaults.get(k), int)), None)
    kinds = next((defaults[k] for k in _PER_LAYER if isinstance(defaults.get(k), list) and len(defaults[k]) == n_layers
                  and n_layers), None)
    if kinds is not None:
        keep = layers_to_keep(kinds)
        for key in _PER_LAYER:
            value = defaults.get(key)
            if isinstance(value, list) and len(value) == n_layers:
                kwargs[key] = [copy.deepcopy(value[i]) for i in keep]
        for key in _LAYER_COUNTS:
            if isinstance(defaults.get(key), int):
                kwargs[key] = len(keep)
    return kwargs


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not value.get("_replace"):
            out[key] = _merge(out[key], value)
        else:
            out[key] = {k: v for k, v in value.items() if k != "_replace"} if isinstance(value, dict) else value
    return out


def sweep_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` the sweep builds its model from."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}).get("_defaults", {})).to_dict()
    kwargs = _merge(shrink(defaults), {k: v for k, v in OVERRIDES.get(model_type, {}).items() if k != "_defaults"})
    return AutoConfig.for_model(model_type, **kwargs)
