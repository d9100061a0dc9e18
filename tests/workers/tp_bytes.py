"""1-D tensor parallel sends Megatron's bytes (run by tests/integration/test_tp_bytes.py on 2 ranks): one block of
the zoo GPT and one decoder layer of transformers' Llama under lit-mesh's plans, forward and backward, with and
without sequence parallelism. Bytes per rank (lit_mesh/monitor/comm.py) and calls per collective (torch's
CommDebugMode) against Megatron's count; the block's output and gradients against the same block on one device.

Usage: torchrun --nproc_per_node=2 tests/workers/tp_bytes.py OUT_DIR CHECK[,CHECK...]
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from lit_mesh.hf.registry import plan_for
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.grid.bytes import BlockShape, bytes_1d
from lit_mesh.parallel.tensor import apply_tensor_parallel
from lit_mesh.plan import ParallelPlan
from tests.workers.checks import Checks, arguments, assert_close_reduced
from zoo.gpt import GPT, GPTConfig, rope_cos_sin
from zoo.hf.configs import tiny_config

check = Checks()
BATCH, SEQ = 2, 8
GPT_CONFIG = GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
# Megatron: an all-gather of the attention's and of the MLP's input, a reduce-scatter of their outputs, mirrored in
# backward (SP); without SP an all-reduce after each region in forward and of each region's input gradient in backward
WANT_CALLS = {True: {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}, False: {"all_reduce": 4}}


def megatron_bytes(dim: int) -> float:
    """SP and without SP alike: 8 (p-1)/p tokens x dim elements (4 all-reduces of 2 (p-1)/p without SP)."""
    return bytes_1d(BlockShape(BATCH * SEQ, dim, 1, 1, 1, element_bytes=4), dist.get_world_size())


def sends_megatrons_bytes(
    model: nn.Module, plan: ParallelPlan, block_of: Callable[[nn.Module], nn.Module], dim: int, sp: bool, **kwargs
) -> None:
    """Shard `model` with its plan, run its block `block_of(model)` forward and backward on this rank's input, count
    what it sends, and compare its output and gradients with the unsharded block's."""
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, plan, build_device_mesh(MeshLayout(tp=dist.get_world_size()), "cpu")["tp"], sp)
    generator = torch.Generator().manual_seed(1)  # the same input and output gradient on every rank
    h = torch.randn(BATCH, SEQ, dim, generator=generator, requires_grad=True)
    grad_out = torch.randn(BATCH, SEQ, dim, generator=generator)
    ref_out = block_of(reference)(h, **kwargs)
    ref_out.backward(grad_out)

    rank, p = dist.get_rank(), dist.get_world_size()
    local = (lambda t: t.chunk(p, dim=1)[rank]) if sp else (lambda t: t)
    h_local = local(h.detach()).clone().requires_grad_()
    with CollectiveBytes() as counter, CommDebugMode() as calls:
        out = block_of(model)(h_local, **kwargs)
        out.backward(local(grad_out))
    sent = sum(counter.sent.values())
    assert sent == megatron_bytes(dim), f"sp={sp}: sent {sent} B, Megatron's count {megatron_bytes(dim)} B"
    got_calls = {str(op).split(".")[-1]: n for op, n in calls.get_comm_counts().items() if n}
    assert got_calls == WANT_CALLS[sp], f"sp={sp}: collectives {got_calls}, Megatron's {WANT_CALLS[sp]}"

    assert not isinstance(out, DTensor), "a block hands on plain tensors"
    assert_close_reduced(out, local(ref_out.detach()), dim, msg="block output")
    assert h.grad is not None and h_local.grad is not None
    assert_close_reduced(h_local.grad, local(h.grad), dim * 4, msg="input gradient")
    ref_grads = dict(block_of(reference).named_parameters())
    for name, param in block_of(model).named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert_close_reduced(grad, ref_grads[name].grad, BATCH * SEQ, msg=name)


def zoo_gpt_block(sp: bool) -> None:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    rope = rope_cos_sin(torch.arange(SEQ), GPT_CONFIG.head_dim, GPT_CONFIG.rope_theta)
    sends_megatrons_bytes(model, model.parallel_plan(), lambda m: m.layers[0], GPT_CONFIG.dim, sp, rope=rope)


def hf_llama_layer(sp: bool) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama"))
    dim = model.config.hidden_size
    rope = model.model.rotary_emb(torch.zeros(1, SEQ, dim), torch.arange(SEQ)[None])
    # layer 1: the plan shards layer 0's input over the sequence ("shard_input"), the others get it sharded
    sends_megatrons_bytes(model, plan_for(model), lambda m: m.model.layers[1], dim, sp, position_embeddings=rope)


@check
def zoo_gpt_block_sp() -> None:
    zoo_gpt_block(sp=True)


@check
def zoo_gpt_block_no_sp() -> None:
    zoo_gpt_block(sp=False)


@check
def hf_llama_layer_sp() -> None:
    hf_llama_layer(sp=True)


@check
def hf_llama_layer_no_sp() -> None:
    hf_llama_layer(sp=False)


if __name__ == "__main__":
    OUT, selected = arguments()
    check.run_on_gloo(OUT, selected)
