"""Single-process tests of the zoo models, their plans and LightningModules."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_mesh.init import init_parameters, rule_for
from zoo.flops import gpt_flops_per_token
from zoo.gpt import GPT, PRESETS, FeedForward, GPTConfig, apply_rope, rope_cos_sin
from zoo.gpt import Attention as GPTAttention
from zoo.modules import GPTModule
from zoo.text_data import TextDataModule
from zoo.vit import MLP, ViT, ViTConfig
from zoo.vit import Attention as ViTAttention


def tiny_gpt(**overrides) -> GPT:
    return GPT(GPTConfig.from_preset("tiny", **overrides))


def tiny_vit(**overrides) -> ViT:
    return ViT(ViTConfig.from_preset("tiny", **overrides))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- configs ------------------------------------------------------------------------------------


def test_head_dim_is_dim_over_heads_unless_set():
    """head_dim None follows dim / n_heads (a changed dim too); set, it is the width; bad widths are named."""
    assert GPTConfig.from_preset("tiny").attention_head_dim == 16
    assert GPTConfig.from_preset("tiny", dim=128).attention_head_dim == 32  # the preset keeps head_dim None
    wide = GPTConfig.from_preset("tiny", head_dim=32)
    assert wide.attention_head_dim == 32 and wide.attention_matmul_params() == 2 * 64 * 128 + 2 * 64 * 64
    assert GPTConfig.from_preset("tiny", dim=66, head_dim=16).attention_head_dim == 16  # 66 / 4 heads: fine when set
    with pytest.raises(ValueError, match="dim=66 is not divisible by n_heads=4; set head_dim"):
        GPTConfig.from_preset("tiny", dim=66)
    with pytest.raises(ValueError, match="head_dim=15 must be even for RoPE"):
        GPTConfig.from_preset("tiny", head_dim=15)
    with pytest.raises(ValueError, match=r"head_dim=0 must be a whole number >= 2"):
        GPTConfig.from_preset("tiny", head_dim=0)


def test_presets_and_unknown_preset_error():
    assert PRESETS["llama3-8b"].n_kv_heads == 8 and PRESETS["llama3-405b"].n_layers == 126
    assert GPTConfig.from_preset("tiny", n_layers=3).n_layers == 3
    with pytest.raises(ValueError, match=r"unknown GPT preset 'gpt5'.*'tiny'"):
        GPTConfig.from_preset("gpt5")
    with pytest.raises(ValueError, match=r"unknown ViT preset 'vit-h'.*'vit-b16'"):
        ViTConfig.from_preset("vit-h")
    assert ViTConfig.from_preset("tiny").seq_len == 20
    assert ViTConfig.from_preset("vit-b16").seq_len == 197


def test_llama3_8b_parameter_count_on_meta():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("llama3-8b"))
    assert model.num_params() == 8_030_261_248  # the published Llama-3-8B size
    assert model.flops_per_token(8192) > 6 * model.num_params(exclude_embedding=True)


def test_llama3_2_1b_ties_and_counts_the_shared_matrix_once():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("llama3.2-1b"))
        untied = GPT(GPTConfig.from_preset("llama3.2-1b", tie_embeddings=False))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == 1_235_814_400  # the published Llama-3.2-1B size (tied embeddings)
    assert untied.num_params() - model.num_params() == 128256 * 2048
    # the head's matmul is still spent: tying changes no FLOPs
    assert model.flops_per_token(2048) == untied.flops_per_token(2048)
    assert gpt_flops_per_token(model.config, 2048) == gpt_flops_per_token(untied.config, 2048)


# ---- GPT --------------------------------------------------------------------------------------


def test_tied_gpt_has_one_matrix_whose_gradient_sums_both_uses():
    torch.manual_seed(0)
    tied = tiny_gpt(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert len(list(tied.parameters())) == len(list(tiny_gpt().parameters())) - 1
    untied = tiny_gpt()
    untied.load_state_dict(tied.state_dict())  # the state dict names both uses (as transformers' does)
    tokens = torch.randint(0, 256, (2, 16))
    for model in (tied, untied):
        model(tokens).logsumexp(-1).mean().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, both)
    assert tied.tok_embeddings.weight.grad.abs().sum() > 0


def test_tied_gpt_stays_tied_through_mesh_strategy_on_one_device(tmp_path):
    """Built on the meta device, materialised by MeshStrategy, trained: one Parameter throughout, with the weights
    of a direct build."""
    from lit_mesh import MeshStrategy

    class CheckTied(L.Callback):
        def on_train_start(self, trainer, pl_module):
            model = pl_module.model
            assert model.output.weight is model.tok_embeddings.weight and not model.output.weight.is_meta
            self.start = model.output.weight.detach().clone()

    (tmp_path / "a.txt").write_text("hello world, " * 400)
    data = TextDataModule(global_batch_size=4, seq_len=16, source=str(tmp_path), val_fraction=0.1)
    module = GPTModule(lr=1e-2, config_overrides={"tie_embeddings": True})
    check = CheckTied()
    L.seed_everything(5)
    trainer = _trainer(strategy=MeshStrategy(), max_steps=3, limit_val_batches=0, callbacks=[check])
    trainer.fit(module, data)
    torch.manual_seed(5)
    assert torch.equal(check.start, tiny_gpt(tie_embeddings=True).tok_embeddings.weight)
    model = module.model
    assert model.output.weight is model.tok_embeddings.weight
    assert not torch.equal(model.output.weight, check.start)  # trained
    optimizer = trainer.optimizers[0]
    assert sum(1 for group in optimizer.param_groups for p in group["params"] if p is model.output.weight) == 1


def test_gpt_forward_shape():
    logits = tiny_gpt()(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32


def test_gpt_is_causal():
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (tokens[0, 8] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_gpt_rejects_sequences_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        tiny_gpt(max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def test_grouped_query_attention_equals_expanded_kv_heads():
    config = GPTConfig.from_preset("tiny")  # 4 query heads share 2 kv heads
    attn = GPTAttention(config)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.2)
    B, T, H, D = 2, 6, config.n_heads, config.attention_head_dim
    x = torch.randn(B, T, config.dim)
    rope = rope_cos_sin(torch.arange(T), D, config.rope_theta)

    # by hand: rotate q and k, give query head h the kv head h // (H / KV), softmax with a causal mask
    def heads(t, n):
        return t.view(B, T, n, D)

    q = apply_rope(heads(attn.wq(x), H), rope).transpose(1, 2)
    k = apply_rope(heads(attn.wk(x), config.n_kv_heads), rope).transpose(1, 2)
    v = heads(attn.wv(x), config.n_kv_heads).transpose(1, 2)
    kv_of = torch.arange(H) // (H // config.n_kv_heads)
    k, v = k[:, kv_of], v[:, kv_of]
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(attn(x, rope=rope), expected)


def _split_rows(linear: nn.Linear, parts: int) -> list[nn.Linear]:
    """Column-wise parallel shards: each keeps a slice of the output features."""
    out = []
    for w in linear.weight.chunk(parts, dim=0):
        shard = nn.Linear(linear.in_features, w.shape[0], bias=linear.bias is not None)
        shard.weight.data.copy_(w)
        out.append(shard)
    if linear.bias is not None:
        for shard, b in zip(out, linear.bias.chunk(parts)):
            shard.bias.data.copy_(b)
    return out


def _split_cols(linear: nn.Linear, parts: int) -> list[nn.Linear]:
    """Row-wise parallel shards: each keeps a slice of the input features; the bias is added once."""
    out = []
    for i, w in enumerate(linear.weight.chunk(parts, dim=1)):
        shard = nn.Linear(w.shape[1], linear.out_features, bias=linear.bias is not None)
        shard.weight.data.copy_(w)
        if linear.bias is not None:
            shard.bias.data.copy_(linear.bias if i == 0 else torch.zeros_like(linear.bias))
        out.append(shard)
    return out


def _shard(module: nn.Module, colwise: list[str], rowwise: list[str], tp: int) -> list[nn.Module]:
    """What tensor parallelism leaves on each of `tp` ranks: the same class with split Linears."""
    shards = [copy.deepcopy(module) for _ in range(tp)]
    for name in colwise + rowwise:
        pieces = (_split_rows if name in colwise else _split_cols)(getattr(module, name), tp)
        for shard, piece in zip(shards, pieces):
            setattr(shard, name, piece)
    return shards


@pytest.mark.parametrize("tp", [2])
def test_gpt_layers_run_unchanged_on_tensor_parallel_shards(tp):
    """The sum of the row-parallel partial outputs of the local-head shards equals the full layer."""
    config = GPTConfig.from_preset("tiny")
    x = torch.randn(2, 5, config.dim)
    rope = rope_cos_sin(torch.arange(5), config.attention_head_dim, config.rope_theta)
    attn = tiny_gpt().layers[0].attention
    shards = _shard(attn, ["wq", "wk", "wv"], ["wo"], tp)
    torch.testing.assert_close(sum(s(x, rope=rope) for s in shards), attn(x, rope=rope))
    ffn = FeedForward(config)
    nn.init.normal_(ffn.w2.weight, std=0.1)
    shards = _shard(ffn, ["w1", "w3"], ["w2"], tp)
    torch.testing.assert_close(sum(s(x) for s in shards), ffn(x))


def test_vit_layers_run_unchanged_on_tensor_parallel_shards():
    config = ViTConfig.from_preset("tiny")
    x = torch.randn(2, config.seq_len, config.dim)
    attn, mlp = ViTAttention(config), MLP(config)  # default (non-zero) biases: the bias paths are checked too
    shards = _shard(attn, ["q", "k", "v"], ["proj"], 2)
    torch.testing.assert_close(sum(s(x) for s in shards), attn(x))
    shards = _shard(mlp, ["fc1"], ["fc2"], 2)
    torch.testing.assert_close(sum(s(x) for s in shards), mlp(x))


# ---- ViT --------------------------------------------------------------------------------------


def test_vit_forward_shape_and_token_count():
    model = tiny_vit()
    images = torch.randn(3, 1, 8, 8)
    assert model(images).shape == (3, 10)
    tokens = model.embed(images)
    assert tokens.shape == (3, model.config.seq_len, 64) and model.config.seq_len == 20


def test_vit_patch_projection_equals_conv2d():
    """The Linear on flattened patches is a stride-p Conv2d with the same (C, p, p) weights."""
    config = ViTConfig.from_preset("tiny", in_channels=3)
    embed = tiny_vit(in_channels=3).embed
    conv = nn.Conv2d(3, config.dim, config.patch_size, stride=config.patch_size)
    conv.weight.data.copy_(embed.proj.weight.view(config.dim, 3, config.patch_size, config.patch_size))
    conv.bias.data.copy_(embed.proj.bias)
    images = torch.randn(2, 3, 8, 8)
    expected = conv(images).flatten(2).transpose(1, 2)
    n_prefix = 1 + config.n_registers
    torch.testing.assert_close(embed(images)[:, n_prefix:] - embed.pos_embed[:, n_prefix:], expected)


def test_vit_without_registers():
    model = tiny_vit(n_registers=0)
    assert model.embed(torch.randn(1, 1, 8, 8)).shape[1] == 17


# ---- init and plans -----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [tiny_gpt, tiny_vit])
def test_same_seed_same_weights(build):
    torch.manual_seed(1)
    a = build()
    torch.manual_seed(1)
    b = build()
    torch.manual_seed(2)
    c = build()
    assert same_weights(a, b)
    assert not same_weights(a, c)


@pytest.mark.parametrize("build", [tiny_gpt, tiny_vit])
def test_meta_then_init_equals_direct_build(build):
    torch.manual_seed(3)
    direct = build()
    with torch.device("meta"):
        model = build()
    assert all(p.is_meta for p in model.parameters())  # nothing was initialised on meta
    model.to_empty(device="cpu")
    init_parameters(model, model.parallel_plan().init)  # seed: torch.initial_seed(), still 3
    assert same_weights(model, direct)


@pytest.mark.parametrize("build", [tiny_gpt, tiny_vit])
def test_every_plan_name_exists(build):
    model = build()
    plan = model.parallel_plan()
    blocks = model.get_submodule(plan.blocks)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) > 0
    for name in plan.tp.root:
        model.get_submodule(name)
    for block in blocks:
        for name, style in plan.tp.block.items():
            sub = block.get_submodule(name)
            if style in ("colwise", "rowwise"):
                assert isinstance(sub, nn.Linear), name
    for name, _ in model.named_parameters():
        rule_for(name, plan.init)  # every parameter has a rule


def test_tp_divides():
    assert tiny_gpt().parallel_plan().tp.divides == {
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_hidden": 128,
        "vocab_size": 256,
    }
    assert tiny_vit().parallel_plan().tp.divides == {
        "n_heads": 4,
        "mlp_hidden": 128,
        "tokens (patches + class + registers)": 20,
    }


def test_gpt_init_rules():
    model = tiny_gpt(n_layers=8)
    rules = model.parallel_plan().init
    assert rule_for("layers.0.attention_norm.weight", rules).kind == "ones"
    assert rule_for("norm.weight", rules).kind == "ones"
    assert rule_for("layers.3.attention.wo.weight", rules).std == pytest.approx(0.02 / 4)
    assert rule_for("layers.3.feed_forward.w2.weight", rules).std == pytest.approx(0.02 / 4)
    assert rule_for("layers.3.feed_forward.w1.weight", rules).std == 0.02
    assert rule_for("output.weight", rules).std == 0.02
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_vit_init_rules():
    model = tiny_vit()
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if n.endswith(".bias"))
    assert torch.equal(model.blocks[0].norm1.weight, torch.ones(64))
    assert model.embed.pos_embed.abs().max() <= 0.04  # truncated at 2 std
    assert model.embed.cls_token.abs().max() > 0


def test_pipeline_stage_without_embedding_and_head():
    """A stage that does not own the embedding/head passes hidden states through its blocks."""
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (1, 7))
    h = model.tok_embeddings(tokens)
    model.tok_embeddings, model.norm, model.output = None, None, None
    assert model(h).shape == (1, 7, 64)


# ---- LightningModules -------------------------------------------------------------------------


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_lr_schedule_warms_up_then_decays_by_a_cosine(tmp_path):
    from zoo.modules import lr_factor

    f = lr_factor(warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up
    assert f(4) == 1.0 and math.isclose(f(9), 0.55) and math.isclose(f(14), 0.1) and f(100) == f(14)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    assert lr_factor(3, 0, 0.1)(50) == 1.0  # no decay: constant after the warm-up
    with pytest.raises(ValueError, match="decay_steps=3 must be 0 .* more than warmup_steps=5"):
        GPTModule(warmup_steps=5, decay_steps=3)
    with pytest.raises(ValueError, match="min_lr_ratio=1.5 must be in"):
        GPTModule(decay_steps=10, min_lr_ratio=1.5)
    # the Trainer steps the schedule every optimizer step
    module = GPTModule(lr=1e-2, decay_steps=6, min_lr_ratio=0.0, config_overrides={"n_layers": 1})
    (tmp_path / "a.txt").write_text("hello world, " * 100)
    data = TextDataModule(global_batch_size=2, seq_len=8, source=str(tmp_path), val_fraction=0.1)
    trainer = _trainer(max_steps=6, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert math.isclose(trainer.optimizers[0].param_groups[0]["lr"], 0.0, abs_tol=1e-12)


def test_modules_build_the_network_once_in_configure_model():
    module = GPTModule()
    assert module.model is None
    module.configure_model()
    first = module.model
    module.configure_model()
    assert module.model is first and isinstance(first, GPT)
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTModule(preset="nope")


def test_loss_is_fp32_mean_over_tokens():
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    targets = torch.randint(0, 5, (2, 3))
    loss = GPTModule.loss_fn(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float().reshape(6, 5), targets.reshape(6)))
