"""Process-group set-up and the few collectives the loop needs (all decisions are all-reduced)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Join the torchrun process group (gloo on CPU, nccl on GPU); a plain `python` run is a
    world of one. Returns (rank, world_size)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    out = values.detach().clone().float()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_1d(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor of any length from every rank (rank order)."""
    world = dist.get_world_size()
    if world == 1:
        return values
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()]))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=values.dtype)
    padded[: values.numel()] = values
    parts = [torch.zeros(longest, dtype=values.dtype) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])
