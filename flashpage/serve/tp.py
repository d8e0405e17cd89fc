"""``flashpage serve --tensor-parallel-size N``: one model sharded over N ranks behind one HTTP server.

Under ``torchrun`` (one node or many: ``torchrun --nnodes ... -m flashpage.cli serve
--tensor-parallel-size N``) every rank loads the model with ``tp_plan="auto"`` and builds its own
LLM over its shard. Rank 0 runs the HTTP server (an :class:`AsyncLLM` whose engine thread adds,
aborts and steps) inside :func:`flashpage.engine.distributed.drive`; every other rank runs
:func:`~flashpage.engine.distributed.follow`, which receives each step's new requests and aborts
from rank 0 and steps the same engine. Rank 0's SIGTERM drains as usual, then releases the
followers, and every rank exits 0 (followers ignore SIGTERM/SIGINT: rank 0 decides when they stop).

Without torchrun, :func:`relaunch` starts ``torchrun --nproc-per-node N`` on a loopback rendezvous
running the same command line, passes SIGTERM/SIGINT to rank 0 (which drains and releases the
others, so torchrun ends cleanly) and returns torchrun's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from flashpage.serve.ports import free_port
from flashpage.serve.server import ServeOptions

PID_FILE_ENV = "FLASHPAGE_SERVE_RANK0_PID_FILE"  # where rank 0 writes its pid for relaunch()'s signals


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(size: int, argv: list[str], http_port: int) -> int:
    """Run ``flashpage <argv>`` as ``size`` ranks under torchrun on this machine (rank 0 serving HTTP on
    ``http_port``); its exit code."""
    port = free_port(avoid=(http_port,))  # the rendezvous store must not take the HTTP port rank 0 binds
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(size), "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "flashpage.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="flashpage-serve-tp-") as tmp:
        pid_file = Path(tmp, "rank0.pid")
        proc = subprocess.Popen(cmd, env={**os.environ, PID_FILE_ENV: str(pid_file)})

        def forward(signum: int, _frame: Any) -> None:
            try:
                os.kill(int(pid_file.read_text()), signum)  # rank 0 drains, then releases the others
            except (OSError, ValueError):  # rank 0 not up yet: torchrun stops every rank
                proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_tp_server(options: ServeOptions, size: int) -> NoReturn:
    """This rank's part of a tensor-parallel server (called under torchrun on every rank); ends the
    rank's process with its exit code (:func:`~flashpage.engine.distributed.end_rank`)."""
    import torch.distributed as dist

    from flashpage.engine.distributed import drive, end_rank, follow
    from flashpage.serve.async_engine import AsyncLLM
    from flashpage.serve.server import run_server

    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"--tensor-parallel-size {size} but torchrun started {world} ranks; launch "
                         f"--nproc-per-node x --nnodes = {size} ranks, or omit torchrun and flashpage starts them")
    if options.engine.device is not None:
        raise ValueError("--device cannot be combined with --tensor-parallel-size: each rank uses its own "
                         "accelerator (cuda:LOCAL_RANK) or the CPU; omit --device")
    _init_process_group()
    llm = _build_llm(options, size)
    rank = dist.get_rank()
    if rank != 0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains, then releases this rank
            signal.signal(sig, signal.SIG_IGN)
        follow(llm)
        code = 0
    else:
        pid_file = os.environ.get(PID_FILE_ENV)
        if pid_file:
            Path(pid_file).write_text(str(os.getpid()))
        with drive(llm):
            engine = AsyncLLM(llm, max_waiting_requests=options.max_waiting_requests)
            code = run_server(options, engine=engine)
    dist.destroy_process_group()
    end_rank(code)


def _init_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timedelta(minutes=30))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))


def _build_llm(options: ServeOptions, size: int) -> Any:
    from flashpage.engine import LLM, loading

    engine = options.engine
    model, tokenizer = loading.load_model(options.model, dtype=engine.dtype, tensor_parallel_size=size,
                                          label=f"--model {options.model}")
    return LLM(model, tokenizer, **engine.llm_kwargs(drop=("dtype", "device", "tensor_parallel_size")))
