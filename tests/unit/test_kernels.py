"""Kernels without copies (issue 21): grouped-query attention without repeating K/V, RoPE without an fp32 copy of
q/k, SwiGLU's w1 and w3 fused into one matmul (and still converted to transformers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lit_mesh import kernels
from lit_mesh.kernels import grouped_query_attention
from lit_mesh.parallel.tensor import PlanError, apply_tensor_parallel
from zoo.gpt import GPT, GPTConfig, apply_rope, rope_cos_sin


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _qkv(dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, dtype=dtype, requires_grad=True)
    return q, k, v


def test_grouped_query_attention_does_not_repeat_kv_and_equals_repeated_heads():
    q, k, v = _qkv()
    with _Calls() as calls:
        out = grouped_query_attention(q, k, v)
    assert "repeat_interleave" not in calls.names
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert torch.equal(out, expected)  # forward: the same kernel on the same numbers
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want):  # dK/dV: the group sum in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_falls_back_to_repeated_kv_where_the_kernel_cannot(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(kernels, "fused_kernel_takes_gqa", lambda *_: False)
    with _Calls() as calls:
        out = grouped_query_attention(q, k, v)
    assert calls.names.count("repeat_interleave") == 2
    monkeypatch.undo()
    torch.testing.assert_close(out, grouped_query_attention(q, k, v))


def _rope_before_issue_21(x, positions, head_dim, theta):
    """The RoPE of the base commit: an fp32 copy of x, chunk, cat."""
    cos, sin = (t[:, 0, :][:, None, :] for t in rope_cos_sin(positions, head_dim, theta))
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_without_fp32_copies_gives_the_same_bits(dtype):
    x = torch.randn(2, 12, 4, 16).to(dtype)
    positions = torch.arange(12)
    rope = rope_cos_sin(positions, 16, 10000.0)
    assert rope[0].shape == (12, 1, 8)  # once per forward, shaped to broadcast over heads in every layer
    with _Calls() as calls:
        out = apply_rope(x, rope)
    assert "float" not in calls.names and "chunk" not in calls.names
    assert torch.equal(out, _rope_before_issue_21(x, positions, 16, 10000.0))


def _fused_copy(gpt: GPT) -> GPT:
    fused = GPT(GPTConfig.from_preset("tiny", fused_w13=True))
    state = dict(gpt.state_dict())
    for i in range(gpt.config.n_layers):
        prefix = f"layers.{i}.feed_forward."
        state[prefix + "w13.weight"] = torch.cat([state.pop(prefix + "w1.weight"), state.pop(prefix + "w3.weight")])
    fused.load_state_dict(state)
    return fused.eval()


def test_fused_swiglu_gives_the_same_logits_and_converts_to_transformers():
    from zoo.convert import zoo_to_hf

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_preset("tiny")).eval()
    fused = _fused_copy(gpt)
    assert fused.layers[0].feed_forward.w13.weight.shape == (2 * gpt.config.ffn_hidden, gpt.config.dim)
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), gpt(tokens), rtol=1e-5, atol=1e-5)
        llama = zoo_to_hf(fused)
        torch.testing.assert_close(llama(input_ids=tokens).logits, gpt(tokens), rtol=1e-5, atol=1e-5)
        assert torch.equal(llama.model.layers[1].mlp.up_proj.weight, gpt.layers[1].feed_forward.w3.weight)


def test_fused_swiglu_refuses_tensor_parallel_with_the_fix():
    class TwoRanks:  # the refusal comes before the mesh is used
        def size(self) -> int:
            return 2

    model = GPT(GPTConfig.from_preset("tiny", fused_w13=True))
    with pytest.raises(PlanError, match="tp=2: fused_w13=True .* use fused_w13=False with tp > 1"):
        apply_tensor_parallel(model, model.parallel_plan(), TwoRanks(), False)


def test_adamw_is_fused_off_the_cpu_and_foreach_on_it():
    from lit_mesh.kernels import adamw_implementation

    assert adamw_implementation([torch.zeros(1)]) == {"foreach": True}
    assert adamw_implementation([torch.zeros(1, device="meta")]) == {"foreach": True}  # no fused kernel there
    if torch.cuda.is_available():
        params = [torch.zeros(4, device="cuda", requires_grad=True)]
        assert adamw_implementation(params) == {"fused": True}
        params[0].grad = torch.ones(4, device="cuda")
        torch.optim.AdamW(params, **adamw_implementation(params)).step()  # the fused kernel runs here


def test_clipping_scales_gradients_with_one_foreach_call_per_group(monkeypatch):
    from lit_mesh.training.grad_norm import clip_grad_norm_

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(4).double())]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    expected = [p.grad.clone() for p in params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).float() for g in expected]))
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    expected = [g * scale.to(g.dtype) for g in expected]
    calls = []
    original = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda grads, s: (calls.append(len(grads)), original(grads, s)))
    clip_grad_norm_(params, 1.0)
    assert sorted(calls) == [1, 3]  # fp32 and fp64: two groups, no per-tensor loop
    for p, g in zip(params, expected):
        assert torch.equal(p.grad, g)


# ---- context-parallel block kernels (lit_mesh/parallel/context/kernels.py) ------------------------------------


def test_context_parallel_kernel_is_chosen_by_device_and_dtype():
    from lit_mesh.parallel.context.kernels import BLOCK_KERNELS, block_kernel_for, check_block_kernel

    assert block_kernel_for("cuda", torch.bfloat16) == "flash"
    assert block_kernel_for(torch.device("cuda", 1), torch.float16) == "flash"
    assert block_kernel_for("cuda", torch.float32) == "efficient"  # flash has no fp32 kernel
    assert block_kernel_for("cpu", torch.float32) == block_kernel_for("cpu", torch.bfloat16) == "cpu_flash"
    assert block_kernel_for("mps", torch.float32) == "math"  # anything else: the plain math
    assert {"math", "cpu_flash", "flash", "efficient", "cudnn"} <= set(BLOCK_KERNELS)
    with pytest.raises(ValueError, match="ring_kernel='flash2'; choose one of"):
        check_block_kernel("flash2")


def _by_blocks_vs_sdpa(device, dtype, T, n_blocks, heads=8, kv_heads=2, head_dim=64, kernel=None):
    from lit_mesh.parallel.context.kernels import causal_by_blocks

    torch.manual_seed(0)
    shape = (1, heads, T, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn((1, kv_heads, T, head_dim), device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(shape, device=device, dtype=dtype)
    results = []
    for attend in (lambda: grouped_query_attention(q, k, v), lambda: causal_by_blocks(q, k, v, n_blocks, kernel)):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        out = attend()
        out.backward(grad)
        peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else 0
        results.append(([out.detach(), *(t.grad for t in (q, k, v))], peak))
        for t in (q, k, v):
            t.grad = None
    return results


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_blocks_merged_by_log_sum_exp_equal_sdpa_on_cpu(kernel):
    (want, _), (got, _) = _by_blocks_vs_sdpa("cpu", torch.float32, T=64, n_blocks=4, kernel=kernel)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the flash/efficient/cuDNN block kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_blocks_merged_by_log_sum_exp_equal_sdpa_at_32k(dtype):
    """The ring's kernel path (8 blocks merged by LSE, in one process) against SDPA at T = 32k: equal within the
    dtype's tolerance, peak memory <= 1.2x SDPA's (benchmarks/cp_kernels.py records the figures)."""
    T = 32768 if dtype == torch.bfloat16 else 8192
    (want, sdpa_peak), (got, blocks_peak) = _by_blocks_vs_sdpa("cuda", dtype, T=T, n_blocks=8, head_dim=128)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)
    assert blocks_peak <= 1.2 * sdpa_peak, f"peak {blocks_peak} B vs SDPA's {sdpa_peak} B"


# ---- loss parallel and the chunked loss (lit_mesh/loss.py) ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_torch(dtype):
    from lit_mesh.loss import cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(3, 50, 97).to(dtype).requires_grad_()
    targets = torch.randint(0, 97, (3, 50))
    targets[0, 3] = -100  # ignored, as in F.cross_entropy
    loss = cross_entropy(logits, targets, chunk_rows=16)  # 150 rows: 10 chunks
    (grad,) = torch.autograd.grad(loss * 2.5, logits)
    want = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    (want_grad,) = torch.autograd.grad(want * 2.5, logits)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


def _experts_and_loop():
    from zoo.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)

    def loop(x, counts):  # the loop over experts this replaced
        w1, w2, w3 = experts.w1, experts.w2, experts.w3
        return torch.cat([(F.silu(a @ b1) * (a @ b3)) @ b2 for a, b1, b2, b3 in zip(x.split(counts), w1, w2, w3)])

    return experts, loop


class Ops(TorchDispatchMode):
    """The names of the aten ops dispatched (top level: not those inside an op's CPU kernel)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_experts_run_as_grouped_gemms_equal_to_the_loop_over_experts():
    experts, loop = _experts_and_loop()
    x = torch.randn(10, 16, requires_grad=True)
    counts = [3, 0, 5, 2]  # an expert without tokens too
    grad = torch.randn(16, 10).t()  # a non-contiguous upstream gradient
    with Ops() as ops:
        out = experts(x, torch.tensor(counts))
        out.backward(grad)
    assert ops.names.count("_grouped_mm.default") >= 3 and "mm.default" not in ops.names
    got = [x.grad, *(p.grad for p in experts.parameters())]
    for t in (x, *experts.parameters()):
        t.grad = None
    want_out = loop(x, counts)
    want_out.backward(grad)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)  # the same products, summed in another order
    for a, t in zip(got, (x, *experts.parameters())):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


def test_experts_with_bf16_tokens_and_fp32_weights_run_grouped_gemms_without_a_host_read():
    """Mixed precision without FSDP (expert parallel alone): the weights are cast to the tokens' dtype, as FSDP's
    param_dtype would, so the grouped GEMMs run (not the loop over experts, which reads the counts on the host)."""
    from lit_mesh.monitor.host_syncs import HostSyncCounter

    experts, loop = _experts_and_loop()
    x = torch.randn(10, 16).bfloat16().requires_grad_()
    counts = torch.tensor([3, 0, 5, 2])
    with HostSyncCounter() as syncs, Ops() as ops:
        out = experts(x, counts)
        out.float().sum().backward()
    assert syncs.total == 0, syncs.sites
    assert ops.names.count("_grouped_mm.default") >= 3 and "mm.default" not in ops.names
    assert out.dtype == torch.bfloat16 and all(p.grad.dtype == torch.float32 for p in experts.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loop(x, counts.tolist())
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a Hopper-or-newer CUDA GPU: torch's bf16 grouped GEMM kernel",
)
def test_cuda_experts_in_bf16_run_grouped_gemms_equal_to_the_loop_over_experts():
    """The grouped GEMM kernel on the GPU (benchmarks/gpu_checks.sh `kernels`): bf16 experts equal the per-expert
    loop in bf16 within its rounding, forward and gradients, counts read on the device only."""
    from lit_mesh.monitor.host_syncs import HostSyncCounter

    experts, loop = _experts_and_loop()
    experts = experts.cuda().bfloat16()
    x = torch.randn(10, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = [3, 0, 5, 2]
    grad = torch.randn(10, 16, device="cuda", dtype=torch.bfloat16)
    on_device = torch.tensor(counts).cuda()  # the router's counts live there: moved before the audit
    with HostSyncCounter() as syncs, Ops() as ops:
        out = experts(x, on_device)
        out.backward(grad)
    assert ops.names.count("_grouped_mm.default") >= 3 and "mm.default" not in ops.names
    assert syncs.total == 0, syncs.sites
    got = [x.grad, *(p.grad for p in experts.parameters())]
    for t in (x, *experts.parameters()):
        t.grad = None
    want = loop(x, counts)
    want.backward(grad)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    for a, t in zip(got, (x, *experts.parameters())):
        torch.testing.assert_close(a, t.grad, rtol=2e-2, atol=5e-2)


def test_experts_without_tokens_give_zero_gradients():
    experts, _ = _experts_and_loop()
    out = experts(torch.zeros(0, 16), torch.zeros(4, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, 16) and all(torch.count_nonzero(p.grad) == 0 for p in experts.parameters())


def test_selective_checkpointing_keeps_token_all_to_alls_and_grouped_gemms():
    from lit_mesh.parallel.activation_checkpointing import _saved_ops

    saved = _saved_ops()
    assert torch.ops._c10d_functional.all_to_all_single.default in saved
    assert torch.ops.aten._grouped_mm.default in saved
