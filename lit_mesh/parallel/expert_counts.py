"""The token counts of expert parallel's all-to-alls, exchanged and brought to the host in one operator that selective
activation checkpointing keeps.

Why one operator (torch.library): the variable-split all-to-alls take their split sizes as host integers, so an MoE
layer's forward exchanges its token counts and reads them on the host (a stream sync on a GPU). Selective AC
recomputes the block's forward in backward; as plain ops the exchange (a collective) and the host read ran again
there. As one operator among the kept ones (lit_mesh/parallel/activation_checkpointing.py) its outputs, the received
counts on the device and both counts on the host, are stored in forward and handed back in the recompute: no
collective, no host read. Full AC keeps nothing and runs it again.
"""

from __future__ import annotations

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.distributed_c10d import GroupName


def counts_on_host(send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Both counts on the host, (2, *send_counts.shape): the one host read of an MoE layer's forward
    (lit_mesh.monitor.step_audit declares it)."""
    return torch.stack([send_counts, recv_counts]).cpu()


@torch.library.custom_op("lit_mesh::exchange_counts", mutates_args=())
def exchange_counts(send_counts: torch.Tensor, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """send_counts (group size, ...): row r what this rank sends rank r -> (what each rank sends this one, on the
    device; both on the host, stacked)."""
    recv_counts = funcol.wait_tensor(
        funcol.all_to_all_single(send_counts.contiguous(), None, None, GroupName(group_name))
    )
    return recv_counts, counts_on_host(send_counts, recv_counts)


@exchange_counts.register_fake
def _(send_counts: torch.Tensor, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.empty((2, *send_counts.shape), dtype=send_counts.dtype, device="cpu")
    return torch.empty_like(send_counts), host
