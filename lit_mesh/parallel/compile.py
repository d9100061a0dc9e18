"""torch.compile per block: each block's forward body is compiled; the hooks around it (FSDP2's gathers,
activation checkpointing) stay eager, so no collective or checkpoint logic has to be traced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh

from lit_mesh.errors import MeshConfigError
from lit_mesh.unit import Rule, option


def check_compile_backend(backend: str) -> None:
    """Refuse, before any process starts, a backend torch.compile does not have (async TP's needs: RULES below,
    "async_tp_needs_compiled_sp" and "async_tp_needs_cuda_nccl")."""
    backends = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if backend not in backends:
        raise MeshConfigError(f"compile_backend={backend!r} is not a torch.compile backend; choose one of {backends}")


@dataclass(frozen=True)
class CompileOptions:
    blocks: bool = option(
        False, doc="torch.compile each block's forward (after TP and checkpointing, before FSDP).", arg="compile_blocks"
    )
    backend_name: str = option(
        "inductor",
        doc='the torch.compile backend ("inductor"; "aot_eager" compiles fast and generates no code).',
        arg="compile_backend",
    )
    async_tp: bool = option(
        False,
        doc="torch's micro-pipeline (async) TP: inductor overlaps the sequence-parallel all-gather and reduce-scatter"
        ' with the matmuls of the compiled blocks. CUDA + NCCL only; needs compile_blocks with "inductor", tp > 1 and'
        " sequence_parallel.",
    )

    def __post_init__(self) -> None:
        if self.blocks:
            check_compile_backend(self.backend_name)

    @property
    def backend(self) -> Optional[str]:
        """The backend the blocks are compiled with; None: they are not compiled."""
        return self.backend_name if self.blocks else None


RULES: list[Rule] = [
    Rule(
        # measured on torch 2.13 (benchmarks/compile_tp_repro.py --backend inductor): selective checkpointing
        # around inductor-compiled TP blocks gives wrong weight gradients (wv off by 0.057); full checkpointing,
        # aot_eager, selective + inductor without TP, and the same policy without the collectives in its saved set
        # all match one device to 1e-7: the saved outputs of the collectives inductor's code calls are not the
        # values recompute needs
        "selective_ac_with_inductor_tp",
        "init",
        lambda f: (
            f.options.memory.activation_checkpointing == "selective"
            and f.options.compile.backend == "inductor"
            and f.degrees["tp"] != 1
        ),
        lambda f: (
            f"activation_checkpointing='selective' with compile_blocks (compile_backend='inductor') and"
            f" tp={f.degrees['tp']}: on this torch the gradients come out wrong (benchmarks/compile_tp_repro.py --backend"
            " inductor, case lit-mesh-ac-selective-sp: the collective outputs it saves); use activation_checkpointing="
            "'full', or compile_backend='aot_eager', or tp=1"
        ),
    ),
    Rule(
        # torch's micro-pipeline TP is an inductor pass that fuses the SP all-gather/reduce-scatter with the
        # matmuls next to them; it needs a compiled, sequence-parallel TP region to find them
        "async_tp_needs_compiled_sp",
        "init",
        lambda f: (
            f.options.compile.async_tp
            and (
                f.options.compile.backend != "inductor" or f.degrees["tp"] == 1 or not f.options.mesh.sequence_parallel
            )
        ),
        lambda f: (
            f"async_tp=True with compile_blocks={f.options.compile.backend is not None}, compile_backend="
            f"{f.options.compile.backend!r}, tp={f.degrees['tp']}, sequence_parallel={f.options.mesh.sequence_parallel}:"
            " async TP (torch's micro-pipeline TP) fuses the sequence-parallel collectives into the matmuls in inductor;"
            " set compile_blocks=True, compile_backend='inductor', tp > 1 and sequence_parallel=True, or async_tp=False"
        ),
    ),
    Rule(
        "async_tp_needs_cuda_nccl",
        "launch",
        lambda f: f.options.compile.async_tp and (f.device_type != "cuda" or f.process_group_backend != "nccl"),
        lambda f: (
            f"async_tp=True on device {f.device_type!r} with process group backend"
            f" {f.process_group_backend!r}: async TP (torch's micro-pipeline TP) exchanges tiles through CUDA symmetric"
            " memory and needs accelerator='cuda' with the 'nccl' backend; on this machine set async_tp=False (plain TP,"
            " compiled or not, runs here)"
        ),
    ),
]


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
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """torch's micro-pipeline TP (as torchtitan enables it): inductor splits the sequence-parallel all-gather ->
    matmul and matmul -> reduce-scatter into tiles exchanged through symmetric memory on the tp group. CUDA + NCCL
    only (RULES above refuse anything else before launch)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
