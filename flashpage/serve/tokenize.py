"""Tokenization and chat templating for the server, on a small pool of worker threads.

Neither the event loop (which must keep answering ``/health`` and streaming other requests) nor the
engine thread (which must keep stepping) ever encodes a prompt: the handlers await this pool, and
the engine receives token ids. Each worker thread uses its own copy of the tokenizer (a Rust
tokenizer used from two threads at once can fail with "Already borrowed"); the Rust encoder releases
the GIL, so a huge prompt delays only its own request.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_WORKERS = 2


class TokenizerPool:
    """Run tokenizer work on ``workers`` threads, each with its own deep copy of ``tokenizer``."""

    def __init__(self, tokenizer: Any, workers: int = DEFAULT_WORKERS, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's processor (images), copied per thread as well
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flashpage-tokenize")

    def _own(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:  # not copyable: share it (correct unless two threads encode at once)
                tok = self.tokenizer
            self._local.tokenizer = tok
        return tok

    def _own_processor(self) -> Any:
        proc = getattr(self._local, "processor", None)
        if proc is None and self.processor is not None:
            try:
                proc = copy.deepcopy(self.processor)
            except Exception:  # not copyable: share it
                proc = self.processor
            self._local.processor = proc
        return proc

    async def run_with_processor(self, fn: Callable[[Any, Any], T]) -> T:
        """``fn(tokenizer, processor)`` on a worker thread, with that thread's copies."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._own(), self._own_processor()))

    async def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` on a worker thread, with that thread's tokenizer."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._own()))

    async def encode(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt, as ``LLM`` encodes text (special tokens added); id lists pass through."""
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return [list(p) for p in prompts]
        encoded = iter(await self.run(lambda tok: [list(ids) for ids in tok(texts)["input_ids"]]))
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    async def decode(self, ids: list[int]) -> str:
        return await self.run(lambda tok: tok.decode(ids, skip_special_tokens=False))

    async def chat(self, messages: list[dict[str, Any]], template: str, add_generation_prompt: bool,
                   **template_kwargs: Any) -> list[int]:
        """The chat template applied to ``messages`` (``template_kwargs``, e.g. ``tools``, passed to
        ``apply_chat_template``), then encoded without adding special tokens again."""

        def work(tok: Any) -> list[int]:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=template, **template_kwargs)
            return list(tok(text, add_special_tokens=False)["input_ids"])

        return await self.run(work)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
