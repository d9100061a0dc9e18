"""Bytes per rank per transformer block (forward + backward) of 1-D, 2-D, 2.5-D and 3-D tensor parallel, from the
formulas of lit_mesh/parallel/grid/bytes.py, over tp sizes, with the crossover (the smallest tp at which a grid
scheme sends fewer bytes per rank than 1-D); and the formulas against the collectives a tiny block really issues on
gloo ranks (--measure): bytes from the byte counter (lit_mesh/monitor/comm.py), calls per collective from torch's
CommDebugMode, 1-D at tp 2, 4 and 8 (Megatron's count) and the grid schemes at 4 and 8.

    python benchmarks/tp_bytes.py --preset llama3-8b --tokens 16384 --measure

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import emit, environment, in_worker, launch, print_result  # noqa: E402
from lit_mesh.parallel.grid.bytes import GRID_BLOCK_BYTES, BlockShape, bytes_1d  # noqa: E402
from lit_mesh.parallel.grid.grid import fits_grid  # noqa: E402
from zoo.gpt import GPTConfig  # noqa: E402

TP_SIZES = (2, 4, 8, 9, 16, 18, 25, 27, 32, 36, 49, 50, 64, 72, 98, 125, 128)
DEPTH = 2  # the 2.5-D depth tabulated
# the tiny block measured on gloo (the sizes of tests/workers/tp_grid.py): batch 4 x sequence 16
TINY = GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden=64, max_seq_len=32)
TINY_BATCH, TINY_SEQ = 4, 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", help="zoo GPT preset whose block is tabulated")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the tp group's batch (batch x sequence)")
    parser.add_argument("--element-bytes", type=int, default=2, help="bytes per element (2: bf16)")
    parser.add_argument("--measure", action="store_true", help="also count the bytes on 2, 4 and 8 gloo ranks")
    parser.add_argument("--timeout", type=float, default=600)
    return parser.parse_args(argv)


def schemes(p: int) -> dict[str, Any]:
    """The tp_modes whose grid p ranks form, with their tp_depth."""
    out: dict[str, Any] = {}
    for mode in GRID_BLOCK_BYTES:
        depth = DEPTH if mode == "2.5d" else None
        if fits_grid(p, mode, depth):
            out[mode] = depth
    return out


def table(shape: BlockShape) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, crossover = [], {}
    for p in TP_SIZES:
        row = {"tp": p, "1d": bytes_1d(shape, p)}
        for mode, depth in schemes(p).items():
            row[mode] = GRID_BLOCK_BYTES[mode](shape, p, depth)
            if row[mode] < row["1d"]:
                crossover.setdefault(mode, p)
        rows.append(row)
    return rows, crossover


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: one tiny block's bytes per rank and collective calls, counted, for 1-D and the grid schemes
    of this world size."""
    from torch.distributed.tensor.debug import CommDebugMode

    from lit_mesh.mesh import MeshLayout, build_device_mesh
    from lit_mesh.monitor.comm import CollectiveBytes
    from lit_mesh.parallel.grid.apply import parallelize_grid
    from lit_mesh.parallel.tensor import apply_tensor_parallel
    from lit_mesh.plan import PlanOwner
    from zoo.gpt import GPT, rope_cos_sin

    dist.init_process_group("gloo")
    p = dist.get_world_size()
    modes = {2: [], 4: [("2d", None)], 8: [("2.5d", DEPTH), ("3d", None)]}[p]  # 8 ranks: 2 x 2 x 2 either way
    views = build_device_mesh(MeshLayout(tp=p), "cpu")

    def counted(model: GPT, h: torch.Tensor) -> dict[str, Any]:
        rope = rope_cos_sin(torch.arange(TINY_SEQ), model.config.attention_head_dim, TINY.rope_theta)
        with CollectiveBytes() as counter, CommDebugMode() as calls:
            model.layers[0](h, rope=rope).sum().backward()
        ops = {str(op).split(".")[-1]: n for op, n in calls.get_comm_counts().items()}
        return {"bytes": sum(counter.sent.values()), "calls": dict(sorted(ops.items()))}

    one_d = GPT(TINY)
    apply_tensor_parallel(one_d, one_d.parallel_plan(), views["tp"], sequence_parallel=True)
    measured = {"1d": counted(one_d, torch.randn(TINY_BATCH, TINY_SEQ // p, TINY.dim, requires_grad=True))}
    for mode, depth in modes:
        grid_model = GPT(dataclasses.replace(TINY, n_heads=4, n_kv_heads=2))
        grid = parallelize_grid([PlanOwner("model", grid_model, grid_model.parallel_plan())], views, mode, depth)
        # the layout between blocks: batch / (depth q) (3-D: / q^2, depth = q), features / q
        h = torch.randn(TINY_BATCH // (grid.depth * grid.q), TINY_SEQ, TINY.dim // grid.q, requires_grad=True)
        measured[mode] = counted(grid_model, h)
    emit({"world_size": p, "measured": measured})
    dist.destroy_process_group()


def tiny_shape() -> BlockShape:
    return BlockShape(TINY_BATCH * TINY_SEQ, TINY.dim, 4, 2, TINY.ffn_hidden, element_bytes=4)


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    c = GPTConfig.from_preset(args.preset)
    shape = BlockShape(args.tokens, c.dim, c.n_heads, c.n_kv_heads, c.ffn_hidden, args.element_bytes)
    rows, crossover = table(shape)
    result: dict[str, Any] = {
        "preset": args.preset,
        "tokens": args.tokens,
        "element_bytes": args.element_bytes,
        "depth_2_5d": DEPTH,
        "schemes": ["1d", *GRID_BLOCK_BYTES],
        "rows": rows,
        "crossover": crossover,
        "measured": [],
    }
    if args.measure:
        for p in (2, 4, 8):
            counted = launch(__file__, argv, p, args.timeout)["measured"]
            tiny = tiny_shape()
            for mode, got in counted.items():
                one_d = dataclasses.replace(tiny, heads=TINY.n_heads, kv_heads=TINY.n_kv_heads)
                depth = DEPTH if mode == "2.5d" else None
                want = bytes_1d(one_d, p) if mode == "1d" else GRID_BLOCK_BYTES[mode](tiny, p, depth)
                row = {"tp": p, "scheme": mode, "counted": got["bytes"], "formula": want, "calls": got["calls"]}
                result["measured"].append({**row, "counted_over_formula": got["bytes"] / want})
    result["environment"] = environment()
    print_result(result)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if in_worker():
        worker(parse_args(arguments))
    else:
        drive(parse_args(arguments), arguments)
