"""Request limits shared by ``LLM`` and the server: does prompt + ``max_tokens`` fit the model's context?"""

from __future__ import annotations


def context_overflow(num_prompt: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why ``num_prompt`` prompt tokens plus ``max_tokens`` new ones exceed ``max_model_len``
    (vLLM's wording, both numbers named), or None when they fit."""
    total = num_prompt + max_tokens
    if total <= max_model_len:
        return None
    room = max_model_len - num_prompt
    fix = f"lower max_tokens to at most {room}" if room >= 1 else "shorten the prompt"
    return (f"This model's maximum context length (max_model_len) is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({num_prompt} in the prompt, {max_tokens} in max_tokens): {fix}")
