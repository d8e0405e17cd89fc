"""Tiny random-weight hybrid (linear-attention / SSM + attention) and state-space models, from configs.

One entry per model type: small sizes, a layer pattern that mixes state layers with attention
layers (state layers first, so layer 0 is never an attention layer), float32, and the zoo's
logit widening so greedy decoding is decisive. No downloads.
"""

from __future__ import annotations

from typing import Any

import torch
from model_zoo import _COMMON, EOS, PAD, _scale_up
from transformers import AutoConfig, AutoModelForCausalLM

_BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, num_hidden_layers=3)
_A, _L = "full_attention", "linear_attention"
_GATED_DELTA = dict(layer_types=[_L, _A, _L], head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=16)

HYBRIDS: dict[str, dict[str, Any]] = {
    "qwen3_next": {**_BASE, **_GATED_DELTA, **_MOE},
    "qwen3_5_text": {**_BASE, **_GATED_DELTA},
    "qwen3_5_moe_text": {**_BASE, **_GATED_DELTA, **_MOE},
    "nemotron_h": {**_BASE, "num_hidden_layers": 4, "layers_block_type": ["mamba", "attention", "moe", "mlp"],
                   "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 8,
                   "conv_kernel": 4, "expand": 2, "chunk_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_group": 1,
                   "topk_group": 1},
    "granitemoehybrid": {**_BASE, **_MAMBA2, "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 4,
                         "num_experts_per_tok": 2, "shared_intermediate_size": 32},
    "lfm2": {**_BASE, "layer_types": ["conv", _A, "conv"], "conv_L_cache": 3},
    "lfm2_moe": {**_BASE, "layer_types": ["conv", _A, "conv"], "conv_L_cache": 3, "num_dense_layers": 1,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "jamba": {**_BASE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8},
    "falcon_h1": {**_BASE, **_MAMBA2, "num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 128},
    "bamba": {**_BASE, **_MAMBA2, "attn_layer_indices": [1]},
    "mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2, time_step_rank=8),
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2, num_heads=8,
                   head_dim=16, n_groups=1, chunk_size=16),
    "falcon_mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
                         time_step_rank=8),
    "zamba": {**_BASE, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
              "mamba_expand": 2, "mamba_dt_rank": 8, "n_mamba_heads": 2, "attention_head_dim": 32},
    "zamba2": {**_BASE, "layers_block_type": ["mamba", "hybrid", "mamba"], "mamba_d_state": 8, "mamba_d_conv": 4,
               "mamba_expand": 2, "mamba_headdim": 16, "mamba_ngroups": 1, "chunk_size": 16,
               "attention_head_dim": 32, "num_mem_blocks": 1, "use_mem_rope": True},
    "olmo_hybrid": {**_BASE, "layer_types": [_L, _A, _L]},
    "lfm3": {**_BASE, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
             "layer_types": ["conv", "sliding_attention", _A, "conv"]},
    "lara_mini": {**_BASE, **_GATED_DELTA, "sliding_window": 6, "layer_types": [_L, "sliding_attention", _A],
                  **_MOE},
    "kimi_linear": {**_BASE, "layer_types": [_L, _A, _L], "num_key_value_heads": 4, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "linear_head_dim": 16,
                    "linear_num_heads": 4, "linear_conv_kernel_dim": 4, "moe_intermediate_size": 32,
                    "num_local_experts": 4, "num_experts_per_tok": 2, "mlp_layer_types": ["dense", "sparse", "sparse"]},
    "bailing_hybrid": {**_BASE, "layer_types": [_L, _A, _L], "num_key_value_heads": 4, "kv_lora_rank": 16,
                       "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 16,
                       "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                       "topk_group": 1, "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse", "sparse"],
                       "num_mtp_layers": 0},
    "zaya": {**_BASE, "num_hidden_layers": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
             "router_hidden_size": 16},  # every layer "hybrid": K/V and a conv state in one layer
}
PURE_SSM = ("mamba", "mamba2", "falcon_mamba")  # no attention layer at all
DENSE_VIEW = ("kimi_linear", "bailing_hybrid")  # MLA attention (latents expanded after the cache): the dense view


def tiny_hybrid(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A float32 random-weight ``model_type`` model from :data:`HYBRIDS`, in eval mode."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **HYBRIDS[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_up(model)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model.eval()
