"""torch.compile per block: each block's forward body is compiled; the hooks around it (FSDP2's gathers,
activation checkpointing) stay eager, so no collective or checkpoint logic has to be traced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from lit_mesh.mesh import MeshConfigError


def check_compile_backend(backend: str) -> None:
    """Refuse, before any process starts, a backend torch.compile does not have (async TP's needs: see
    lit_mesh/rules.py, "async_tp_needs_compiled_sp" and "async_tp_needs_cuda_nccl")."""
    backends = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if backend not in backends:
        raise MeshConfigError(f"compile_backend={backend!r} is not a torch.compile backend; choose one of {backends}")


def _settle_async_collectives(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Hand the compiled forward plain tensors instead of pending collective results.

    Under tensor parallel a block's input can be an AsyncCollectiveTensor (the `to_local()` of torch's
    RowwiseParallel output, which redistributes with async_op=True). torch 2.13's AOTAutograd unwraps such an
    input with `trigger_wait()`, which drops its requires_grad, so its gradient never reaches the embedding (the
    backward fails, or trains on wrong gradients): pytorch/pytorch#191113 (fix after 2.13),
    reproduced by benchmarks/compile_tp_repro.py. `clone()` waits through the subclass's dispatch and keeps
    the autograd edge (one copy of the block's input, at the first block only)."""

    def settle(x: Any) -> Any:
        return x.clone() if isinstance(x, AsyncCollectiveTensor) else x

    return tuple(settle(x) for x in args), {key: settle(x) for key, x in kwargs.items()}


def apply_compile(blocks: Sequence[nn.Module], backend: str, fullgraph: bool = False) -> None:
    # Identical blocks share one graph: dynamo passes each block's parameters in as inputs.
    for block in blocks:
        # prepend: before activation checkpointing's hook, so recomputation sees the settled input too
        block.register_forward_pre_hook(_settle_async_collectives, prepend=True, with_kwargs=True)
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)  # type: ignore[method-assign]


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """torch's micro-pipeline TP (as torchtitan enables it): inductor splits the sequence-parallel all-gather ->
    matmul and matmul -> reduce-scatter into tiles exchanged through symmetric memory on the tp group. CUDA + NCCL
    only (lit_mesh/rules.py refuses anything else before launch)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
