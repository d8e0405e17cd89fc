"""Exception types shared by every flashpage layer (no torch, no transformers imports here),
and the size-argument check every layer's constructor uses.

Each error says what was wrong, what was expected and what to do about it. The classes also
derive from the builtin exception a caller would naturally catch (ValueError, KeyError, ...).
"""

from __future__ import annotations

from collections.abc import Mapping


def install_hint(packages: str, extra: str) -> str:
    """How to install an optional extra, in commands that work where flashpage came from: the
    packages themselves, or the extra from a checkout (flashpage is installed from its repository)."""
    return f'pip install {packages} (from a flashpage checkout: pip install -e ".[{extra}]")'


def check_positive_ints(prefix: str, values: Mapping[str, object], allowed: str = "a positive int") -> None:
    """Raise ``ValueError("{prefix}{name} must be {allowed}, got {value!r}")`` for the first value
    that is not an int >= 1 (bools do not count as ints). Callers leave out values meaning "default"."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{prefix}{name} must be {allowed}, got {value!r}")


class FlashpageError(Exception):
    """Base class of every error flashpage raises on purpose."""


class KernelInputError(FlashpageError, ValueError, RuntimeError):
    """Inputs a paged-attention kernel cannot take (flash-attn raises RuntimeError for these)."""


class CapacityError(KernelInputError):
    """New tokens would not fit in the pages a sequence's block table gives it."""


class NoFreeBlocksError(FlashpageError, RuntimeError):
    """The block pool cannot satisfy an allocation; nothing was changed.

    Attributes:
        needed: blocks the operation needed.
        free: blocks that were allocatable (free or evictable) at the time.
    """

    def __init__(self, needed: int, free: int, what: str = "allocation") -> None:
        self.needed = needed
        self.free = free
        super().__init__(
            f"out of KV blocks: {what} needs {needed} block(s) but only {free} are free; "
            "free or preempt a sequence, or give the cache more blocks (num_blocks=...)"
        )


class UnknownSequenceError(FlashpageError, KeyError):
    """A sequence id that the cache does not hold (never added, or already freed)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown sequence"


class InvariantError(FlashpageError, AssertionError):
    """The block accounting is inconsistent (a bug in flashpage: please report it)."""


class NonCausalMaskError(FlashpageError, NotImplementedError):
    """A forward in one of the engine's packed steps built an attention mask that lets tokens see later tokens
    (Gemma 3 / Gemma 4 / PaliGemma image tokens attend bidirectionally), which those steps cannot compute.
    Raised while the mask is built, before any layer writes K/V. (Patched ``generate()`` computes such forwards
    exactly: attention under the mask over the K/V read back from the pages.)"""
