"""xgrammar vs llguidance: token-mask time per step at a batch of concurrent requests, and correctness.

How flashpage chose its grammar library (docs/structured-outputs.md). For each library and tokenizer,
``batch`` matchers (one per request, over a mix of JSON schemas, a regex and a choice) walk forward
together: every step fills the (batch, ceil(V/32)) int32 bitmask of all live matchers (timed: the
per-step cost the engine pays), then each row picks a token the mask allows (seeded; a structural
token such as ``"`` ``}`` ``]`` or EOS a quarter of the time, so walks finish) and the matcher accepts
it. Correctness: every walk that ends with EOS must decode to text that parses and validates against
its schema (or matches its regex / is one of its choices); a set of hand-made valid and invalid
documents must be accepted / rejected token by token.

Tokenizers: the built-in tiny model's (4096 tokens) and a 32768-token byte-level BPE trained here,
offline, on the Python standard library's source (``tokenizer_32k``; built once, ~1 min, cached).

    python -m flashpage.bench.grammar_libs [--batch 64] [--steps 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["city", "tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["point", "label"], "additionalProperties": False},
]
REGEX = r"[A-Z][a-z]{1,8} [0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]
# compact JSON (no spaces): both libraries are run without free whitespace, as flashpage runs them
VALID_DOCS = [(0, '{"name":"Ann","age":41}'), (1, '{"city":"Oslo","tags":["a","bc"],"ok":true}'),
              (2, '{"point":{"x":1.5,"y":-2},"label":null}'), (0, '{"name":"a\\"b","age":0}')]
INVALID_DOCS = [(0, '{"name":"Ann","age":151}'), (0, '{"name":"Ann"}'), (1, '{"city":"Rome","tags":["a"],"ok":true}'),
                (1, '{"city":"Oslo","tags":[],"ok":true}'), (2, '{"point":{"x":1},"label":3}'),
                (0, '{"name":"a\x01b","age":1}'), (0, '{"name":"Ann","age":4,"x":1}')]
STRUCTURAL = ['"', "}", "]", ",", "0", "1", "a", " "]


@dataclass
class Target:
    """One request's constraint: kind 'json' (schema index), 'regex' or 'choice'."""

    kind: str
    schema: int = 0

    def check(self, text: str) -> bool:
        if self.kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        if self.kind == "choice":
            return text in CHOICES
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMAS[self.schema])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True


@dataclass
class LibResult:
    library: str
    tokenizer: str
    vocab: int
    batch: int
    steps: int
    mask_ms_per_step: list[float] = field(default_factory=list)  # one per step: all live rows' masks
    compile_ms: float = 0.0
    finished: int = 0
    valid: int = 0
    docs_ok: int = 0
    docs_total: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ms = self.mask_ms_per_step
        return {"library": self.library, "tokenizer": self.tokenizer, "vocab": self.vocab, "batch": self.batch,
                "steps": self.steps, "mask_ms_per_step_median": round(statistics.median(ms), 3),
                "mask_ms_per_step_p90": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 3),
                "mask_us_per_row": round(1e3 * statistics.median(ms) / self.batch, 2),
                "compile_ms": round(self.compile_ms, 1), "walks_finished": self.finished,
                "walks_valid": self.valid, "docs_ok": f"{self.docs_ok}/{self.docs_total}",
                "errors": self.errors[:3]}


# --------------------------------------------------------------------------------------- adapters
class _Lib:
    """The few operations the benchmark needs, per library."""

    name = ""

    def __init__(self, tokenizer: Any, threads: int) -> None:
        raise NotImplementedError

    def compile(self, target: Target) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, m: Any, token: int) -> bool: ...
    def accepting(self, m: Any) -> bool: ...


class _XGrammar(_Lib):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, target: Target) -> Any:
        if target.kind == "json":
            return self.compiler.compile_json_schema(json.dumps(SCHEMAS[target.schema]), any_whitespace=False,
                                                     separators=(",", ":"))
        if target.kind == "regex":
            return self.compiler.compile_regex(REGEX)
        return self.compiler.compile_regex("|".join(re.escape(c) for c in CHOICES))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def accepting(self, m: Any) -> bool:
        return bool(m.is_terminated())


class _LLGuidance(_Lib):
    name = "llguidance"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.fill_par = llguidance.torch.fill_next_token_bitmask_par

    def compile(self, target: Target) -> Any:
        M = self.llg.LLMatcher
        if target.kind == "json":
            grammar = M.grammar_from_json_schema(json.dumps(SCHEMAS[target.schema]),
                                                 defaults={"whitespace_flexible": False})
        elif target.kind == "regex":
            grammar = M.grammar_from_regex(REGEX)
        else:
            grammar = M.grammar_from_regex("|".join(re.escape(c) for c in CHOICES))
        M.validate_grammar(grammar, self.tok)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.fill_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token)) and not m.is_error()

    def accepting(self, m: Any) -> bool:
        return bool(m.is_stopped())


LIBS: dict[str, Callable[[Any, int], _Lib]] = {"xgrammar": _XGrammar, "llguidance": _LLGuidance}


# ------------------------------------------------------------------------------------------- run
def _targets(batch: int) -> list[Target]:
    kinds = [Target("json", 0), Target("json", 1), Target("json", 2), Target("regex"), Target("choice")]
    return [kinds[i % len(kinds)] for i in range(batch)]


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten()


def run_library(lib_name: str, tokenizer: Any, tok_name: str, batch: int, steps: int, seeds: list[int],
                threads: int) -> LibResult:
    """One library on one tokenizer: ``len(seeds)`` rounds of ``batch`` walks of at most ``steps`` tokens."""
    lib = LIBS[lib_name](tokenizer, threads)
    res = LibResult(lib_name, tok_name, len(tokenizer), batch, steps)
    targets = _targets(batch)
    t0 = time.perf_counter()
    compiled = {(t.kind, t.schema): lib.compile(t) for t in targets}
    res.compile_ms = 1e3 * (time.perf_counter() - t0)
    for seed in seeds:
        _walk(lib, tokenizer, [compiled[(t.kind, t.schema)] for t in targets], targets, steps, seed, res)
    _check_docs(lib, tokenizer, res)
    return res


def _walk(lib: _Lib, tokenizer: Any, grammars: list[Any], targets: list[Target], steps: int, seed: int,
          res: LibResult) -> None:
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    structural = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(s))[0] for s in STRUCTURAL} | {eos}
    matchers = [lib.matcher(g) for g in grammars]
    out: list[list[int]] = [[] for _ in targets]
    live = list(range(len(targets)))
    rng = random.Random(seed)
    bitmask = torch.empty((len(targets), (vocab + 31) // 32), dtype=torch.int32)
    for _ in range(steps):
        if not live:
            break
        t = time.perf_counter()
        lib.fill([matchers[i] for i in live], bitmask[:len(live)])
        res.mask_ms_per_step.append(1e3 * (time.perf_counter() - t))
        still = []
        for row, i in enumerate(live):
            allowed = _allowed(bitmask[row], vocab).tolist()
            if not allowed:
                res.errors.append(f"row {i}: empty mask")
                continue
            pref = [a for a in allowed if a in structural]
            tok = rng.choice(pref) if pref and rng.random() < 0.25 else rng.choice(allowed)
            if not lib.accept(matchers[i], tok):
                res.errors.append(f"row {i}: masked-in token {tok} refused")
                continue
            if tok == eos:
                res.finished += 1
                text = tokenizer.decode(out[i])
                if targets[i].check(text):
                    res.valid += 1
                else:
                    res.errors.append(f"row {i}: invalid output {text!r}")
                continue
            out[i].append(tok)
            still.append(i)
        live = still


def _check_docs(lib: _Lib, tokenizer: Any, res: LibResult) -> None:
    """Valid documents are accepted token by token and end accepting; invalid ones are refused."""
    for docs, want in ((VALID_DOCS, True), (INVALID_DOCS, False)):
        for schema, text in docs:
            m = lib.matcher(lib.compile(Target("json", schema)))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ok = all(lib.accept(m, t) for t in ids)
            res.docs_total += 1
            if ok == want:
                res.docs_ok += 1
            else:
                res.errors.append(f"{'valid' if want else 'invalid'} doc {text!r}: accepted={ok}")


def tokenizer_32k(cache_dir: str | None = None) -> Any:
    """A 32768-token byte-level BPE trained on the tiny corpus plus the standard library's source (cached)."""
    from transformers import AutoTokenizer

    folder = Path(cache_dir or os.path.join(tempfile.gettempdir(), "flashpage-bench-tok32k"))
    if not (folder / "tokenizer.json").is_file():
        from flashpage.tiny.corpus import build_corpus, stdlib_dir
        from flashpage.tiny.train import train_tokenizer

        print("[grammar_libs] training a 32k BPE on the standard library (about a minute) ...", file=sys.stderr)
        docs = build_corpus() + [p.read_text(errors="ignore") for p in sorted(stdlib_dir().rglob("*.py"))[:3000]]
        train_tokenizer(docs, 32768).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def run(batch: int = 64, steps: int = 64, seeds: int = 3, threads: int = 1,
        libraries: tuple[str, ...] = ("xgrammar", "llguidance")) -> list[dict[str, Any]]:
    from flashpage.tiny import load_tiny_model

    _, tiny = load_tiny_model()
    rows = []
    for tok_name, tok in (("tiny (4096)", tiny), ("stdlib BPE (32768)", tokenizer_32k())):
        for name in libraries:
            rows.append(run_library(name, tok, tok_name, batch, steps, list(range(seeds)), threads).summary())
            print(f"[grammar_libs] {rows[-1]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="mask threads per library (default 1)")
    p.add_argument("--seeds", type=int, default=3, help="rounds of walks, seeds 0.. (default 3)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = run(args.batch, args.steps, args.seeds, args.threads)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        keys = ["library", "tokenizer", "mask_ms_per_step_median", "mask_ms_per_step_p90", "mask_us_per_row",
                "compile_ms", "walks_finished", "walks_valid", "docs_ok"]
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(str(r[k]) for k in keys))
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
