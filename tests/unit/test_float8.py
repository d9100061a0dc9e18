"""float8 (lit_mesh/parallel/float8.py): the option's refusals, and what the conversion converts, keeps and reports
(one process, no ranks; the trained runs: tests/integration/test_float8.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_mesh.errors import MeshConfigError
from lit_mesh.extras import MissingExtraError
from lit_mesh.mesh import MeshLayout
from lit_mesh.options import build_options
from lit_mesh.parallel import float8
from lit_mesh.rules import Facts, check

NEEDS_TORCHAO = "torchao is not installed: pip install 'lit-mesh[fp8]'"


def test_an_unknown_recipe_is_refused_with_the_choices() -> None:
    with pytest.raises(
        MeshConfigError, match=r"float8='e4m3' is not a float8 recipe; choose one of \['tensorwise', 'rowwise'\]"
    ):
        build_options(float8="e4m3")


def test_without_torchao_the_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(float8, "torchao_installed", lambda: False)
    with pytest.raises(
        MissingExtraError, match=r"torchao is needed for float8 training .* pip install 'lit-mesh\[fp8\]'"
    ):
        build_options(float8="tensorwise")
    assert build_options().float8.recipe is None  # without float8, torchao is never asked for


def test_grid_tensor_parallel_is_refused_with_the_fix() -> None:
    pytest.importorskip("torchao", reason=NEEDS_TORCHAO)  # the torchao rule comes first
    with pytest.raises(MeshConfigError, match=r"float8='rowwise' with tp_mode='2d'.*use tp_mode='1d', or float8=None"):
        build_options(float8="rowwise", tp=4, tp_mode="2d", dp_replicate=1)


def test_a_model_that_parallelised_itself_is_refused() -> None:
    options = build_options()
    options = type(options)(**{**options.__dict__, "float8": float8.Float8Options("tensorwise")})
    facts = Facts(options=options, layout=MeshLayout(dp_shard=2), model_name="Net", self_parallelised=True)
    with pytest.raises(MeshConfigError, match="configure_model parallelised Net itself.*convert_to_float8_training"):
        check("setup", facts, only=("float8_on_a_model_lit_mesh_parallelises",))


def test_a_gpu_without_float8_matmuls_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    options = build_options()
    options = type(options)(**{**options.__dict__, "float8": float8.Float8Options("tensorwise")})
    with pytest.raises(MeshConfigError, match=r"compute capability \(8, 0\).*8\.9 or newer"):
        check("launch", Facts(options=options, device_type="cuda"), only=("float8_needs_sm89_on_cuda",))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    check("launch", Facts(options=options, device_type="cuda"), only=("float8_needs_sm89_on_cuda",))  # H100: runs


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(32, hidden, bias=False)
        self.down = nn.Linear(hidden, 32, bias=False)
        self.norm = nn.LayerNorm(32)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.layers = nn.ModuleList([Block(64), Block(40)])  # 40: not a multiple of 16
        self.output = nn.Linear(32, 10, bias=False)


def test_block_linears_convert_and_the_rest_is_listed_with_the_reason() -> None:
    pytest.importorskip("torchao", reason=NEEDS_TORCHAO)
    net = Net()
    done = float8.convert_blocks(net, [list(net.layers)], "tensorwise", "cpu", fsdp_sharded=True)
    assert done.converted == ["layers.0.up", "layers.0.down"]
    assert all(float8.is_float8_linear(m) for m in (net.layers[0].up, net.layers[0].down))
    assert type(net.layers[1].up) is nn.Linear and type(net.output) is nn.Linear
    assert done.kept == [
        ("layers.1.up", "out_features=40 not a multiple of 16"),
        ("layers.1.down", "in_features=40 not a multiple of 16"),
        ("output", "outside the blocks: the embedding and the output head stay in high precision"),
    ]
    assert done.emulated and done.fsdp_float8_all_gather  # CPU: torchao's emulation; tensorwise: float8 all-gather
    report = done.report()
    assert report.splitlines()[0] == (
        "MeshStrategy: float8 'tensorwise' (emulated: no float8 matmul on this device; FSDP2 all-gathers its weights in"
        " float8): 2 linears converted"
    )
    assert "  float8: layers.{0}.up" in report and "  kept in high precision: layers.1.up (out_features=40" in report


def test_rowwise_all_gathers_in_high_precision_and_keeps_torch_tp_styles() -> None:
    pytest.importorskip("torchao", reason=NEEDS_TORCHAO)
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    rowwise, tensorwise = Net(), Net()
    assert not float8.convert_blocks(rowwise, [list(rowwise.layers)], "rowwise", "cpu", True).fsdp_float8_all_gather
    float8.convert_blocks(tensorwise, [list(tensorwise.layers)], "tensorwise", "cpu", False)
    # rowwise: torchao has no float8 TP styles for it; plain ColwiseParallel/RowwiseParallel apply
    assert float8.float8_tp_style(rowwise.layers[0].up, "colwise", None) is None
    assert isinstance(float8.float8_tp_style(tensorwise.layers[0].up, "colwise", None), Float8ColwiseParallel)
    assert isinstance(float8.float8_tp_style(tensorwise.layers[0].down, "rowwise", None), Float8RowwiseParallel)
    assert float8.float8_tp_style(tensorwise.layers[1].up, "colwise", None) is None  # kept: an nn.Linear


def test_emulated_float8_stays_near_the_high_precision_linear() -> None:
    pytest.importorskip("torchao", reason=NEEDS_TORCHAO)
    torch.manual_seed(0)
    net = Net()
    reference = nn.Linear(32, 64, bias=False)
    reference.load_state_dict(net.layers[0].up.state_dict())
    float8.convert_blocks(net, [list(net.layers)], "tensorwise", "cpu", False)
    x = torch.randn(4, 16, 32)
    ours, theirs = net.layers[0].up(x), reference(x)
    # e4m3 keeps 3 mantissa bits: a relative rounding of up to 2^-4 per operand, far less on the sum's average
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    assert not torch.equal(ours, theirs)  # float8-rounded operands: not the fp32 matmul
