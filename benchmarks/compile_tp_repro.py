"""torch.compile of tensor-parallel blocks against eager: do the gradients agree? (issue #21 item 5)

Two gloo ranks on the CPU. The zoo GPT (tiny: 1 block, dim 32) is sharded over tp=2 with lit-mesh's own plan
(`apply_tensor_parallel`, with or without sequence parallel); its block is optionally checkpointed and then
compiled in one of several ways. One forward/backward on a fixed batch; every gradient (gathered with
`full_tensor()`) is compared with the same model run eagerly on one device.

    python benchmarks/compile_tp_repro.py --backend aot_eager              # every case, one launch
    python benchmarks/compile_tp_repro.py --backend inductor --cases eager-sp,torch-forward-sp,lit-mesh-sp

The last stdout line is one JSON object: per case, the largest gradient difference (or the error raised).

Found on torch 2.13.0 (CPU, gloo), every `torch-*` case fails: the first block's input is an AsyncCollectiveTensor
(`to_local()` after RowwiseParallel's async redistribute); AOTAutograd unwraps it with `trigger_wait()`, which drops
requires_grad (a gradient hook on that input sees None), and the embedding's redistribute then fails in backward
("'Tensor' object has no attribute '_local_tensor'") or, with FSDP2 around, trains on wrong gradients.
pytorch/pytorch#179849 added the unwrap, #191113 restores requires_grad (after 2.13). The `lit-mesh-*` cases (a
`clone()` of such an input before the compiled forward) match to 6e-8 with aot_eager and inductor, except
selective checkpointing + inductor (wrong gradients: refused in lit_mesh/rules.py). Composable checkpoint + the
module compiled whole (torchtitan's order, with its checkpoint_wrapper instead) does not trace on 2.13.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import tempfile
import traceback
from argparse import ArgumentParser
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lit_mesh.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from lit_mesh.parallel.compile import apply_compile  # noqa: E402
from lit_mesh.parallel.tensor import apply_tensor_parallel  # noqa: E402
from zoo.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
TOLERANCE = 1e-5  # fp32, one step: eager TP differs from one device by reduction order only (~1e-7)


def _torch_forward(block, backend: str, fullgraph: bool) -> None:
    # plain torch: the bound forward is compiled, the module's hooks (checkpoint) stay eager
    block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)


def _torch_module(block, backend: str, fullgraph: bool) -> None:
    # plain torch, nn.Module.compile: the whole call, the module's own hooks (checkpoint) included; with
    # checkpointing applied first this is torchtitan's order (TP -> AC -> compile the checkpointed block)
    block.compile(backend=backend, fullgraph=fullgraph)


def _lit_mesh(block, backend: str, fullgraph: bool) -> None:
    # lit-mesh's compile_blocks: settles an AsyncCollectiveTensor input before the compiled forward
    apply_compile([block], backend, fullgraph)


# case -> (sequence_parallel, activation checkpointing, how to compile, fullgraph)
CASES = {
    "eager-sp": (True, "none", None, False),  # the control: eager TP must match
    "torch-forward-sp": (True, "none", _torch_forward, False),
    "torch-forward-sp-fullgraph": (True, "none", _torch_forward, True),
    "torch-forward-nosp": (False, "none", _torch_forward, False),
    "torch-module-sp": (True, "none", _torch_module, False),
    "torch-ac-then-module-sp-fullgraph": (True, "full", _torch_module, True),
    "lit-mesh-sp": (True, "none", _lit_mesh, False),
    "lit-mesh-sp-fullgraph": (True, "none", _lit_mesh, True),
    "lit-mesh-nosp": (False, "none", _lit_mesh, False),
    "lit-mesh-ac-full-sp": (True, "full", _lit_mesh, False),
    "lit-mesh-ac-selective-sp": (True, "selective", _lit_mesh, False),
}


def _max_grad_diff(model, reference) -> tuple[float, str]:
    worst, where = 0.0, ""
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diff = (grad - r.grad).abs().max().item()
        if diff > worst:
            worst, where = diff, name
    return worst, where


def run_case(name: str, backend: str, mesh) -> dict:
    sequence_parallel, ac, compile_fn, fullgraph = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, model.parallel_plan(), mesh, sequence_parallel, vocab_sharded_output=False)
    blocks = list(model.layers)
    apply_activation_checkpointing(blocks, ac)
    for block in blocks:
        if compile_fn is not None:
            compile_fn(block, backend, fullgraph)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for net in (reference, model):
        logits = net(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    worst, where = _max_grad_diff(model, reference)
    return {"max_grad_diff": worst, "worst_param": where, "ok": worst <= TOLERANCE}


def _rank(rank: int, world: int, port: int, backend: str, cases: list[str], out: str, anomaly: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.autograd.set_detect_anomaly(anomaly)  # names the forward line of a failing backward node
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {}
    for name in cases:
        try:
            results[name] = run_case(name, backend, mesh)
        except Exception as error:  # a case that raises is a finding, not the end of the run
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            if rank == 0:
                traceback.print_exc()
        if rank == 0:
            print(name, results[name], file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, inductor, eager)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    parser.add_argument("--port", type=int, default=29531, help="the ranks' rendezvous port; 0: a free one")
    parser.add_argument("--detect-anomaly", action="store_true", help="print the forward trace of a failing backward")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    port = args.port or _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        # the smoke test's fork launcher (benchmarks/_common.py) forks the ranks: they share this process's imports
        start_method = "fork" if os.environ.get("LIT_MESH_BENCH_LAUNCHER") == "fork" else "spawn"
        mp.start_processes(
            _rank, args=(2, port, args.backend, cases, out, args.detect_anomaly), nprocs=2, start_method=start_method
        )
        results = json.loads(Path(out).read_text())
    print(json.dumps({"torch": torch.__version__, "backend": args.backend, "cases": results}))


if __name__ == "__main__":
    main()
