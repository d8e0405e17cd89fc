"""The ``flashpage`` command: info, generate, demo and bench (kernels, generate, engine)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from flashpage.errors import FlashpageError


def _info(args: argparse.Namespace) -> int:
    from flashpage.info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from flashpage.commands import run_generate

    return run_generate(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                        temperature=args.temperature, stream=args.stream, seed=args.seed)


def _demo(args: argparse.Namespace) -> int:
    from flashpage.commands import run_demo

    return run_demo(model=args.model, as_json=args.json)


def _bench(args: argparse.Namespace) -> int:
    from flashpage.bench.runner import run_bench

    return run_bench(args)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model path or hub id (default: the built-in tiny model, offline)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashpage", description="Paged KV cache for HuggingFace causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, devices and which kernel each entry point takes here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_info)

    p = sub.add_parser("generate", help="generate text with a patched model")
    _add_model(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.set_defaults(func=_generate)

    p = sub.add_parser("demo", help="patched generate() and LLM side by side with transformers")
    _add_model(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="benchmarks against transformers, in one process")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, helptext in (("kernels", "paged decode kernel vs dense SDPA"),
                           ("generate", "patched vs unpatched generate()"),
                           ("engine", "LLM vs HF generate() and HF continuous batching"),
                           ("hotpath", "per-layer overhead: eager/compiled generate(), LLM(compile=True)"),
                           ("tp", "tensor parallel: per-rank KV memory and throughput, 1 and 2 ranks")):
        b = bsub.add_parser(name, help=helptext)
        b.add_argument("--json", action="store_true", help="print JSON")
        b.add_argument("--plot", metavar="FILE.png", default=None, help="also write a plot")
        b.add_argument("--quick", action="store_true", help="a smaller, faster run")
        if name == "engine":
            b.add_argument("--workload", choices=("mixed", "shared-prefix"), default="mixed")
            _add_model(b)
        if name in ("generate", "tp"):
            _add_model(b)
        if name == "tp":
            b.add_argument("--tp-sizes", default="1,2",
                           help="rank counts to run, each under its own torchrun on this machine (default 1,2); "
                                "ignored when launched by torchrun (the launch decides)")
    p.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashpage`` console script."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, FlashpageError) as exc:  # bad arguments or model path: a message, not a trace
        print(f"flashpage {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
