"""Building flashpage's C++ CPU extensions (:mod:`flashpage.kernels.cpu_attention`, :mod:`flashpage.kernels.cpu_fused`).

Their sources are real files in ``flashpage/kernels/csrc/`` (shipped as package data): ``common.h`` (what both
include: the SIMD dot / exp / horizontal-sum helpers), ``cpu_attention.cpp`` and ``cpu_fused.cpp``. Each is
compiled with ``torch.utils.cpp_extension.load`` (registered ops, no Python module) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) the first time it is needed, and loaded from
there afterwards; compiler errors name the files in ``csrc/``.

Flags: ``-O3 -fopenmp -fno-math-errno`` plus the caller's; the engine's builds add :func:`arch_flags`
(``-march=native`` on x86-64 / aarch64), so the compiler's own macros (``__AVX512F__``, ``__AVX2__`` /
``__FMA__``; for bfloat16 / float16, ``__AVX512BF16__`` and ``__AVX512BW__`` / ``__AVX512VL__`` in ``half.h`` /
``half_linear.h``) pick the AVX-512 (BF16), AVX2 + FMA or portable paths for the CPU that builds it: a CPU without
AVX-512 BF16 compiles the widened-float32 path, one without AVX-512 the portable loops (the tests build both).
The extension's name (:func:`build_name`), hence its cache folder, carries a version and a digest of the bytes
of every file the build reads (its sources and the headers in ``csrc/``), the flags, torch's version and this
CPU's model and flags: editing a source, or moving the cache to another CPU, builds anew; otherwise it builds once
per machine.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)


def source(name: str) -> str:
    """The absolute path of ``csrc/<name>``."""
    return str(CSRC / name)


def headers() -> list[Path]:
    """The headers in ``csrc/`` (any of them may be included: all are part of every build's key)."""
    return sorted(CSRC.glob("*.h"))


def arch_flags() -> list[str]:
    """-march=native where the compiler supports it (x86-64, aarch64): the build is per machine."""
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") else []


def _cpu_signature() -> str:
    """This CPU's architecture, model name and feature flags (-march=native builds are per CPU model)."""
    cpu = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            cpu += "".join(line for line in fh.read().splitlines()[:40] if line.startswith(("model name", "flags")))
    except OSError:
        pass
    return cpu


def sources_digest(sources: Sequence[str]) -> str:
    """sha1 over the names and bytes of ``sources`` and of every header in ``csrc/``."""
    digest = hashlib.sha1()
    for path in [*map(Path, sources), *headers()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_name(prefix: str, version: int, sources: Sequence[str], flags: Sequence[str]) -> str:
    """Extension name: ``prefix``, ``version`` and a digest of the sources' bytes, the flags, torch and
    this CPU."""
    key = " ".join([sources_digest(sources), *flags, torch.__version__, _cpu_signature()])
    return f"{prefix}_v{version}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def missing_tools() -> str | None:
    """Why a build cannot start here (no C++ compiler / no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({cxx!r} / g++ not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        try:  # the ninja wheel (a core dependency) outside an activated venv: its binary is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def jit_build(name: str, sources: Sequence[str], flags: Sequence[str]) -> None:
    """Compile ``sources`` (registered ops, no Python module) into torch's extension cache as ``name`` with
    :data:`BASE_CFLAGS` and ``flags``, or load it from there (its ops then sit in ``torch.ops``)."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name, sources=list(sources), extra_cflags=[*BASE_CFLAGS, *flags], extra_ldflags=list(LDFLAGS),
        is_python_module=False, verbose=False,
    )


def library_path(name: str) -> str | None:
    """Where torch's extension cache keeps (or will keep) the shared library of build ``name``."""
    try:
        from torch.utils import cpp_extension

        return os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
    except Exception:  # a private torch helper: only used for reports
        return None
