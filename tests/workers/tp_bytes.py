"""1-D tensor parallel sends Megatron's bytes (run by tests/integration/test_tp_bytes.py on 2 ranks): one block of
the zoo GPT and one decoder layer of transformers' Llama under lit-mesh's plans, forward and backward, with and
without sequence parallelism. Bytes per rank (lit_mesh/monitor/comm.py) and calls per collective (torch's
CommDebugMode) against Megatron's count; the block's output and gradients against the same block on one device.
Under SP without AC a block keeps only the sequence shards of its gathered inputs and gathers them again in backward
(lit_mesh/parallel/regather.py): bit-identical to keeping them whole, two all-gathers more, nothing whole kept.

Usage: torchrun --nproc_per_node=2 tests/workers/tp_bytes.py OUT_DIR CHECK[,CHECK...]
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import lit_mesh.parallel.hidden_states as hidden_states
from lit_mesh.hf.registry import plan_for
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.grid.bytes import BlockShape, bytes_1d
from lit_mesh.parallel.regather import regather_in_backward
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


def regathers_bit_identically(
    model: nn.Module, plan: ParallelPlan, block_of: Callable[[nn.Module], nn.Module], dim: int, **kwargs
) -> None:
    """The same SP block with and without re-gathering in backward: the same output and gradients bit for bit, two
    all-gathers more in backward, and no all-gathered tensor alive once the forward returns (one kept whole without
    re-gathering: the check can tell); saved-tensor hooks around the block still get every other tensor it saves. A
    kept shard modified in place fails the backward by name."""
    plain = copy.deepcopy(model)
    mesh = build_device_mesh(MeshLayout(tp=dist.get_world_size()), "cpu")["tp"]
    for m in (model, plain):
        apply_tensor_parallel(m, plan, mesh, True)
    regather_in_backward(block_of(model))
    generator = torch.Generator().manual_seed(2)
    rank, p = dist.get_rank(), dist.get_world_size()
    h = torch.randn(BATCH, SEQ, dim, generator=generator).chunk(p, dim=1)[rank]
    grad_out = torch.randn(BATCH, SEQ, dim, generator=generator).chunk(p, dim=1)[rank]
    noted = hidden_states.note_gathered
    gathered: list[weakref.ref] = []
    shards: list[DTensor] = []

    def recording(shard: DTensor, whole: DTensor) -> None:
        gathered.append(weakref.ref(whole._local_tensor))
        shards.append(shard)
        noted(shard, whole)

    def step(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, int], int, int]:
        gathered.clear()
        shards.clear()
        x = h.clone().requires_grad_()
        packed = []  # saved-tensor hooks around the block (as the user's save_on_cpu) see what it saves

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(t.shape)
            return t

        with CommDebugMode() as calls:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block_of(m)(x, **kwargs)
            alive = sum(ref() is not None for ref in gathered)
            out.backward(grad_out)
        counts = {str(op).split(".")[-1]: n for op, n in calls.get_comm_counts().items() if n}
        grads = {
            n: (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).clone()
            for n, q in block_of(m).named_parameters()
        }
        assert x.grad is not None and all(g is not None for g in grads.values())
        return out, x.grad, grads, counts, alive, len(packed)

    hidden_states.note_gathered = recording
    try:
        out, x_grad, grads, counts, alive, outer = step(model)
        assert len(gathered) == 2, f"{len(gathered)} gathered region inputs, want attention's and the MLP's"
        want_out, want_x_grad, want_grads, want_counts, want_alive, want_outer = step(plain)
        shards.clear()
        out_again = block_of(model)(h.clone().requires_grad_(), **kwargs)
        with torch.no_grad():  # an in-place change of a kept shard after the forward
            shards[0]._local_tensor.add_(0)
        try:
            out_again.backward(grad_out)
            raise AssertionError("a kept shard changed in place was re-gathered without an error")
        except RuntimeError as e:
            assert "modified in place" in str(e), e
    finally:
        hidden_states.note_gathered = noted
    assert torch.equal(out, want_out) and torch.equal(x_grad, want_x_grad)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), f"{name}: gradient differs with re-gathering"
    assert alive == 0 and want_alive == 2, f"gathered tensors alive after forward: {alive} (kept whole: {want_alive})"
    # the hooks around the block get every saved tensor but the gathered inputs' (one per column-parallel linear)
    assert 0 < outer < want_outer, f"outer hooks packed {outer} of the {want_outer} tensors the block saves"
    more = {op: n - want_counts.get(op, 0) for op, n in counts.items() if n != want_counts.get(op, 0)}
    assert more == {"all_gather_into_tensor": 2}, f"re-gathering changed the collectives by {more}"


def zoo_gpt_block(sp: bool) -> None:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    rope = rope_cos_sin(torch.arange(SEQ), GPT_CONFIG.attention_head_dim, GPT_CONFIG.rope_theta)
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
def zoo_gpt_block_regathered() -> None:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    rope = rope_cos_sin(torch.arange(SEQ), GPT_CONFIG.attention_head_dim, GPT_CONFIG.rope_theta)
    regathers_bit_identically(model, model.parallel_plan(), lambda m: m.layers[0], GPT_CONFIG.dim, rope=rope)


@check
def hf_llama_layer_regathered() -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama"))
    dim = model.config.hidden_size
    rope = model.model.rotary_emb(torch.zeros(1, SEQ, dim), torch.arange(SEQ)[None])
    regathers_bit_identically(model, plan_for(model), lambda m: m.model.layers[1], dim, position_embeddings=rope)


@check
def hf_llama_checkpointed_by_transformers_regathered() -> None:
    """transformers' own gradient checkpointing (non-reentrant, around each decoder layer, outside lit-mesh's AC)
    with the layers re-gathering inside it: the same loss and gradients, bit for bit."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    plain = copy.deepcopy(model)
    mesh = build_device_mesh(MeshLayout(tp=dist.get_world_size()), "cpu")["tp"]
    for m in (model, plain):
        apply_tensor_parallel(m, plan_for(m), mesh, True)
    for layer in model.model.layers:
        regather_in_backward(layer)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    grads = []
    for m in (model, plain):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad for n, q in m.named_parameters()})
    for name, grad in grads[0].items():
        assert grad is not None and torch.equal(grad, grads[1][name]), f"{name}: differs under checkpointing"


def _embedding_gradients(model: nn.Module, plan: ParallelPlan, local_lookup: bool, ids: torch.Tensor) -> dict:
    """The loss, every parameter's gradient (local) and the collectives of one forward and backward under tp + SP,
    the embeddings looked up by lit-mesh's own lookup or by torch's (DTensor's embedding op)."""
    import lit_mesh.parallel.vocab_embedding as vocab_embedding

    mesh = build_device_mesh(MeshLayout(tp=dist.get_world_size()), "cpu")["tp"]
    chosen = vocab_embedding.looks_up_locally
    vocab_embedding.looks_up_locally = chosen if local_lookup else (lambda module: False)  # type: ignore[assignment]
    try:
        apply_tensor_parallel(model, plan, mesh, True)
    finally:
        vocab_embedding.looks_up_locally = chosen
    with CommDebugMode() as comm:
        logits = model(ids)
        logits = getattr(logits, "logits", logits)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
    grads = {n: q.grad for n, q in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "calls": comm.get_comm_counts()}


def embedding_gradient_is_this_ranks_rows(
    make: Callable[[], nn.Module], plan_of: Callable, vocab: int, embedding: str, whole_under_torch: bool = True
) -> None:
    """`embedding`: the embedding weight's name; `whole_under_torch`: torch's lookup leaves its gradient Replicate (a
    weight tied to the head sums the head's Shard(0) gradient into it)."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    ids[0, :2] = 3  # a repeated token (transformers' Llama below: its padding row)
    ours, torchs = (_embedding_gradients(m, plan_of(m), local, ids) for m, local in ((make(), True), (make(), False)))
    assert torch.equal(ours["loss"], torchs["loss"]), "the lookup changed the loss"
    assert ours["calls"] == torchs["calls"], f"collectives {ours['calls']} (torch's lookup: {torchs['calls']})"
    grad, reference = ours["grads"][embedding], torchs["grads"][embedding]
    rows = vocab // tp
    assert grad.placements == (Shard(0),) and grad.to_local().shape[0] == rows, (grad.placements, grad.to_local().shape)
    assert (reference.placements == (Replicate(),)) == whole_under_torch, reference.placements
    assert torch.equal(grad.to_local(), reference.full_tensor()[rank * rows : (rank + 1) * rows]), "other rows"
    for name, grad in ours["grads"].items():
        if name != embedding:
            other = torchs["grads"][name]
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            assert torch.equal(local, other.to_local() if isinstance(other, DTensor) else other), f"{name} differs"


@check
def zoo_gpt_embedding_gradient_is_this_ranks_rows() -> None:
    """The zoo GPT (its embedding tied to the head too) under tp + SP: lit-mesh's embedding lookup gives the
    embedding's gradient as this rank's vocabulary rows (Shard(0), the parameter's placement; torch's: the whole
    vocabulary on every rank), bit for bit torch's rows, every other gradient and the loss bit for bit, the same
    collectives."""
    for tied in (False, True):
        config = GPTConfig(**{**GPT_CONFIG.__dict__, "tie_embeddings": tied})

        def make(config: GPTConfig = config) -> nn.Module:
            torch.manual_seed(0)
            return GPT(config)

        plan = lambda m: m.parallel_plan()  # noqa: E731
        embedding_gradient_is_this_ranks_rows(make, plan, config.vocab_size, "tok_embeddings.weight", not tied)


@check
def hf_llama_embedding_gradient_is_this_ranks_rows() -> None:
    """transformers' Llama, whose padding row (pad_token_id) gets no gradient."""
    from transformers import LlamaForCausalLM

    config = tiny_config("llama")
    config.pad_token_id = 3

    def make() -> nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    assert make().model.embed_tokens.padding_idx == 3
    embedding_gradient_is_this_ranks_rows(make, plan_for, config.vocab_size, "model.embed_tokens.weight")


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
