"""Host tensors in collectives (tests/integration/test_collective_devices.py, 2 gloo ranks): the proxy of
tests/collective_devices.py finds them as NCCL would, and the gradient norm of a rank without gradients (2BW's first
step under clipping) hands its collective a tensor on the rank's device.

Usage: python tests/workers/collective_devices.py OUT_DIR CHECK[,CHECK...]   (rank r writes OUT_DIR/rank{r}.json)
"""

from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lit_mesh import MeshStrategy
from lit_mesh.training.grad_norm import clip_grad_norm_, global_grad_norm
from tests.collective_devices import CollectiveDevices, HostTensorCheck
from tests.workers.checks import Checks, arguments
from zoo.modules import GPTModule

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
check = Checks()


@check
def proxy_finds_host_tensors() -> None:
    """A tensor made without a device, and what is computed from it alone, is found at the collective; one made on
    the rank's device, or moved there, is not; on a GPU rank (device cuda) device="cpu" and .cpu() are host too."""
    first_line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
    with HostTensorCheck(CPU) as found:
        dist.all_reduce(torch.tensor(0.0).pow(2))
        dist.all_reduce(torch.zeros((), device=CPU))
        dist.all_reduce(torch.tensor(1.0).to(CPU))
        dist.all_reduce(torch.ones(2, device=CPU) * torch.tensor(3.0))  # on the device: one input is
    assert [(f["op"], f["shape"]) for f in found.found] == [("allreduce_", [])], found.found
    assert found.found[0]["made_at"].startswith(f"{__file__}:{first_line}"), found.found
    with HostTensorCheck(CUDA) as found:  # what a GPU rank would pass (the tensors stay on the CPU here)
        dist.all_reduce(torch.zeros((), device="cpu"))
        dist.all_reduce(torch.ones(2, device=CPU).cpu())
        dist.broadcast(torch.empty(3), src=0)
    assert [f["op"] for f in found.found] == ["allreduce_", "allreduce_", "broadcast_"], found.found


@check
def norm_without_gradients_on_the_device() -> None:
    """A rank whose parameters have no gradients yet (2BW's first step, a pipeline stage after a resume) adds a
    zero to the global norm: on its parameters' device, so the collective over the stages takes it."""
    weights = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    if dist.get_rank() == 1:
        weights[0].grad = torch.full((3,), 2.0)
    with HostTensorCheck(CPU) as found:
        norm = global_grad_norm(weights, across=dist.group.WORLD)
        clipped = clip_grad_norm_(weights, 1.0, across=dist.group.WORLD)
    assert found.found == [], found.found
    assert torch.allclose(norm, torch.tensor(12.0).sqrt()) and torch.allclose(clipped, norm), (norm, clipped)


@check
def two_bw_clipped_steps() -> None:
    """pp 2 with 2BW and clipping, 3 steps: every collective of every step takes tensors on the rank's device."""
    out = Path(tempfile.mkdtemp(prefix="collective-devices-"))  # each rank writes its own file
    windows = torch.randint(0, 256, (3 * 4, 9), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=4)
    module = GPTModule(preset="tiny", config_overrides={"n_layers": 2, "dim": 16, "n_heads": 2, "ffn_hidden": 32})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=3,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[CollectiveDevices(str(out))],
        strategy=MeshStrategy(pp=2, pp_schedule="2bw", pp_microbatches=2),
    )
    trainer.fit(module, data)
    found = json.loads((out / f"rank{dist.get_rank()}.json").read_text())
    assert found == [], found


if __name__ == "__main__":
    out_dir, selected = arguments()
    check.run_on_gloo(out_dir, selected)
