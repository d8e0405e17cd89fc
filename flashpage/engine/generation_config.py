"""What ``LLM`` takes from the model's ``generation_config`` (as vLLM's ``generation_config="auto"``).

- **Sampling defaults**, exactly as vLLM: the non-default values of ``repetition_penalty``,
  ``presence_penalty``, ``frequency_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
  ``max_new_tokens`` (as ``max_tokens``) become the SamplingParams of requests given none
  (:meth:`LLM.get_default_sampling_params`). ``do_sample`` is not read (vLLM does not either).
- **Logits processors** that change which token ``generate()`` picks and that the engine can apply
  per sequence: ``forced_eos_token_id`` (the last allowed token is EOS), ``forced_bos_token_id``,
  ``suppress_tokens``, ``begin_suppress_tokens``, ``no_repeat_ngram_size`` and
  ``encoder_no_repeat_ngram_size`` (for a decoder-only model: no n-gram of the prompt is repeated),
  with transformers' semantics, so ``LLM`` equals ``generate()`` on models that set them
  (BART-family decoders, whisper).
  vLLM ignores these; flashpage applies them. Log-probabilities stay those of the raw logits.
- Anything else in the generation config that would change ``generate()``'s tokens is listed in a
  warning when the LLM is built (:func:`unapplied_fields`).

``LLM(generation_config="vllm")`` ignores the model's generation config entirely (vLLM's neutral
defaults, no processors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.engine.sequence import Seq

SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens")
PROCESSOR_FIELDS = ("forced_eos_token_id", "forced_bos_token_id", "suppress_tokens", "begin_suppress_tokens",
                    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size")
# fields that do not change which tokens a single-sequence sampled or greedy decode picks, or that the
# engine honours elsewhere (eos_token_id: stop ids; max_length: superseded by max_tokens, as in vLLM)
_INERT = {"eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "do_sample",
          "output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
          "_from_model_config", "transformers_version", "max_length", "cache_implementation", "cache_config",
          "return_legacy_cache", "is_assistant", "compile_config", "disable_compile", "num_assistant_tokens",
          "num_assistant_tokens_schedule", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
          "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind",
          "dola_layers", "low_memory", "trust_remote_code", "stop_strings", "generation_kwargs", "max_time",
          "num_return_sequences", "output_router_logits", "token_healing", "remove_invalid_values",
          "is_encoder_decoder", "forced_decoder_ids", "lang_to_id", "task_to_id", "no_timestamps_token_id",
          "alignment_heads", "max_initial_timestamp_index", "return_timestamps", "prev_sot_token_id",
          "language", "task", "is_multilingual", "suppress_ids"}
MODES = ("auto", "vllm")


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"LLM(generation_config={mode!r}): use 'auto' (the model's generation_config: its sampling "
                         "defaults and processors, as vLLM's default) or 'vllm' (ignore it: vLLM's neutral defaults)")
    return str(mode)


def config_diff(model: Any) -> dict[str, Any]:
    """The model's generation_config values that differ from transformers' defaults."""
    gen = getattr(model, "generation_config", None)
    if gen is None or not hasattr(gen, "to_diff_dict"):
        return {}
    return dict(gen.to_diff_dict())


def sampling_defaults(diff: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from a generation-config diff (vLLM's get_diff_sampling_param)."""
    out = {k: diff[k] for k in SAMPLING_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def unapplied_fields(diff: dict[str, Any]) -> list[str]:
    """Generation-config fields that would change generate()'s tokens but the engine does not apply."""
    used = set(SAMPLING_FIELDS) | set(PROCESSOR_FIELDS) | _INERT
    return sorted(k for k, v in diff.items() if k not in used and v is not None and not k.startswith("_"))


def _ids(value: Any, vocab: int) -> list[int]:
    if value is None:
        return []
    items = [value] if isinstance(value, int) else list(value)
    return sorted({int(t) for t in items if 0 <= int(t) < vocab})


@dataclass(frozen=True)
class ModelProcessors:
    """transformers' logits processors from a generation config, applied per sequence by the sampler.

    Attributes:
        forced_eos: ids set to 0 (all others -inf) when the next token is the last one allowed.
        forced_bos: id forced as the first token of a one-token sequence.
        suppress: ids always -inf.
        begin_suppress: ids -inf for the first generated token (the second after a forced BOS).
        no_repeat_ngram_size: n: a token completing an n-gram already in prompt + output is -inf (0: off).
        prompt_no_repeat_ngram_size: n: a token completing an n-gram of the prompt is -inf (0: off;
            transformers' ``encoder_no_repeat_ngram_size``, whose "encoder input" is the prompt here).
    """

    forced_eos: tuple[int, ...] = ()
    forced_bos: int | None = None
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    no_repeat_ngram_size: int = 0
    prompt_no_repeat_ngram_size: int = 0

    @classmethod
    def from_diff(cls, diff: dict[str, Any], vocab: int) -> ModelProcessors | None:
        """The processors a generation-config diff asks for; None when it asks for none."""
        bos = diff.get("forced_bos_token_id")
        out = cls(tuple(_ids(diff.get("forced_eos_token_id"), vocab)),
                  int(bos) if bos is not None and 0 <= int(bos) < vocab else None,
                  tuple(_ids(diff.get("suppress_tokens"), vocab)),
                  tuple(_ids(diff.get("begin_suppress_tokens"), vocab)),
                  int(diff.get("no_repeat_ngram_size") or 0), int(diff.get("encoder_no_repeat_ngram_size") or 0))
        return out if out != cls() else None

    def names(self) -> list[str]:
        """The generation-config fields these processors implement (for messages)."""
        fields = zip(PROCESSOR_FIELDS, (self.forced_eos, self.forced_bos, self.suppress, self.begin_suppress,
                                        self.no_repeat_ngram_size, self.prompt_no_repeat_ngram_size), strict=True)
        return [name for name, value in fields if value not in ((), None, 0)]

    def apply(self, scores: torch.Tensor, seqs: Sequence[Seq]) -> None:
        """Process ``scores`` (N, V) float in place, row i for ``seqs[i]`` (transformers' semantics)."""
        neg_inf = float("-inf")
        if self.suppress:
            scores[:, list(self.suppress)] = neg_inf
        for i, s in enumerate(seqs):
            row = scores[i]
            if self.begin_suppress and s.num_output == self._begin_index(s):
                row[list(self.begin_suppress)] = neg_inf
            banned = banned_ngram_tokens(s.token_ids, self.no_repeat_ngram_size) if self.no_repeat_ngram_size else []
            if self.prompt_no_repeat_ngram_size:
                banned += banned_prompt_ngram_tokens(s.token_ids, s.num_prompt, self.prompt_no_repeat_ngram_size)
            if banned:
                row[[t for t in banned if t < row.shape[0]]] = neg_inf
            if self.forced_bos is not None and len(s.token_ids) == 1:
                row.fill_(neg_inf)
                row[self.forced_bos] = 0.0
            if self.forced_eos and self._last_token(s):
                row.fill_(neg_inf)
                row[list(self.forced_eos)] = 0.0

    def _begin_index(self, s: Seq) -> int:
        # transformers: the first generated position, one later when a one-token prompt gets a forced BOS
        return 1 if self.forced_bos is not None and s.num_prompt == 1 else 0

    @staticmethod
    def _last_token(s: Seq) -> bool:
        """The next token is the last this sequence may produce (transformers: ``cur_len == max_length - 1``;
        forced whatever ``ignore_eos`` says, as generate() forces it whatever stops it)."""
        p = s.group.params
        return s.num_output + 1 >= p.max_tokens or len(s.token_ids) + 1 >= s.group.max_total_tokens


def banned_prompt_ngram_tokens(tokens: Sequence[int], num_prompt: int, n: int) -> list[int]:
    """Tokens that would complete, after the last ``n - 1`` of ``tokens``, an n-gram of the prompt
    ``tokens[:num_prompt]`` (transformers' EncoderNoRepeatNGramLogitsProcessor on a decoder-only model)."""
    prompt = list(tokens[:num_prompt])
    prefix = tuple(tokens[len(tokens) + 1 - n:]) if n > 1 else ()
    return sorted({prompt[i + n - 1] for i in range(len(prompt) - n + 1) if tuple(prompt[i:i + n - 1]) == prefix})


def banned_ngram_tokens(tokens: Sequence[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram of ``tokens`` (transformers' NoRepeatNGramLogitsProcessor)."""
    if len(tokens) < n:
        return []
    prefix = tuple(tokens[len(tokens) + 1 - n:]) if n > 1 else ()
    return sorted({tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i:i + n - 1]) == prefix})
