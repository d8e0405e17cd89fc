"""`flashpage bench {kernels,generate,engine,hotpath,tp,sampler,breakdown,rl}`: run one benchmark, print it.

Progress goes to stderr, so ``--json`` output on stdout is one JSON document. The exit code is 0
when the outputs agree (and, for generate, the paged KV stays within its bound); speed never
changes it. On a machine shared with other work, run with ``OMP_NUM_THREADS=1``: oversubscribed
intra-op threads make every timing meaningless (a 4-layer decode step measured 0.58 s with 2
threads on 2 busy cores vs 0.023 s with 1).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flashpage.errors import install_hint


def _kernels(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import kernels

    if args.quick:
        return kernels.run(num_seqs=32, max_len=512, repeats=3)
    return kernels.run()


def _generate(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import generate

    return generate.run(model_name=getattr(args, "model", None), quick=args.quick, **_shape_args(args))


def _shape_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--model-shape`` / ``--dtype`` / ``--num-layers`` as keyword arguments of the engine benches (none
    when no shape is asked for); ValueError for a combination that means nothing."""
    shape = getattr(args, "model_shape", None)
    if shape is None:
        for flag in ("dtype", "num_layers"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is for --model-shape; add --model-shape NAME "
                                 "(`flashpage bench shapes` lists them)")
        return {}
    if getattr(args, "model", None) is not None:
        raise ValueError("--model and --model-shape: give one (a checkpoint, or a published shape with random weights)")
    return {"model_shape": shape, "dtype": args.dtype or "bfloat16", "num_layers": args.num_layers}


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    against = getattr(args, "against", None)
    shape = _shape_args(args)
    if against == "vllm":
        from flashpage.bench import vs_vllm as vllm

        if getattr(args, "plot", None):
            raise ValueError("--plot draws the transformers comparison only; drop --plot with --against vllm")
        settings = vllm.Settings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 block_size=args.block_size, threads=args.threads)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(settings, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(settings, name)}: give at least 1")
        return vllm.run(args.vllm_python, workload=args.workload, model_name=args.model, quick=args.quick,
                        rounds=args.rounds, settings=settings, compile=getattr(args, "compile", False), **shape)
    if getattr(args, "vllm_python", None):
        raise ValueError("--vllm-python is for --against vllm; add --against vllm (or drop --vllm-python)")
    if getattr(args, "compile", False):
        raise ValueError("--compile is for --against vllm (flashpage compiled against vLLM's compiled model); "
                         "add --against vllm (or drop --compile)")
    from flashpage.bench import engine

    return engine.run(workload=getattr(args, "workload", "mixed"), model_name=getattr(args, "model", None),
                      quick=args.quick, **shape)


def _hotpath(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import hotpath

    return hotpath.run(quick=args.quick)


def _breakdown(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import breakdown

    return breakdown.run(workload=args.workload, model_name=args.model, quick=args.quick,
                         vllm_python=args.vllm_python, **_shape_args(args))


def _sampler(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import sampler

    return sampler.run(quick=args.quick)


def _tp(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import tp

    sizes = [int(x) for x in str(args.tp_sizes).split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--tp-sizes {args.tp_sizes!r}: give rank counts separated by commas, e.g. 1,2")
    return tp.run(sizes, model_name=getattr(args, "model", None), quick=args.quick)


def _rl(args: argparse.Namespace) -> dict[str, Any]:
    from flashpage.bench import rl

    return rl.run(model_name=getattr(args, "model", None), quick=args.quick)


def _format(name: str, result: dict[str, Any]) -> str:
    if name == "rl":
        from flashpage.bench.rl import format_report
    elif name == "tp":
        from flashpage.bench.tp import format_report
    elif name == "breakdown":
        from flashpage.bench.breakdown import format_report
    elif name == "sampler":
        from flashpage.bench.sampler import format_report
    elif name == "hotpath":
        from flashpage.bench.hotpath import format_report
    elif name == "kernels":
        from flashpage.bench.kernels import format_report
    elif name == "generate":
        from flashpage.bench.generate import format_report
    elif result.get("bench") == "engine_vs_vllm":
        from flashpage.bench.vs_vllm import format_report
    else:
        from flashpage.bench.engine import format_report
    return format_report(result)


_RUNNERS = {"kernels": _kernels, "generate": _generate, "engine": _engine, "hotpath": _hotpath, "tp": _tp,
            "sampler": _sampler, "breakdown": _breakdown, "rl": _rl}


def run_bench(args: argparse.Namespace) -> int:
    """Run ``args.bench``; print the report (``--json``: the result dict); write ``--plot``. Exit code."""
    name = args.bench
    runner = _RUNNERS.get(name)
    if runner is None:
        print(f"flashpage bench: unknown benchmark {name!r}; choose from {sorted(_RUNNERS)}", file=sys.stderr)
        return 2
    result = runner(args)
    if result.get("this_rank", 0) != 0:
        return 0  # under torchrun: rank 0 prints the rows of every rank
    if args.json:
        from flashpage.bench.record import dumps

        print(dumps(result))
    else:
        print(_format(name, result))
    plot_path = getattr(args, "plot", None)
    if plot_path:
        from flashpage.bench.plots import write_plot

        try:
            write_plot(name, result, plot_path)
        except ImportError as exc:
            print(f"flashpage bench: --plot needs matplotlib ({exc}); {install_hint('matplotlib', 'plot')}",
                  file=sys.stderr)
            return 1
        print(f"[bench {name}] plot written to {plot_path}", file=sys.stderr)
    return 0 if _ok(name, result) else 1


def _ok(name: str, result: dict[str, Any]) -> bool:
    """Correctness only (never speed): outputs agree, KV within its bound."""
    if name == "kernels":
        return bool(result.get("outputs_agree", True))
    agree = bool(result["outputs_agree"]) or not result.get("token_contract", True)  # half precision: reported only
    if name == "generate":
        return agree and bool(result["kv_within_bound"])
    return agree
