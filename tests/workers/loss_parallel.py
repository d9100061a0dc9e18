"""Loss parallel on tp=2: the zoo GPT's head output stays a DTensor sharded over the vocabulary into the loss,
the loss forward and backward run only all-reduces of one number a row (no all-gather), and loss and gradients equal the single-device ones.

Usage: torchrun --standalone --nproc_per_node=2 tests/workers/loss_parallel.py OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from lit_mesh.loss import cross_entropy
from lit_mesh.parallel.tensor import apply_tensor_parallel
from tests.workers import exit_skipping_teardown
from zoo.gpt import GPT, GPTConfig


class Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" or "all_gather" in func.__name__ or "allreduce" in func.__name__:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny")
    reference = GPT(config)
    model = GPT(config)
    model.load_state_dict(reference.state_dict())
    apply_tensor_parallel(model, model.parallel_plan(), mesh, sequence_parallel=True)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))

    want = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    want.backward()
    logits = model(tokens)
    result: dict[str, object] = {
        "is_dtensor": isinstance(logits, DTensor),
        "placements": str(getattr(logits, "placements", None)),
        "local_shape": list(logits.to_local().shape) if isinstance(logits, DTensor) else None,
        "sharded_over_vocab": isinstance(logits, DTensor) and logits.placements == (Shard(2),),
    }
    with Collectives() as seen:  # the loss's forward and its own backward (to the logits), not the model's
        loss = cross_entropy(logits, targets, chunk_rows=8)  # 4 chunks of rows
        torch.autograd.grad(loss, logits, retain_graph=True)
    result["collectives_in_loss"] = seen.names
    loss.backward()
    result["loss_error"] = abs(loss.item() - want.item())
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()
    }
    result["grad_error"] = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result))
    exit_skipping_teardown()
