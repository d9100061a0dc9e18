"""torch.compile per block: every block's forward goes through the compiler; numbers stay those of eager."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from lit_mesh import MeshConfigError, MeshStrategy
from lit_mesh.parallel.compile import apply_compile
from zoo.gpt import GPT, GPTConfig, rope_cos_sin


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", n_layers=3))


def test_each_block_is_compiled_and_computes_the_same() -> None:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    calls = [0]

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)

        def run(*args: object) -> object:
            calls[0] += 1
            return graph.forward(*args)

        return run

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    eager = _model()
    compiled = _model()
    apply_compile(list(compiled.layers), backend=counting_backend)
    out, ref = compiled(tokens), eager(tokens)
    assert len(graphs) == 1  # identical blocks share one graph, their parameters passed in as inputs
    assert calls[0] == len(compiled.layers)  # every block ran compiled code; the root stays eager
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names unchanged: checkpoints stay valid


def test_unknown_backend_is_named() -> None:
    with pytest.raises(MeshConfigError, match="compile_backend='fast' is not a torch.compile backend"):
        MeshStrategy(compile_blocks=True, compile_backend="fast")


def test_compiled_blocks_under_tensor_parallel_are_accepted() -> None:
    # refused until the AsyncCollectiveTensor input was settled (lit_mesh/parallel/compile.py); parity:
    # tests/integration/test_parity.py (fsdp2_tp2-compile, tp2-compile-inductor)
    MeshStrategy(tp=2, compile_blocks=True, compile_backend="aot_eager")


def test_async_tp_on_cpu_is_refused_before_any_process_starts() -> None:
    strategy = MeshStrategy(tp=2, compile_blocks=True, async_tp=True)  # the arguments alone are consistent
    with pytest.raises(MeshConfigError, match="async_tp=True on device 'cpu' with process group backend 'gloo'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)


def test_async_tp_needs_compiled_sequence_parallel_blocks() -> None:
    with pytest.raises(MeshConfigError, match="set compile_blocks=True, compile_backend='inductor', tp > 1 and"):
        MeshStrategy(tp=2, async_tp=True)
    with pytest.raises(MeshConfigError, match="sequence_parallel=False"):
        MeshStrategy(tp=2, compile_blocks=True, sequence_parallel=False, async_tp=True)


class _PendingCollective(torch.autograd.Function):
    """What DTensor.to_local() hands on after an async redistribute: an AsyncCollectiveTensor with a grad_fn."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return AsyncCollectiveTensor(x.detach().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


def test_settled_block_input_keeps_its_gradient() -> None:
    """The first block's input under TP is an AsyncCollectiveTensor; the compiled forward gets a plain tensor
    that still carries the gradient back to it (across ranks: benchmarks/compile_tp_repro.py, the parity runs)."""
    torch._dynamo.reset()
    block = _model().layers[0]
    apply_compile([block], backend="aot_eager")
    source = torch.randn(2, 8, 64, requires_grad=True)
    x = _PendingCollective.apply(source)
    rope = rope_cos_sin(torch.arange(8), block.attention.head_dim, 10000.0)
    block(x, rope=rope).sum().backward()
    assert source.grad is not None and source.grad.abs().sum() > 0
