"""Which transformers (and torch) this is, and which of their API generations flashpage must speak.

flashpage supports transformers ``MIN_TRANSFORMERS`` up to (not including) ``MAX_TRANSFORMERS``
and torch ``MIN_TORCH`` or newer. Within that range the API moved under us; each difference is
found by a feature test on the installed package, not by comparing version numbers:

- the cache keyword of a model's ``forward`` (``cache=`` since 5.24, ``past_key_values=`` before):
  :func:`cache_kwarg`, from the model's signature;
- the mask-function interface (``cache_position=`` before 5.5, ``q_length=``/``q_offset=`` after):
  :func:`mask_takes_cache_position`, from ``masking_utils.sdpa_mask``'s signature;
- ``Cache.crop(n)`` with a positive ``n`` (keep ``n`` tokens: what generate() itself calls before
  5.14) or only negative ``n`` (remove ``-n`` tokens): :func:`legacy_crop`, from ``DynamicLayer.crop``;
- ``Cache.get_mask_sizes`` taking ``cache_position`` (a tensor) or ``query_length`` (an int): the
  cache accepts both, whatever it is given.

Nothing here imports transformers at module import, so ``flashpage info`` can report an
installation flashpage cannot use. :func:`require_supported_transformers` is what ``patch()``,
``LLM`` and the import of ``flashpage.patches`` call to refuse an unsupported one at once.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import Any

MIN_TRANSFORMERS = "5.0.0"
MAX_TRANSFORMERS = "6"  # exclusive
# the newest transformers minor line the release smoke (.ci/smoke: every generate() mode and LLM, patched vs
# unpatched, on the newest patch of every 5.x line) has run; README's release list is written from that run
NEWEST_TESTED = "5.25"
MIN_TORCH = "2.6"
TRANSFORMERS_PIN = f"transformers>={MIN_TRANSFORMERS.removesuffix('.0')},<{MAX_TRANSFORMERS}"


class UnsupportedTransformersError(ImportError):
    """The installed transformers is outside the range flashpage supports.

    Attributes:
        version: the installed version ("not installed" when missing).
    """

    def __init__(self, version: str) -> None:
        self.version = version
        super().__init__(
            f"flashpage needs {TRANSFORMERS_PIN}, but transformers {version} is installed. "
            f'Install a supported one: pip install "{TRANSFORMERS_PIN}" '
            "(transformers 4.x is not supported: its cache API differs from 5.x throughout)."
        )


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; pre-release/local suffixes are ignored."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"cannot read a version number from {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def installed_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or "not installed".

    transformers' own ``__version__`` once it is imported (what every HFPagedCache checks: reading
    the package metadata costs milliseconds)."""
    module = sys.modules.get(dist) if dist == "transformers" else None
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def transformers_in_range(version: str) -> bool:
    """Whether ``version`` is in ``[MIN_TRANSFORMERS, MAX_TRANSFORMERS)``."""
    if version == "not installed":
        return False
    return _release(MIN_TRANSFORMERS) <= _release(version) < _release(MAX_TRANSFORMERS)


def torch_in_range(version: str) -> bool:
    """Whether ``version`` is at least ``MIN_TORCH``."""
    return version != "not installed" and _release(version) >= _release(MIN_TORCH)


def require_supported_transformers(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTransformersError` unless transformers (``version``, default: the
    installed one) is in the supported range. An installed release newer than :data:`NEWEST_TESTED` gets one
    warning per process (:func:`untested_warning`)."""
    installed = version is None
    version = installed_version("transformers") if version is None else version
    if not transformers_in_range(version):
        raise UnsupportedTransformersError(version)
    if installed and version not in _WARNED:
        _WARNED.add(version)
        message = untested_warning(version)
        if message:
            warnings.warn(message, UntestedTransformersWarning, stacklevel=3)


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is in the supported range but newer than any release flashpage was tested on."""


_WARNED: set[str] = set()


def untested_warning(version: str) -> str | None:
    """The warning for a transformers ``version`` newer than the newest tested minor line, else None."""
    if _release(version)[:2] <= _release(NEWEST_TESTED)[:2]:
        return None
    return (f"flashpage was tested with transformers {MIN_TRANSFORMERS.removesuffix('.0')} to {NEWEST_TESTED}.x; "
            f"{version} is newer. patch() refuses, by name, cache methods whose arguments flashpage's cache does not "
            f"take, and probes the model through it, but a generate() mode new in {version} may be refused; to stay "
            f"on tested "
            f'releases: pip install "transformers>={MIN_TRANSFORMERS.removesuffix(".0")},<'
            f'{_release(NEWEST_TESTED)[0]}.{_release(NEWEST_TESTED)[1] + 1}"')


@dataclass(frozen=True)
class SupportStatus:
    """What ``flashpage info`` reports about one dependency."""

    name: str
    version: str
    required: str
    supported: bool

    def describe(self) -> str:
        verdict = f"in range ({self.required})" if self.supported else f"NOT supported (install {self.required})"
        return f"{self.name} {self.version}: {verdict}"


def support_status() -> list[SupportStatus]:
    """transformers and torch: installed versions against the supported range."""
    tf, torch_version = installed_version("transformers"), installed_version("torch")
    return [SupportStatus("transformers", tf, TRANSFORMERS_PIN, transformers_in_range(tf)),
            SupportStatus("torch", torch_version, f"torch>={MIN_TORCH}", torch_in_range(torch_version))]


# --------------------------------------------------------------------------- feature tests
def returned_cache(output: Any) -> Any:
    """The cache a ``generate(..., return_dict_in_generate=True)`` returned, on every 5.x release:
    ``output.cache`` since transformers 5.24, ``output.past_key_values`` before (None without a cache)."""
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    return None


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` takes its cache by: "cache" (transformers >= 5.24) or "past_key_values"."""
    try:
        params = inspect.signature(model.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


@lru_cache(maxsize=1)
def mask_takes_cache_position() -> bool:
    """Mask functions are called with ``cache_position=`` (transformers < 5.5) rather than ``q_length=``."""
    from transformers import masking_utils

    params = inspect.signature(masking_utils.sdpa_mask).parameters
    return "cache_position" in params and "q_length" not in params


@lru_cache(maxsize=1)
def legacy_crop() -> bool:
    """``Cache.crop(n)`` with ``n > 0`` means "keep the first n tokens" in this transformers
    (generate() calls it that way before 5.14; later releases only remove, with ``crop(-n)``)."""
    from transformers.cache_utils import DynamicLayer

    return "max_length" in inspect.signature(DynamicLayer.crop).parameters
