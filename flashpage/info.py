"""``flashpage info``: versions (and whether they are in the supported range), devices, and which
kernel each entry point takes here and why."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import torch

from flashpage.cache import default_block_size
from flashpage.kernels import backend_info, dispatch


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _compiled_decode() -> dict[str, bool | str]:
    """Whether LLM compiles decode steps by default, per device (the engine needs a supported transformers)."""
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    try:
        from flashpage.engine.compiled import default_compile
    except ImportError as exc:  # flashpage.patches refuses this transformers: info still reports the rest
        return {d: f"unavailable ({type(exc).__name__})" for d in devices}
    return {d: default_compile(torch.device(d)) for d in devices}


def _support() -> list[dict[str, Any]]:
    """transformers and torch against the supported range (``flashpage.patches.compat``)."""
    reason = "flashpage.patches could not be imported"
    try:
        from flashpage.patches import compat
    except Exception as exc:  # the patches refuse this transformers; their version module is loaded by then
        compat = sys.modules.get("flashpage.patches.compat")
        reason = str(exc)
    if compat is None:
        return [{"name": "transformers", "version": _version("transformers"), "required": "see reason",
                 "supported": False, "summary": f"transformers {_version('transformers')}: NOT supported ({reason})"}]
    return [{"name": s.name, "version": s.version, "required": s.required, "supported": s.supported,
             "summary": s.describe()} for s in compat.support_status()]


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            devices.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm{cap[0]}{cap[1]})")
    return devices


def collect_info() -> dict[str, Any]:
    """A JSON-friendly description of this installation."""
    import flashpage

    probes = [("cpu", torch.float32, 16)]
    if torch.cuda.is_available():
        probes += [("cuda", torch.float16, 16), ("cuda", torch.bfloat16, 256)]
    kernels = []
    for device, dtype, block in probes:
        for entry, choice in backend_info(device=torch.device(device), dtype=dtype, block_size=block).items():
            kernels.append({"device": device, "dtype": str(dtype).removeprefix("torch."), "block_size": block,
                            "entry_point": entry, "reason": choice.reason,
                            "backend": choice.reason.partition(":")[0]})  # what runs: cpp, fa2, reference, ...
    return {
        "flashpage": flashpage.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "flash_attn": _version("flash-attn"),
        "flash_attn_4": _version("flash-attn-4"),
        "flash_backends": {key: dispatch.import_status(key) or "importable" for key in ("fa2", "fa3", "fa4")},
        "supported_versions": _support(),
        "cuda_available": torch.cuda.is_available(),
        "devices": _devices(),
        "default_block_size": {d: default_block_size(d) for d in (["cpu", "cuda"] if torch.cuda.is_available()
                                                                   else ["cpu"])},
        "kernels": kernels,
        "cpu_threads": _threads(),
        "cpu_attention": _cpu_attention(),
        "cpu_malloc": _malloc(),
        "compiled_decode": _compiled_decode(),
    }


def _threads() -> dict[str, Any]:
    """torch's intra-op threads, who set them, the cores this process may use, and the CPU linears."""
    from flashpage.cpu_threads import format_cores, usable_cores

    cores = usable_cores()
    try:
        from flashpage.engine.linears import ENV, onednn_available, prepack_default
    except ImportError as exc:  # the engine needs a supported transformers
        linears = f"unavailable ({type(exc).__name__})"
    else:
        linears = f"oneDNN in LLM steps, {prepack_default()}" if onednn_available() \
            else f"torch F.linear ({ENV}=torch or no oneDNN)"
    return {"torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "usable_cores": len(cores), "cores": format_cores(cores), "cpu_linears": linears,
            "eager_fastpath": _fastpath_label(), "flat_step": _flat_label()}


def _malloc() -> str:
    """What an LLM on CPU does to glibc malloc here (flashpage/cpu_memory.py); an unknown FLASHPAGE_MALLOC is said."""
    from flashpage.cpu_memory import malloc_plan

    try:
        return malloc_plan().describe()
    except ValueError as exc:
        return str(exc)


def _fastpath_label() -> str:
    """Whether LLM's eager steps fuse norms / rotary / gated MLPs (engine/fastpath.py)."""
    try:
        from flashpage.engine.fastpath import ENV, cpp_wanted, enabled_by_env
    except ImportError as exc:
        return f"unavailable ({type(exc).__name__})"
    if not enabled_by_env():
        return f"off ({ENV}=0): the modules' own code"
    label = f"fused norms / rotary / gated MLPs where a probe proves them equal ({ENV}=0 turns it off)"
    if not cpp_wanted():
        return label + f"; torch ops only ({ENV}=torch)"
    from flashpage.kernels import cpu_fused

    state = cpu_fused.status()
    ops = state.reason if state.name == "cpp" else f"torch ops ({state.reason})"
    return label + f"; {ops} ({ENV}=torch for torch ops only)"


def _flat_label() -> str:
    """Whether LLM's eager steps of plain Llama-family decoders run as one flat loop (engine/flat.py)."""
    try:
        from flashpage.engine.flat import ENV, FAMILIES, enabled_by_env
    except ImportError as exc:
        return f"unavailable ({type(exc).__name__})"
    if not enabled_by_env():
        return f"off ({ENV}=0): the model's forward"
    return (f"one flat loop over the layers for {', '.join(FAMILIES)} once a step proves it equal to the model's "
            f"forward ({ENV}=0 turns it off; LLM.flat_step says why a model has none)")


def _cpu_attention() -> dict[str, str]:
    """Which attention paged CPU calls run: the fused C++ kernel or the reference, and for which dtypes."""
    from flashpage.kernels import cpu_attention

    state = cpu_attention.status()
    dtypes = "/".join(str(d).removeprefix("torch.") for d in cpu_attention.DTYPES)
    return {"backend": state.name, "reason": state.reason, "force_reference": f"{cpu_attention.ENV}=reference",
            "dtypes": dtypes}


def _cpu_attention_line(state: dict[str, str]) -> str:
    line = "CPU attention ({dtypes} pages): {backend}: {reason}".format(**state)
    return line + (f" ({state['force_reference']} to force the PyTorch reference)" if state["backend"] == "cpp" else "")


def _compile_label(device: str, on: bool | str) -> str:
    if isinstance(on, str):  # why it is unknown
        return on
    if not on:
        return "off (LLM(compile=True) to opt in)"
    return "on (CUDA graphs)" if device == "cuda" else "on"


def format_info(info: dict[str, Any]) -> str:
    lines = [f"flashpage {info['flashpage']}  (python {info['python']}, torch {info['torch']}, "
             f"transformers {info['transformers']}, accelerate {info['accelerate']}, "
             f"flash-attn {info['flash_attn']})",
             "supported range: " + "; ".join(s["summary"] for s in info["supported_versions"]),
             "devices: " + ", ".join(info["devices"]),
             "flash-attn backends: " + "; ".join(f"{k}: {v}" for k, v in info["flash_backends"].items()),
             "default block size: " + ", ".join(f"{k}={v}" for k, v in info["default_block_size"].items()),
             "CPU threads: {torch_threads} (OMP_NUM_THREADS={omp_num_threads}), {usable_cores} usable cores ({cores}); "
             "float32 linears in LLM: {cpu_linears}".format(**info["cpu_threads"]),
             "LLM eager steps: " + info["cpu_threads"]["eager_fastpath"],
             "LLM flat eager step: " + info["cpu_threads"]["flat_step"],
             _cpu_attention_line(info["cpu_attention"]),
             "CPU malloc: " + info["cpu_malloc"],
             "LLM compiled decode steps by default: " + ", ".join(
                 f"{k}={_compile_label(k, v)}" for k, v in info["compiled_decode"].items()),
             "kernels:"]
    for k in info["kernels"]:
        lines.append(f"  {k['entry_point']:<24} {k['device']:<5} {k['dtype']:<9} block {k['block_size']:<4} "
                     f"-> {k['reason']}")  # reason starts with the backend
    return "\n".join(lines)
