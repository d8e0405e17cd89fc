"""Structured outputs: constrain what a request generates to a JSON schema, a regex, a choice or a grammar.

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` (vLLM's names). The
constraint is compiled by llguidance (chosen over xgrammar by measurement, see docs/structured-outputs.md
and :mod:`flashpage.bench.grammar_libs`) into a grammar; every sample of a constrained
request gets its own matcher (``n > 1``: a fork of the first sample's, before either generated
anything). Each engine step, :meth:`GrammarEngine.apply` fills the token bitmask of the constrained
rows only (one parallel llguidance call) and sets the logits of every disallowed token to ``-inf``
before the sampler runs, so greedy, seeded and batched sampling, penalties and top-k/p all pick among
allowed tokens; EOS is allowed only where the grammar accepts. :meth:`GrammarEngine.accept` feeds the
chosen token to the matcher; a grammar that is complete ends its sample with ``finish_reason="stop"``.
A matcher follows its sample's output tokens, not the KV cache: preemption by recompute keeps the
output and so the matcher; were they ever to differ, the matcher is rolled back or replayed first.

Steps without a constrained row never reach this module (LLM creates a GrammarEngine on the first
constrained request); llguidance is imported only then (``pip install 'flashpage[structured]'``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.errors import install_hint

log = logging.getLogger("flashpage.structured")
GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept (64 requests with one schema compile it once)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (exactly one of the first five fields), as vLLM names them.

    Attributes:
        json: a JSON schema (dict, or its JSON text): the output is a JSON document valid against it.
        regex: the output matches this regular expression (Rust ``regex`` syntax) in full.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's dialect; GBNF, recognised by
            ``::=``, is converted), start rule ``start`` (Lark) or ``root`` (GBNF).
        json_object: the output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without whitespace between tokens (``{"a":1}``). flashpage's default
            is True, unlike vLLM's: free whitespace lets a weak model loop on newlines until max_tokens.
        whitespace_pattern: a regex for the whitespace JSON may hold between tokens (overrides the above).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object; got {type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string; got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings; "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true or false; got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.whitespace_pattern], sort_keys=True)


def as_structured(value: Any) -> StructuredOutputsParams | None:
    """``SamplingParams.structured_outputs`` given as the dataclass, a dict of its fields, or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) {unknown}; "
                             f"known: {sorted(StructuredOutputsParams.__dataclass_fields__)}")
        return StructuredOutputsParams(**value)
    raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams (or a dict of its "
                     f"fields); got {type(value).__name__}")


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ValueError("structured outputs need the llguidance package: "
                         + install_hint("llguidance", "structured")) from None
    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked against a tokenizer)."""
    llg = _llguidance()
    M = llg.LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if spec.whitespace_pattern is not None:
            options["whitespace_pattern"] = spec.whitespace_pattern
        schema = spec.json if kind == "json" else {"type": "object"}
        return M.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return M.grammar_from_regex(spec.regex)
    if kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice or ()))
    text = spec.grammar or ""
    if "::=" in text:  # GBNF (llama.cpp / xgrammar style)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:
            raise ValueError(f"structured_outputs.grammar: not a valid GBNF grammar: {exc}") from None
    return M.grammar_from_lark(text)


@dataclass(eq=False)
class SeqGrammar:
    """One sample's matcher and how many of its output tokens it consumed."""

    matcher: Any
    consumed: int = 0

    def fork(self) -> SeqGrammar:
        return SeqGrammar(self.matcher.deep_copy(), self.consumed)


class GrammarEngine:
    """Compiles constraints (cached) and masks the logits of constrained rows.

    Args:
        tokenizer: the model's fast HuggingFace tokenizer.
        vocab_size: the width V of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the engine's EOS ids, the only tokens that end a grammar.
        num_threads: llguidance's mask threads (None: its default, 80% of the CPUs up to 32).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int | None = None) -> None:
        llg = _llguidance()
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer: LLM(model, tokenizer)")
        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token id (the model's generation_config has none)")
        self._llg = llg
        self.vocab_size = int(vocab_size)
        self.eos_token_id = int(min(eos_token_ids))  # what a row with no allowed token is given (it then ends)
        n_vocab = max(self.vocab_size, len(tokenizer))
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids))
        except ValueError as exc:
            raise ValueError(f"structured outputs need a fast (Rust) HuggingFace tokenizer: {exc}") from None
        self.executor = llg.LLExecutor(num_threads=num_threads)
        self._matchers: OrderedDict[str, Any] = OrderedDict()  # cache key -> pristine matcher
        self._lock = threading.Lock()
        self._bitmask = torch.empty((0, (n_vocab + 31) // 32), dtype=torch.int32)

    # ---------------------------------------------------------------------------------- requests
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A pristine matcher of ``spec`` (cached: new samples get a ~20 us copy instead of a parse that
        takes 10-100 ms); ValueError naming the field when it is invalid. Thread-safe: a server compiles
        on its worker threads, so the engine thread only copies."""
        key = spec.cache_key()
        with self._lock:
            matcher = self._matchers.get(key)
            if matcher is not None:
                self._matchers.move_to_end(key)
                return matcher
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith("structured_outputs") else
                             f"structured_outputs.{spec.kind}: {msg}") from None
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} cannot be used: {matcher.get_error().strip()}")
        with self._lock:
            self._matchers[key] = matcher
            if len(self._matchers) > GRAMMAR_CACHE_SIZE:
                self._matchers.popitem(last=False)
        return matcher

    def new_matcher(self, spec: StructuredOutputsParams) -> SeqGrammar:
        return SeqGrammar(self.compile(spec).deep_copy())

    # ---------------------------------------------------------------------------------- per step
    def apply(self, logits: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
        """Logits with disallowed tokens at -inf in the rows whose sequence has a grammar.

        A row left with no allowed token (a matcher in an error state: a bug) gets EOS alone, so the
        sampler never sees a row of -inf; :meth:`accept` then ends that sample with "abort".

        Args:
            logits: (N, V) next-token logits, row i for ``seqs[i]``.
            seqs: the N sequences; ``seq.grammar`` is a :class:`SeqGrammar` or None.

        Returns:
            (N, V): ``logits`` itself when no row has a grammar, else a new tensor (the model's output,
            perhaps a CUDA graph's buffer, is never written).
        """
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return logits
        for i in rows:
            self._sync(seqs[i])
        bitmask = self._rows(len(rows))
        self._llg.torch.fill_next_token_bitmask_par(
            self.executor, [(seqs[i].grammar.matcher, j) for j, i in enumerate(rows)], bitmask)
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
        dead = ~allowed.any(dim=1)  # no sync: EOS is or-ed in on the device
        allowed[:, self.eos_token_id] |= dead
        if len(rows) != logits.shape[0]:
            full = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            full[torch.tensor(rows, device=logits.device)] = allowed
            allowed = full
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, seq: Any, token: int) -> str | None:
        """Feed ``seq``'s newly appended ``token`` to its matcher; the finish reason it implies, if any:
        "stop" when the grammar is complete, "abort" if the matcher refused the token (a bug: logged)."""
        g: SeqGrammar = seq.grammar
        if g.consumed != seq.num_output - 1:
            g.consumed = self._replay(g, seq.output_ids[:-1])
        ok = g.matcher.consume_token(token)
        g.consumed += 1
        if not ok or g.matcher.is_error():
            log.warning("request %s: the grammar refused token %d: %s", seq.group.request_id, token,
                        g.matcher.get_error())
            return "abort"
        return "stop" if g.matcher.is_stopped() else None

    # ---------------------------------------------------------------------------------- internals
    def _sync(self, seq: Any) -> None:
        """Make the matcher reflect exactly the sample's output tokens (roll back or replay)."""
        g: SeqGrammar = seq.grammar
        if g.consumed != seq.num_output:
            g.consumed = self._replay(g, seq.output_ids)

    @staticmethod
    def _replay(g: SeqGrammar, output: list[int]) -> int:
        if g.consumed > len(output):
            g.matcher.rollback(g.consumed - len(output))
        else:
            g.matcher.consume_tokens(output[g.consumed:])
        return len(output)

    def _rows(self, n: int) -> torch.Tensor:
        if self._bitmask.shape[0] < n:
            pin = torch.cuda.is_available()
            self._bitmask = torch.empty((max(n, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                                        dtype=torch.int32, pin_memory=pin)
        return self._bitmask[:n]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, ceil(V'/32)) int32 bitmask (bit j of word w: token 32w+j allowed) -> (R, vocab) bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits).bitwise_and_(1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]
