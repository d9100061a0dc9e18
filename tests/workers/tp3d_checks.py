"""3-D tensor parallel (tp_mode="3d") on 8 gloo ranks (q = 2), against single-process references every rank
computes whole (run by tests/integration/test_tensor_3d.py).

Usage: torchrun --nproc_per_node=8 tests/workers/tp3d_checks.py OUT_DIR CHECK[,CHECK...]
Each check is its own pytest id (tests/worker_checks.py); rank r writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.tensor_3d import I, J, L, LAYOUT_A, LAYOUT_B, Linear3D
from lit_mesh.parallel.tensor_grid import ActivationLayout, TPGrid, build_grid, local_block
from lit_mesh.parallel.tensor_nd import GridRMSNorm, parallelize_grid
from lit_mesh.parallel.tensor_nd_bytes import BlockShape, bytes_3d, linear_bytes_3d
from lit_mesh.plan import PlanOwner
from tests.workers import exit_skipping_teardown
from tests.workers.checks import Checks, arguments
from tests.workers.tp_grid import BATCH as GPT_BATCH, CONFIG, SEQ as GPT_SEQ, full, loss_of, measured, tokens
from zoo.gpt import GPT, rope_cos_sin

check = Checks()
BATCH, SEQ, N_IN, N_OUT = 8, 3, 8, 12  # batch split q^2 = 4 ways; features divisible by q^2
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, the project's parity tolerance
_GRID: list[TPGrid] = []


@functools.cache
def views():
    return build_device_mesh(MeshLayout(tp=8), "cpu")


def grid() -> TPGrid:
    if not _GRID:
        _GRID.append(build_grid(views().root, "3d", 2, 2))
    return _GRID[0]


def piece(whole: torch.Tensor, g: TPGrid, layout: ActivationLayout) -> torch.Tensor:
    """This rank's block of a whole (batch, ..., features) tensor in `layout`."""
    return local_block(local_block(whole, g, 0, layout.batch), g, -1, layout.features).contiguous()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # the same on every rank


def local_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The shard of `whole` a DTensor placed like `like` holds on this rank."""
    return distribute_tensor(whole, like.device_mesh, like.placements).to_local()


def linear_parity(style: str) -> None:
    g = grid()
    layout_in, layout_out = (LAYOUT_A, LAYOUT_B) if style == "colwise" else (LAYOUT_B, LAYOUT_A)
    reference = nn.Linear(N_IN, N_OUT, bias=False)
    reference.weight.data = randn(N_OUT, N_IN, seed=1)
    x = randn(BATCH, SEQ, N_IN, seed=2).requires_grad_()
    grad_y = randn(BATCH, SEQ, N_OUT, seed=3)
    y = reference(x)
    y.backward(grad_y)

    linear = Linear3D(reference, g, style)
    assert linear.weight.shape == (N_OUT, N_IN) and linear.weight.to_local().numel() == N_OUT * N_IN // 8
    x_piece = piece(x.detach(), g, layout_in).requires_grad_()
    with CollectiveBytes() as counter:
        y_piece = linear(x_piece)
        y_piece.backward(piece(grad_y, g, layout_out))
    torch.testing.assert_close(y_piece, piece(y.detach(), g, layout_out), **TOL)
    torch.testing.assert_close(x_piece.grad, piece(x.grad, g, layout_in), **TOL)
    torch.testing.assert_close(linear.weight.grad.to_local(), local_of(reference.weight.grad, linear.weight), **TOL)
    # the counter's ring model, group by group, equals the closed form
    names = {dim: g.group((dim,)).group_name for dim in (I, J, L)}
    assert set(counter.sent) == set(names.values()), (dict(counter.sent), names)
    want = linear_bytes_3d(BATCH * SEQ, N_IN, N_OUT, q=2, element_bytes=4)
    assert sum(counter.sent.values()) == want, (dict(counter.sent), want)
    # the weight's group (i) moves its block twice: (q-1)/q of (in/q x out/q) fp32 each way
    assert counter.sent[names[I]] == 2 * (1 / 2) * (N_IN // 2) * (N_OUT // 2) * 4, dict(counter.sent)


@check
def colwise_linear_matches_nn_linear() -> None:
    """colwise (contracts over j): output, input gradient, weight gradient and bytes."""
    linear_parity("colwise")


@check
def rowwise_linear_matches_nn_linear() -> None:
    """rowwise (contracts over l): output, input gradient, weight gradient and bytes."""
    linear_parity("rowwise")


@check
def norm_and_feed_forward_keep_layout_a() -> None:
    """RMSNorm -> w1 (A -> B) -> silu -> w2 (B -> A), against nn modules: the layouts compose, the norm's weight
    gradient is summed over the ranks that share it, and clipping sees the global norm of DTensor gradients."""
    g = grid()
    norm, w1, w2 = nn.RMSNorm(N_IN, eps=1e-5), nn.Linear(N_IN, N_OUT, bias=False), nn.Linear(N_OUT, N_IN, bias=False)
    norm.weight.data = 1 + randn(N_IN, seed=4) / 4
    w1.weight.data, w2.weight.data = randn(N_OUT, N_IN, seed=5), randn(N_IN, N_OUT, seed=6)
    x = randn(BATCH, SEQ, N_IN, seed=7).requires_grad_()
    y = w2(F.silu(w1(norm(x))))
    y.backward(randn(*y.shape, seed=8))

    norm_3d = GridRMSNorm(norm, g, LAYOUT_A)
    w1_3d, w2_3d = Linear3D(w1, g, "colwise"), Linear3D(w2, g, "rowwise")
    x_3d = piece(x.detach(), g, LAYOUT_A).requires_grad_()
    y_3d = w2_3d(F.silu(w1_3d(norm_3d(x_3d))))
    y_3d.backward(piece(randn(*y.shape, seed=8), g, LAYOUT_A))
    torch.testing.assert_close(y_3d, piece(y.detach(), g, LAYOUT_A), **TOL)
    torch.testing.assert_close(x_3d.grad, piece(x.grad, g, LAYOUT_A), **TOL)
    for module, module_3d in ((norm, norm_3d), (w1, w1_3d), (w2, w2_3d)):
        torch.testing.assert_close(module_3d.weight.grad.full_tensor(), module.weight.grad, **TOL)
    expected = nn.utils.clip_grad_norm_([norm.weight, w1.weight, w2.weight], 1.0)
    got = nn.utils.clip_grad_norm_([norm_3d.weight, w1_3d.weight, w2_3d.weight], 1.0)
    torch.testing.assert_close(got.full_tensor(), expected, **TOL)


def gpt_3d() -> tuple[GPT, GPT]:
    """(the zoo GPT with its plan applied on the 3-D grid, the same GPT on one device)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    parallelize_grid([PlanOwner("model", model, model.parallel_plan())], views(), "3d", None)
    return model, reference


@check
def gpt_loss_matches_one_device() -> None:
    """10 AdamW steps: every loss within 1e-4 relative of one device; the trained parameters saved with DCP load
    into the single-device GPT's state dict. (Clipping DTensor gradients: norm_and_feed_forward_keep_layout_a; here
    its per-parameter all-reduces would double the check's time on 8 ranks.)"""
    model, reference = gpt_3d()
    assert isinstance(model.layers[0].attention.wq, Linear3D) and all(isinstance(p, DTensor) for p in model.parameters())
    pairs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for m in (model, reference)]
    for step in range(10):
        got, want = [], []
        for (m, optimizer), out in zip(pairs, (got, want)):
            loss = loss_of(m, tokens(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        assert abs(got[0] - want[0]) <= 1e-4 * abs(want[0]), f"step {step}: 3-D {got[0]}, one device {want[0]}"
    path = OUT_DIR / "gpt_3d"
    dcp.save(model.state_dict(), checkpoint_id=path)
    loaded = {name: torch.zeros_like(p) for name, p in reference.state_dict().items()}
    dcp.load(loaded, checkpoint_id=path)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(loaded[name], p, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(full(model.state_dict()[name]), loaded[name], rtol=0, atol=0, msg=name)


@check
def gpt_block_bytes_match_formula() -> None:
    """Bytes per rank of one GPT block in layout A, forward + backward, equal tensor_nd_bytes.bytes_3d."""
    model, _ = gpt_3d()
    h = torch.randn(GPT_BATCH // 4, GPT_SEQ, CONFIG.dim // 2, requires_grad=True)
    rope = rope_cos_sin(torch.arange(GPT_SEQ), CONFIG.head_dim, CONFIG.rope_theta)
    got = measured(lambda: model.layers[0](h, rope=rope).sum().backward())
    want = bytes_3d(BlockShape(GPT_BATCH * GPT_SEQ, CONFIG.dim, CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.ffn_hidden), 8)
    assert abs(got - want) < 1e-6 * want, f"3-D block: counted {got} bytes, formula {want}"


if __name__ == "__main__":
    OUT_DIR, selected = arguments()
    dist.init_process_group("gloo")
    check.run(selected)
    check.write(OUT_DIR, dist.get_rank())
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    exit_skipping_teardown()
