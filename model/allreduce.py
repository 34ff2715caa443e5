"""One-shot all-reduce on torch symmetric memory for small tensor-parallel messages
(TAPSERVE_ALLREDUCE: auto, symm, symm_fused or nccl; docs/tensor_parallel.md).

Each rank's buffer is mapped into every peer (CUDA backend, never multicast); a message of at
most max_bytes (bf16 or fp32, 16-byte aligned) is summed by torch's one-shot kernel in rank
order, so every rank gets the same bits. Anything else takes NCCL. Set-up is collective and
comes before any CUDA-graph capture; a failure on any rank leaves every rank on NCCL.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from tapserve.model.layers import TPGroup

log = logging.getLogger("tapserve.allreduce")

ENV = "TAPSERVE_ALLREDUCE"
MODES = ("auto", "nccl", "symm", "symm_fused")
DTYPES = (torch.bfloat16, torch.float32)  # the one-shot kernel's dtypes (no float16)
ALIGN = 16  # bytes: size and offset, so local input and symmetric buffer vectorize alike
DEFAULT_MAX_BYTES = 2 << 20  # the buffer's cap: max_num_seqs x hidden x 2 for hidden 4096
_FUSED = ("one_shot_all_reduce_copy_out", "symm_buffer local_input reduce_op group_name out")
_STAGED = ("one_shot_all_reduce_out", "input reduce_op group_name out")


def mode_from_env() -> str:
    """TAPSERVE_ALLREDUCE, lower-cased; "auto" when unset."""
    return os.environ.get(ENV, "auto").strip().lower() or "auto"


def _torch_release() -> tuple[int, int]:
    """(major, minor) of torch, pre-releases included ("2.11.0a0+git" -> 2.11)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _op_matches(name: str, arg_names: str) -> bool:
    """Whether torch.ops.symm_mem.<name> exists with exactly these argument names."""
    try:
        schema = getattr(torch.ops.symm_mem, name).default._schema
    except (AttributeError, RuntimeError):
        return False
    return [a.name for a in schema.arguments] == arg_names.split()


def _all_ranks_ok(ok: bool, group: Any, device: torch.device) -> bool:
    """All-reduce MIN of ok over the group: True only if every rank says True."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class SymmMemAllReduce:
    """A TP group's symmetric buffer and the one-shot kernel. Build it with `create`."""

    def __init__(self, buffer: torch.Tensor, handle: Any, group_name: str, fused: bool):
        self.buffer = buffer  # uint8 [max_bytes], viewed as each message's dtype
        self.handle = handle  # the rendezvous: keeps the peer mappings alive
        self.group_name = group_name
        self.fused = fused  # one_shot_all_reduce_copy_out, else copy_ + one_shot_all_reduce_out
        self.max_bytes = buffer.numel()

    @property
    def mode(self) -> str:
        """The TAPSERVE_ALLREDUCE value this communicator implements."""
        return "symm_fused" if self.fused else "symm"

    def _fits(self, nbytes: int, dtype: torch.dtype) -> bool:
        """A message of this size and dtype is one the one-shot kernel takes."""
        return dtype in DTYPES and 0 < nbytes <= self.max_bytes and nbytes % ALIGN == 0

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes x: the same answer on every rank for a shape and dtype."""
        return (
            self._fits(x.numel() * x.element_size(), x.dtype)
            and x.device == self.buffer.device
            and x.is_contiguous()
            and x.storage_offset() * x.element_size() % ALIGN == 0
        )

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor over the start of the buffer for a producer to write its partial sums
        into, summed there by `reduce`; None where ineligible, and in the fused variant."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.fused or not self._fits(nbytes, dtype):
            return None
        return self.buffer[:nbytes].view(dtype).view(shape)

    def reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the group, or None (x untouched) when x is not eligible. x from
        `staging` is summed into a new tensor; any other x is summed in place and returned."""
        ops = torch.ops.symm_mem
        if x.data_ptr() == self.buffer.data_ptr() and self.eligible(x):
            out = torch.empty_like(x)
            # same stream, no PDL: the producer's writes land before the kernel signals peers
            ops.one_shot_all_reduce_out(x.view(-1), "sum", self.group_name, out.view(-1))
            return out
        if not self.eligible(x):
            return None
        flat = x.view(-1)
        symm = self.buffer[: flat.numel() * flat.element_size()].view(x.dtype)
        if self.fused:
            ops.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        else:
            symm.copy_(flat)
            ops.one_shot_all_reduce_out(symm, "sum", self.group_name, flat)
        return x

    def _self_test(self, rank: int, size: int) -> None:
        """Check known small-integer sums (exact in bf16) per dtype; a RuntimeError if wrong."""
        for dtype in DTYPES:
            for numel in (ALIGN, self.max_bytes // dtype.itemsize):
                base = torch.arange(numel, device=self.buffer.device) % 13
                x = (base + rank).to(dtype)
                if self.reduce(x) is None:
                    raise RuntimeError(f"self-test message ({numel} x {dtype}) not eligible")
                expected = (base * size + size * (size - 1) // 2).to(dtype)
                if not torch.equal(x, expected):
                    raise RuntimeError(f"self-test sum wrong ({numel} x {dtype})")
        torch.cuda.synchronize(self.buffer.device)

    @classmethod
    def create(
        cls, group: Any, device: torch.device, max_bytes: int, fused: bool = False
    ) -> SymmMemAllReduce | None:
        """Collective over `group` (NCCL), with the same arguments on every rank, before any
        CUDA-graph capture; None on every rank if any rank fails."""
        max_bytes = -(-max_bytes // ALIGN) * ALIGN
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        state: dict[str, Any] = {}

        def check_and_allocate() -> None:
            import torch.distributed._symmetric_memory as symm_mem

            state["symm_mem"] = symm_mem
            name, args = _FUSED if fused else _STAGED
            if not _op_matches(name, args):
                raise RuntimeError(f"torch {torch.__version__}: no symm_mem.{name}({args})")
            # never NVLink multicast; read when the rendezvous decides on multicast
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            # set_backend refuses the backend that is already the default
            if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) != "CUDA":
                symm_mem.set_backend("CUDA")
            if _torch_release() < (2, 11):  # torch 2.11 finds the group's store by itself
                symm_mem.enable_symm_mem_for_group(group.group_name)
            state["buffer"] = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            state["buffer"].zero_()
            torch.cuda.synchronize(device)

        def rendezvous() -> None:
            handle = state["symm_mem"].rendezvous(state["buffer"], group.group_name)
            if handle is None:
                raise RuntimeError("rendezvous returned no handle")
            state["comm"] = cls(state["buffer"], handle, group.group_name, fused)

        def self_test() -> None:
            state["comm"]._self_test(rank, size)

        with torch.cuda.device(device):
            for step in (check_and_allocate, rendezvous, self_test):
                ok = True
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - any failure: NCCL on every rank
                    log.warning(
                        "symmetric-memory all-reduce: %s failed on rank %d: %s",
                        step.__name__,
                        rank,
                        e,
                    )
                    ok = False
                if not _all_ranks_ok(ok, group, device):
                    log.warning(
                        "symmetric-memory all-reduce off (%s failed on some rank); using NCCL",
                        step.__name__,
                    )
                    return None
        comm = state["comm"]
        if rank == 0:
            log.info("%s all-reduce on for messages <= %d bytes", comm.mode, comm.max_bytes)
        return comm


def with_one_shot_all_reduce(
    tp: TPGroup,
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    message_bytes: int,
    cap: int = DEFAULT_MAX_BYTES,
) -> TPGroup:
    """tp with the one-shot all-reduce for messages up to min(message_bytes, cap) attached when
    mode asks for it and it sets up on every rank, else tp (a warning unless mode is "auto");
    a ValueError for an unknown mode. Collective: every rank, before graph capture."""
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "nccl" or tp.size == 1:
        return tp
    reason = (
        f"needs CUDA and bfloat16 or float32, not {device.type} {dtype}"
        if device.type != "cuda" or dtype not in DTYPES
        else "the TP group spans hosts (peer memory is per host)"  # same answer on all ranks
        if int(os.environ.get("LOCAL_WORLD_SIZE", tp.size)) != tp.size
        else None
    )
    if reason:
        if mode != "auto":
            log.warning("%s=%s ignored: %s", ENV, mode, reason)
        return tp
    mode = "symm" if mode == "auto" else mode
    group = dist.group.WORLD if tp.group is None else tp.group
    comm = SymmMemAllReduce.create(group, device, min(message_bytes, cap), mode == "symm_fused")
    return tp if comm is None else dataclasses.replace(tp, one_shot=comm)
