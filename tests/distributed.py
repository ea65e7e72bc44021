"""Run a test function on several ranks in spawned processes, with a deadline.

Each rank gets the environment a launcher such as torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning's
``strategy="ddp"`` joins it instead of launching processes of its own. A rank's
exception fails the test with its traceback; a rank that hangs (a deadlock)
fails it at the deadline instead of hanging pytest.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: object,
    backend: str | None = "gloo",
    timeout: float = 50.0,
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: a module-level function (it is pickled by name).
        world_size: number of ranks.
        backend: the default group's backend (``gloo``, or ``nccl`` with rank
            ``r`` on GPU ``r``); None leaves the group to Lightning's DDP strategy.
        timeout: seconds before the ranks are killed and the test fails.
    """
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), backend, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"ranks still running after {timeout:.0f} s (a deadlock?)")


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, backend: str | None, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
    )
    # Two ranks on two cores: one thread each.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if backend is not None:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
