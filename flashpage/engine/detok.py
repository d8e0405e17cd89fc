"""Incremental detokenization and stop-string handling for one output stream.

Text is produced as deltas (decoding a small window of recent tokens, holding back incomplete
UTF-8), so streaming costs O(new tokens) per step. A stop string cuts the text before it;
while a suffix of the text could still grow into a stop string it is held back from streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REPLACEMENT = "\ufffd"


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text, with stop strings.

    Attributes:
        text: output text so far (cut before a stop string once one was found).
        sent: how many characters of ``text`` were already handed to a stream.
        stopped: a stop string was found.
        pending: decoded text of the last tokens not yet in ``text`` (it ends in an incomplete
            character, U+FFFD); shown by ``current_text``, confirmed by the next token or ``flush``.
    """

    tokenizer: Any
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    text: str = ""
    sent: int = 0
    stopped: bool = False
    pending: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0
    _longest_stop: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, token_ids: list[int], check_stop: bool = True) -> None:
        """Account for the tokens appended to ``token_ids`` (the whole output so far).

        ``check_stop=False`` (before ``min_tokens``) lets new text through without stop search.
        """
        if self.stopped:
            return
        prefix = self._decode(token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            self.pending = full[len(prefix):]
            return
        start = len(self.text)
        self.pending = ""
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        if check_stop:
            self._find_stop(start)

    def flush(self, token_ids: list[int], check_stop: bool = True) -> None:
        """Final update: take every remaining token, incomplete characters included."""
        if self.stopped:
            return
        prefix = self._decode(token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(token_ids[self._prefix_offset:])
        if len(full) > len(prefix):
            start = len(self.text)
            self.text += full[len(prefix):]
            if check_stop:
                self._find_stop(start)
        self.pending = ""
        self._prefix_offset = self._read_offset = len(token_ids)

    @property
    def current_text(self) -> str:
        """The output text as a full decode shows it now: ``text`` plus any incomplete tail."""
        return self.text if self.stopped else self.text + self.pending

    def _find_stop(self, start: int) -> None:
        if not self.stop:
            return
        lo = max(0, start - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not yet streamed; withholds a tail that may still become a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _held_back(self) -> int:
        for n in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
