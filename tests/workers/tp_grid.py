"""The grid tp_modes over real gloo groups (run by tests/integration/test_tp_grid.py), all in one launch of 8
ranks: 2-D (q = 2) on two replicas of a 4-rank grid, 2.5-D (d = 2, q = 2) and 3-D (q = 2) on all 8 (3-D's own
checks: tests/workers/tp3d_cases.py).

Usage: torchrun --nproc_per_node=8 tests/workers/tp_grid.py OUT_DIR CHECK[,CHECK...]
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.options import build_options
from lit_mesh.parallel.apply import parallelize
from lit_mesh.parallel.grid.apply import parallelize_grid
from lit_mesh.parallel.grid.bytes import GRID_BLOCK_BYTES, BlockShape, bytes_1d, linear_bytes_3d, linear_bytes_summa
from lit_mesh.parallel.grid.grid import local_block
from lit_mesh.parallel.grid.summa import LAYOUT, SummaScheme
from lit_mesh.parallel.tensor import apply_tensor_parallel
from lit_mesh.plan import PlanOwner
from tests.workers import tp3d_cases as three_d
from tests.workers.checks import Checks, arguments, assert_close_reduced
from zoo.gpt import GPT, GPTConfig, rope_cos_sin

check = Checks()
CONFIG = GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
BATCH, SEQ = 4, 16


@dataclasses.dataclass(frozen=True)
class Case:
    """A grid tp_mode on the 8 ranks: 2-D as two replicas of a 2 x 2 grid (each grid 4 ranks), 2.5-D on all 8."""

    tp_mode: str
    tp_depth: int | None
    layout: MeshLayout

    @property
    def depth(self) -> int:
        return self.tp_depth or 1


TWO_D = Case("2d", None, MeshLayout(dp_replicate=2, tp=4))
TWO_HALF_D = Case("2.5d", 2, MeshLayout(tp=8))
THREE_D = Case("3d", None, MeshLayout(tp=8))


@functools.cache
def views(layout: MeshLayout):
    """One mesh per layout for every check (its process groups made once)."""
    return build_device_mesh(layout, "cpu")


def grid_of(model: nn.Module):
    return next(m.grid for m in model.modules() if hasattr(m, "grid"))


def block_of(x: torch.Tensor, grid) -> torch.Tensor:
    """This rank's block of a (batch, ..., features) tensor in the SUMMA layout."""
    return local_block(local_block(x, grid, 0, LAYOUT.batch), grid, -1, LAYOUT.features)


def grid_gpt(case: Case, seed: int = 0) -> tuple[nn.Module, GPT]:
    """(a root holding the GPT with the grid plan applied, the same GPT on one device). 2.5-D goes through
    parallelize with MeshStrategy's options (the tp_mode dispatch and its rules); 2-D's two replicas (no data
    parallelism applied) through the grid's own entry."""
    torch.manual_seed(seed)
    root = nn.Module()
    root.model = GPT(CONFIG)
    reference = copy.deepcopy(root.model)
    if case.layout.dp > 1:
        owner = PlanOwner("model", root.model, root.model.parallel_plan())
        parallelize_grid([owner], views(case.layout), case.tp_mode, case.tp_depth)
        return root, reference
    options = build_options(
        dp=None,
        dp_replicate=None,
        dp_shard=None,
        tp=case.layout.tp,
        cp=1,
        cp_style="ring",
        pp=1,
        ep=1,
        pp_schedule="1f1b",
        pp_microbatches=None,
        pp_stages_per_rank=None,
        pp_split=None,
        sequence_parallel=None,
        activation_checkpointing="none",
        ac_every_n_blocks=1,
        compile_blocks=False,
        compile_backend="inductor",
        async_tp=False,
        stop_on_nonfinite_loss=True,
        save_distributed_checkpoint=True,
        async_save=False,
        grad_compression=None,
        topology=None,
        strict_topology=False,
        allreduce="auto",
        tp_mode=case.tp_mode,
        tp_depth=case.tp_depth,
    )
    parallelize(root, views(case.layout), options, precision="32-true")
    return root, reference


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def linear_matches_nn_linear(case: Case) -> None:
    """Outputs, input gradients and weight (and bias) gradients of the SUMMA linear equal nn.Linear's, within the
    rounding of sums taken in another order (reduction_atol: the grid splits each sum over ranks)."""
    grid = parallelize_grid([], views(case.layout), case.tp_mode, case.tp_depth)
    batch, seq, n_in, n_out = 8, 3, 16, 24
    for bias in (False, True):
        torch.manual_seed(1)  # nn.Linear's initialisation; the inputs from their own generator, the same on every rank
        linear = nn.Linear(n_in, n_out, bias=bias)
        gen = torch.Generator().manual_seed(2 + bias)
        x = torch.randn(batch, seq, n_in, generator=gen).requires_grad_()
        upstream = torch.randn(batch, seq, n_out, generator=gen)
        (linear(x) * upstream).sum().backward()
        summa = SummaScheme().linear(copy.deepcopy(linear), grid, "colwise")
        x_local = block_of(x.detach(), grid).clone().requires_grad_()
        y_local = summa(x_local)
        (y_local * block_of(upstream, grid)).sum().backward()
        # each output sums n_in products, each input gradient n_out, each weight (bias) gradient batch x seq tokens
        assert_close_reduced(y_local, block_of(linear(x).detach(), grid), n_in, msg="output")
        assert_close_reduced(x_local.grad, block_of(x.grad, grid), n_out, msg="input gradient")
        assert summa.weight.to_local().shape == (n_out // grid.q, n_in // grid.q)
        assert_close_reduced(full(summa.weight.grad), linear.weight.grad, batch * seq, msg="weight gradient")
        if bias:
            assert_close_reduced(full(summa.bias.grad), linear.bias.grad, batch * seq, msg="bias gradient")


def gpt_loss_matches_one_device(case: Case) -> None:
    """10 AdamW steps with gradient clipping: every loss within 1e-4 relative of one device, then the parameters."""
    root, reference = grid_gpt(case)
    model = root.model
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # lr 1e-3: Adam's normalised update turns last-bit gradient differences near zero into lr-sized ones
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for step in range(10):
        batch = tokens(step)
        losses = []
        for m, o in ((model, opt), (reference, ref_opt)):
            loss = loss_of(m, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]), (
            f"step {step}: {losses[0]} vs one device {losses[1]}"
        )
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        diff = (full(p) - ref).abs().max().item()
        assert diff <= 1e-4, f"{name} differs from one device by {diff}"


@check
def checkpoint_round_trip_2_5d() -> None:
    """DCP save of the grid parameters and optimizer state; load into a fresh grid model and into one device."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, reference = grid_gpt(TWO_HALF_D)
    model = root.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, tokens(0)).backward()
    opt.step()
    saved = {name: full(p).clone() for name, p in model.state_dict().items()}
    model_state, opt_state = get_state_dict(model, opt)
    path = OUT / "ckpt"
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=path)
    fresh_root, _ = grid_gpt(TWO_HALF_D, seed=5)
    fresh_opt = torch.optim.AdamW(fresh_root.model.parameters(), lr=1e-2)
    loss_of(fresh_root.model, tokens(1)).backward()
    fresh_opt.step()  # optimizer state exists to be overwritten
    model_state, opt_state = get_state_dict(fresh_root.model, fresh_opt)
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh_root.model, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, p in fresh_root.model.state_dict().items():
        torch.testing.assert_close(full(p), saved[name], rtol=0, atol=0)
    one_device = {"model": reference.state_dict()}  # the single-device names and shapes
    dcp.load(one_device, checkpoint_id=path)
    for name, p in one_device["model"].items():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0)
    # the next step continues alike from either copy of the optimizer state
    for o, m in ((opt, model), (fresh_opt, fresh_root.model)):
        o.zero_grad()
        loss_of(m, tokens(2)).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh_root.model.parameters()):
        torch.testing.assert_close(full(a), full(b), rtol=0, atol=0, msg=name)


def measured(run) -> float:
    with CollectiveBytes() as counter:
        run()
    return sum(counter.sent.values())


def bytes_match_formulas(case: Case) -> None:
    """Bytes per rank of one SUMMA linear and of one GPT block (forward + backward) equal tensor_nd_bytes's
    formulas; and those of 1-D TP (sequence parallel) on the same tp ranks."""
    p, tp_mode = case.layout.tp, case.tp_mode
    root, _ = grid_gpt(case)
    grid = grid_of(root.model)
    depth = grid.depth  # the batch is split depth x q ways (3-D: depth = q)
    tokens_ = BATCH * SEQ
    linear = root.model.layers[0].feed_forward.w2
    x = torch.randn(BATCH // (depth * grid.q), SEQ, CONFIG.ffn_hidden // grid.q, requires_grad=True)
    got = measured(lambda: linear(x).sum().backward())
    if tp_mode == "3d":  # w2 takes the layout inside the MLP: batch / q^2 (depth = q), features / q
        want = linear_bytes_3d(tokens_, CONFIG.ffn_hidden, CONFIG.dim, grid.q, 4)
    else:
        want = linear_bytes_summa(tokens_, CONFIG.ffn_hidden, CONFIG.dim, grid.q, depth, 4)
    assert got == want, f"{tp_mode} linear: counted {got} bytes, formula {want}"
    shape = BlockShape(tokens_, CONFIG.dim, CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.ffn_hidden)
    rope = rope_cos_sin(torch.arange(SEQ), CONFIG.attention_head_dim, CONFIG.rope_theta)
    h = torch.randn(BATCH // (depth * grid.q), SEQ, CONFIG.dim // grid.q, requires_grad=True)
    got = measured(lambda: root.model.layers[0](h, rope=rope).sum().backward())
    want = GRID_BLOCK_BYTES[tp_mode](shape, p, case.tp_depth)
    assert abs(got - want) < 1e-6 * want, f"{tp_mode} block: counted {got} bytes, formula {want}"
    torch.manual_seed(0)
    one_d = GPT(dataclasses.replace(CONFIG, n_heads=p, n_kv_heads=p))  # 1-D splits heads over all p ranks
    apply_tensor_parallel(one_d, one_d.parallel_plan(), views(case.layout)["tp"], sequence_parallel=True)
    h = torch.randn(BATCH, SEQ // p, CONFIG.dim, requires_grad=True)
    rope = rope_cos_sin(torch.arange(SEQ), one_d.config.attention_head_dim, CONFIG.rope_theta)
    got = measured(lambda: one_d.layers[0](h, rope=rope).sum().backward())
    want = bytes_1d(shape, p)
    assert abs(got - want) < 1e-6 * want, f"1-D block: counted {got} bytes, formula {want}"


@check
def linear_matches_nn_linear_2d() -> None:
    linear_matches_nn_linear(TWO_D)


@check
def linear_matches_nn_linear_2_5d() -> None:
    linear_matches_nn_linear(TWO_HALF_D)


@check
def gpt_loss_matches_one_device_2_5d() -> None:
    """2-D's: tests/integration/test_parity.py (tp4-2d, through MeshStrategy and the CLI, on 4 ranks)."""
    gpt_loss_matches_one_device(TWO_HALF_D)


@check
def bytes_match_formulas_2d() -> None:
    bytes_match_formulas(TWO_D)


@check
def bytes_match_formulas_2_5d() -> None:
    bytes_match_formulas(TWO_HALF_D)


@check
def colwise_linear_matches_nn_linear_3d() -> None:
    three_d.linear_matches_nn_linear(parallelize_grid([], views(THREE_D.layout), "3d", None), "colwise")


@check
def rowwise_linear_matches_nn_linear_3d() -> None:
    three_d.linear_matches_nn_linear(parallelize_grid([], views(THREE_D.layout), "3d", None), "rowwise")


@check
def norm_and_feed_forward_keep_layout_3d() -> None:
    three_d.norm_and_feed_forward_keep_layout_a(parallelize_grid([], views(THREE_D.layout), "3d", None))


@check
def gpt_loss_matches_one_device_3d() -> None:
    gpt_loss_matches_one_device(THREE_D)


@check
def checkpoint_to_one_device_3d() -> None:
    root, reference = grid_gpt(THREE_D)
    three_d.checkpoint_loads_into_one_device(root.model, reference, OUT / "ckpt_3d")


@check
def bytes_match_formulas_3d() -> None:
    bytes_match_formulas(THREE_D)


if __name__ == "__main__":
    OUT, selected = arguments()
    check.run_on_gloo(OUT, selected)
