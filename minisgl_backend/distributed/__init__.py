"""Tensor-parallel rank info and the two collectives layers need.

Every engine process calls `init_tp(rank, size)` once; with `size == 1` no process group is
created and the collectives are identities, so a single-rank engine pays nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int


_TP = TPInfo(rank=0, size=1)


def set_tp_info(rank: int, size: int) -> None:
    global _TP
    _TP = TPInfo(rank=rank, size=size)


def get_tp_info() -> TPInfo:
    return _TP


def init_process_group(rank: int, size: int, init_file: str, backend: str) -> None:
    """Join the tensor-parallel group through a file store in a private directory.

    A file store listens on nothing; gloo's own sockets are bound to loopback (the engine sets
    GLOO_SOCKET_IFNAME=lo before calling this).
    """
    set_tp_info(rank, size)
    if size == 1:
        return
    store = torch.distributed.FileStore(init_file, size)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size)


def destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if _TP.size > 1:
        torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension (rank order)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
