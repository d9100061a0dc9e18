"""torch.compile per block: every block's forward goes through the compiler; numbers stay those of eager."""

from __future__ import annotations

import pytest
import torch

from lit_mesh import MeshConfigError, MeshStrategy
from lit_mesh.parallel.compile import apply_compile
from zoo.gpt import GPT, GPTConfig


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


def test_compiled_blocks_under_tensor_parallel_are_refused_before_start() -> None:
    with pytest.raises(MeshConfigError, match="compile_blocks=True with tp=2"):
        MeshStrategy(tp=2, compile_blocks=True)
    MeshStrategy(tp=2, compile_blocks=False)  # eager TP stays available
