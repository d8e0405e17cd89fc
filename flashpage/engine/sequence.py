"""Engine state: a Group is one user request; each of its ``n`` samples is a Seq in the KV cache."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.engine.detok import Detokenizer
from flashpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from flashpage.engine.params import SamplingParams

_seq_ids = itertools.count(1)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One output stream: prompt + generated tokens, and how many of them are in the cache.

    ``num_computed`` tokens have K/V in the cache; the rest (at least the last sampled token while
    running) are computed by the next steps. When ``num_computed == len(token_ids)`` after a step,
    the step's logits for this sequence yield its next token.
    """

    group: Group
    index: int
    token_ids: list[int]
    seed: int | None = None  # this sample's generator seed, in [0, 2**63); None: the global RNG
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    detok: Detokenizer | None = None
    streamed_tokens: int = 0
    final_streamed: bool = False
    in_cache: bool = False
    grammar: Any = None  # structured outputs: this sample's SeqGrammar (flashpage.engine.structured)
    spec: Any = None  # speculative decoding: this sample's SeqSpec (flashpage.engine.spec), made on first use
    _generator: torch.Generator | None = field(default=None, repr=False)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This sample's own generator on ``device`` (the logits' device), or None when unseeded.

        Created on first use (a CPU generator cannot draw for CUDA logits, and vice versa).
        """
        if self.seed is None:
            return None
        gen = self._generator
        if gen is None or gen.device != torch.device(device):
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generator = gen
        return gen

    def mark_finished(self, reason: str) -> None:
        """End this sample (once); its group counts it, so ``Group.finished`` is O(1)."""
        if self.status is not SeqStatus.FINISHED:
            self.group.num_finished += 1
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason

    def cache_keys(self, start: int, end: int, extra: list[int] | None = None) -> list[Any]:
        """Prefix-cache keys of tokens [start, end) (then ``extra`` proposed tokens): the ids, salted with the
        request's image hash from its first image row on (engine/multimodal.py)."""
        ids = self.token_ids[start:end] + (extra or [])
        mm = self.group.mm
        return ids if mm is None else mm.cache_keys(ids, start)

    @property
    def num_prompt(self) -> int:
        return len(self.group.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens still to compute before this sequence can emit its next token."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Group:
    """One request: its prompt, parameters, samples and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    tokenizer: Any = None
    seqs: list[Seq] = field(default_factory=list)
    streamed: bool = False
    max_total_tokens: int = 0  # model positions cap (prompt + output)
    num_finished: int = 0  # samples finished so far (kept by Seq.mark_finished)
    # SamplingParams.prompt_logprobs: entry i for prompt token i, recorded in order (see prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    mm: Any = None  # images: the prompt's image embeddings (engine/multimodal.py PromptEmbeds), kept until it ends

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n

    def new_seq(self, index: int, token_ids: list[int]) -> Seq:
        seq = Seq(self, index, list(token_ids), sample_seed(self.params.seed, index))
        if self.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None:  # incremental text: O(new tokens) per step, not a full decode
            seq.detok = Detokenizer(self.tokenizer, self.params.stop_strings, self.params.skip_special_tokens)
        self.seqs.append(seq)
        return seq

    def to_output(self) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.output_ids, _text(s), s.finish_reason,
                                    list(s.logprobs) if s.logprobs is not None else None)
                   for s in sorted(self.seqs, key=lambda s: s.index)]
        prompt_lps = list(self.prompt_logprobs) if self.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs,
                             self.finished, self.metrics, prompt_lps)


SEED_MODULUS = 1 << 63  # torch.Generator.manual_seed takes a signed 64-bit value


def sample_seed(seed: int | None, index: int) -> int | None:
    """The generator seed of sample ``index`` of a request seeded with ``seed`` (any int >= 0).

    Reduced into [0, 2**63) deterministically, so arbitrarily large seeds (``time.time_ns()``)
    work; sample 0 of a small seed keeps the value it always had.
    """
    if seed is None:
        return None
    return (seed * 1_000_003 + index) % SEED_MODULUS


def _text(seq: Seq) -> str:
    return seq.detok.current_text if seq.detok is not None else ""
