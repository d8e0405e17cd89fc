"""What a bench's ``--json`` output needs to be read later: the command, the code, the machine, the date.

Every bench's JSON writer calls :func:`dumps` (or :func:`with_record`), which adds one ``"recorded_with"``
object to the result: the command line, flashpage's version and git commit, the torch / transformers /
Python versions, the CPU model and its vector flags, the thread settings, the load average and the UTC
date. The stored outputs under ``docs/results/`` are these documents; ``tests/docs/test_bench_numbers.py``
checks the numbers in docs/benchmarks.md against them. Nothing here imports torch before a bench has.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# The /proc/cpuinfo flags that decide which kernels run (the rest are noise in a stored result).
_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``flashpage bench ...`` (or ``python -m ...``), after the environment variables
    that change what a bench measures (OMP_NUM_THREADS, FLASHPAGE_*, VLLM_CPU_*) where set."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    is_cli = script.name == "flashpage" or script.parts[-2:] == ("flashpage", "cli.py")  # or python -m flashpage.cli
    head = "flashpage" if is_cli else f"python {script.as_posix()}"
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k == "OMP_NUM_THREADS" or k.startswith(("FLASHPAGE_", "VLLM_CPU_"))]
    return " ".join([*env, shlex.join([head, *argv[1:]])])


def git_commit() -> str | None:
    """flashpage's checkout commit, with ``-dirty`` when tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def cpu_info() -> dict[str, Any]:
    """CPU model name, the kernel-relevant flags it has, and the logical CPU count."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in _CPU_FLAGS if f in flags], "logical_cpus": os.cpu_count()}


def _versions() -> dict[str, Any]:
    """flashpage / torch / transformers / Python versions and torch's CPU capability (None if not importable)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("flashpage", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            out[name] = None
    try:
        import torch

        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["torch_threads"] = torch.get_num_threads()
    except (ImportError, AttributeError):
        pass
    return out


def _affinity() -> list[int] | None:
    """The cores this process may run on (``taskset``), where the OS says."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def record() -> dict[str, Any]:
    """The ``recorded_with`` object: command, commit, versions, CPU, threads, load average, UTC date."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"command": command_line(), "flashpage_commit": git_commit(), **_versions(), "cpu": cpu_info(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_affinity": _affinity(),
            "load_average_at_end": load,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def with_record(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``recorded_with`` added (a new dict; the bench's own keys are untouched)."""
    return {**result, "recorded_with": record()}


def dumps(result: dict[str, Any]) -> str:
    """The bench's ``--json`` document: the result plus ``recorded_with``, indented."""
    return json.dumps(with_record(result), indent=2)
