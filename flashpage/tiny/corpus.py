"""Training corpus of flashpage's built-in tiny model: text that ships with Python itself.

Two sources, both read offline and without importing any module:

* ``pydoc_data.topics.topics``: the help topics behind ``help("keywords")`` and friends
  (reference-manual prose), taken in sorted key order;
* docstrings of the standard library: module, class and function docstrings found with
  :func:`ast.get_docstring` in the sorted ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``,
  skipping tests, IDLE, tkinter, lib2to3, site-packages and a few other folders of little prose.

The order is deterministic (sorted topics, then sorted files, docstrings in ``ast.walk`` order),
exact duplicates are dropped and the total is capped at ``max_chars`` characters, so one Python
installation always yields the same corpus. :func:`corpus_words` gives the word set used by the
tests to check that generations are made of real words.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "MAX_CORPUS_CHARS",
    "MIN_DOC_CHARS",
    "SKIP_PARTS",
    "build_corpus",
    "corpus_words",
    "help_topics",
    "normalize_word",
    "stdlib_dir",
    "stdlib_docstrings",
]

#: Upper bound on the corpus size, in characters (about half a million BPE tokens).
MAX_CORPUS_CHARS = 2_000_000
#: Docstrings shorter than this (one-liners such as "Return self.") are skipped.
MIN_DOC_CHARS = 40
#: Any path component equal to one of these excludes the file.
SKIP_PARTS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "encodings",
        "ensurepip",
        "pydoc_data",
        "__phello__",
        "venv",
        "config-3",
    }
)

_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STRIP = "\"'`.,;:!?()[]{}<>*_=#|/\\-"
_BLANK_RUNS = re.compile(r"\n{3,}")


def stdlib_dir() -> Path:
    """The folder of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines))


def help_topics() -> list[str]:
    """The pydoc help topics (``pydoc_data.topics.topics``), in sorted key order."""
    from pydoc_data.topics import topics

    return [_clean(topics[key]) for key in sorted(topics)]


def _stdlib_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_PARTS or part.startswith("config-3") for part in rel.parts):
            continue
        yield path


def stdlib_docstrings(root: Path | None = None, min_chars: int = MIN_DOC_CHARS) -> list[str]:
    """Module/class/function docstrings of the stdlib, parsed with :mod:`ast` (nothing imported)."""
    root = stdlib_dir() if root is None else root
    docs: list[str] = []
    for path in _stdlib_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOC_NODES):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= min_chars:
                    docs.append(_clean(doc))
    return docs


def build_corpus(max_chars: int = MAX_CORPUS_CHARS) -> list[str]:
    """The training documents: help topics then stdlib docstrings, deduplicated and capped.

    Deterministic for a given Python installation. A document that would cross ``max_chars``
    ends the corpus (it is not truncated mid-way).
    """
    seen: set[str] = set()
    out: list[str] = []
    total = 0
    for doc in [*help_topics(), *stdlib_docstrings()]:
        if not doc or doc in seen:
            continue
        if total + len(doc) > max_chars:
            break
        seen.add(doc)
        out.append(doc)
        total += len(doc)
    return out


def normalize_word(token: str) -> str:
    """Lower-case a whitespace-separated token with surrounding punctuation stripped."""
    return token.strip(_STRIP).lower()


def corpus_words(docs: Iterable[str] | None = None) -> set[str]:
    """Every normalized whitespace-separated word of ``docs`` (default: :func:`build_corpus`)."""
    docs = build_corpus() if docs is None else docs
    words: set[str] = set()
    for doc in docs:
        for token in doc.split():
            word = normalize_word(token)
            if word:
                words.add(word)
    return words
