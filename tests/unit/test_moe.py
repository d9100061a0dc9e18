"""The zoo MoE on one process: routing (ties, capacity), the grouped experts, the balancing losses and bias,
and the errors for bad routing options. Multi-rank parity is in tests/integration/test_moe_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zoo import MoEModule
from zoo.moe import MoE, MoEConfig, MoETransformer, Router, Routing, capacity_mask
from zoo.moe_module import imbalance


def _moe(**overrides: object) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**{"dim": 8, "n_heads": 2, "n_kv_heads": 2, "expert_hidden": 6, **overrides}))
    for p in moe.parameters():
        nn.init.normal_(p, std=0.5)
    return moe


def _reference(moe: MoE, tokens: torch.Tensor, routing: Routing, keep: torch.Tensor) -> torch.Tensor:
    """Token by token, assignment by assignment: what the grouped computation must equal."""
    out = torch.zeros_like(tokens)
    for n in range(tokens.shape[0]):
        for j in range(routing.expert_ids.shape[1]):
            if keep[n, j]:
                e = routing.expert_ids[n, j]
                x = tokens[n]
                expert = (F.silu(x @ moe.experts.w1[e]) * (x @ moe.experts.w3[e])) @ moe.experts.w2[e]
                out[n] += routing.weights[n, j] * expert
    return out


class FixedRouter(nn.Module):
    """Routes the tokens of every sequence of 4 as `expert_ids` (4, k) says, with fixed gate weights."""

    def __init__(self, expert_ids: torch.Tensor) -> None:
        super().__init__()
        self.expert_ids = expert_ids
        self.weights = torch.linspace(0.2, 0.8, expert_ids.numel()).view_as(expert_ids)

    def forward(self, tokens: torch.Tensor) -> Routing:
        sequences = len(tokens) // len(self.expert_ids)
        ids, weights = self.expert_ids.repeat(sequences, 1), self.weights.repeat(sequences, 1)
        return Routing(ids, weights, torch.full((len(tokens), 3), 1 / 3))


def test_capacity_drops_overflow_in_priority_order() -> None:
    # one sequence of 4 tokens, top-2 of 3 experts, capacity ceil(0.75 * 4 * 2 / 3) = 2 per expert
    ids = torch.tensor([[[0, 1], [0, 1], [0, 2], [1, 0]]])
    # queue of expert 0: t0, t1, t2 (first choices), t3 (second) -> t2 and t3's second choice dropped;
    # expert 1: t3 (first), t0, t1 (second) -> t1's second dropped; expert 2: t2 (second)
    expected = torch.tensor([[[True, True], [True, False], [False, True], [True, False]]])
    assert torch.equal(capacity_mask(ids, 3, 2), expected)

    moe = _moe(n_experts=3, top_k=2, capacity_factor=0.75)
    assert moe.capacity(4) == 2
    moe.router = FixedRouter(ids.view(4, 2))
    x = torch.randn(1, 4, 8)
    out = moe(x).view(4, 8)
    routing = moe.router(x.view(4, 8))
    torch.testing.assert_close(out, _reference(moe, x.view(4, 8), routing, expected.view(4, 2)))
    assert moe.dropped.item() == 3
    # a second sequence is counted on its own: the same tokens again drop the same assignments
    out2 = moe(torch.cat([x, x])).view(2, 4, 8)
    torch.testing.assert_close(out2[1], out)
    assert moe.dropped.item() == 6


def test_dropless_grouped_experts_equal_token_by_token() -> None:
    moe = _moe(n_experts=4, top_k=2)
    x = torch.randn(3, 5, 8)
    tokens = x.view(15, 8)
    routing = moe.router(tokens)
    torch.testing.assert_close(
        moe(x).view(15, 8), _reference(moe, tokens, routing, torch.ones(15, 2, dtype=torch.bool))
    )


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_ties_go_to_the_lower_expert_every_time(score_func: str) -> None:
    moe = _moe(n_experts=4, top_k=2, score_func=score_func)
    nn.init.zeros_(moe.router.gate.weight)  # every expert scores the same for every token
    tokens = torch.randn(6, 8)
    first = moe.router(tokens)
    assert torch.equal(first.expert_ids, torch.tensor([[0, 1]] * 6))
    assert torch.equal(moe.router(tokens).expert_ids, first.expert_ids)
    torch.testing.assert_close(first.weights, torch.full((6, 2), 0.5))  # normalised over the chosen two
    moe.router.expert_bias.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.1]))  # the bias breaks the tie...
    biased = moe.router(tokens)
    assert torch.equal(biased.expert_ids, torch.tensor([[3, 0]] * 6))
    torch.testing.assert_close(biased.weights, first.weights)  # ...but never changes the gate weights


def test_top_1_gate_is_the_probability_so_the_lm_loss_trains_the_router() -> None:
    moe = _moe(n_experts=4, top_k=1, aux_loss_coef=0.0)  # normalize_top_k stays True, as by default
    x = torch.randn(2, 8, 8)
    routing = moe.router(x.view(16, 8))
    torch.testing.assert_close(routing.weights, routing.probs.gather(1, routing.expert_ids))
    assert (routing.weights < 1).all()
    moe(x).square().sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_aux_loss_is_the_switch_formula() -> None:
    moe = _moe(n_experts=4, top_k=1, aux_loss_coef=0.1)
    x = torch.randn(2, 8, 8)
    moe(x)
    routing = moe.router(x.view(16, 8))
    f = torch.bincount(routing.expert_ids.flatten(), minlength=4).float() / 16
    P = routing.probs.mean(dim=0)
    torch.testing.assert_close(moe.aux_loss, 0.1 * 4 * (f * P).sum())
    assert torch.equal(moe.load, torch.bincount(routing.expert_ids.flatten(), minlength=4))
    nn.init.zeros_(moe.router.gate.weight)
    moe.router.expert_bias.bias.copy_(torch.tensor([0.3, 0.2, 0.1, 0.0]))
    moe(x)  # uniform probabilities: E * sum_i f_i / E = 1 whatever the load
    torch.testing.assert_close(moe.aux_loss, torch.tensor(0.1))


def test_bias_moves_against_the_load() -> None:
    moe = _moe(n_experts=4, bias_update_rate=0.01)
    moe.update_expert_bias(torch.tensor([10, 2, 4, 0]))  # mean 4
    torch.testing.assert_close(moe.router.expert_bias.bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    assert imbalance(torch.tensor([[10, 2, 4, 0]])).item() == 2.5


def test_training_step_adds_the_aux_loss_and_logs_it_apart() -> None:
    module = MoEModule(config_overrides={"n_shared_experts": 1, "moe_every": 2, "n_layers": 3})
    module.configure_model()
    logged: dict[str, torch.Tensor] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # type: ignore[method-assign]
    tokens = torch.randint(0, 256, (2, 16))
    loss = module.training_step((tokens[:, :-1], tokens[:, 1:]), 0)
    torch.testing.assert_close(loss, logged["train_loss"] + logged["train_aux_loss"])
    assert sum(logged[f"moe/tokens_expert_{e}"] for e in range(4)) == 1 * 2 * 2 * 15  # 1 MoE layer, top-2
    loss.backward()
    assert module.model.layers[1].moe.router.gate.weight.grad.abs().sum() > 0
    assert module.model.layers[0].moe is None and module.model.layers[0].feed_forward is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 5}, "top_k=5 must be between 1 and n_experts=4; choose top_k <= 4"),
        ({"top_k": 0}, "top_k=0 must be between 1 and n_experts=4"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0 (e.g. 1.25), or None for dropless"),
        ({"capacity_factor": -1.0}, "capacity_factor=-1.0 must be > 0"),
        ({"score_func": "relu"}, "score_func='relu': choose 'softmax' or 'sigmoid'"),
        ({"n_groups": 3}, "n_groups=3 must be >= 1 and divide n_experts=4"),
        ({"n_groups": 2, "topk_groups": 3}, "topk_groups=3 must be between 1 and n_groups=2"),
        ({"n_groups": 4, "topk_groups": 1}, "top_k=2 exceeds the 1 experts of topk_groups=1 groups of 1; raise"),
    ],
)
def test_bad_routing_options_fail_at_construction(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        MoEModule(config_overrides=overrides)
    assert message in str(error.value)


def test_presets_build_on_meta() -> None:
    with torch.device("meta"):
        mixtral = MoETransformer(MoEConfig.from_preset("mixtral-8x7b"))
    assert 46.0e9 < mixtral.num_params() < 47.5e9  # Mixtral-8x7B has 46.7 B parameters
    assert mixtral.layers[0].moe.experts.w1.shape == (8, 4096, 14336)
    with pytest.raises(ValueError, match="unknown MoE preset 'huge'"):
        MoEConfig.from_preset("huge")


def test_top_1_models_are_not_converted_to_or_from_mixtral() -> None:
    """Mixtral gates a single routed expert by 1, the zoo MoE by its probability: the logits would differ."""
    from transformers import MixtralConfig

    from zoo.convert.mixtral import to_mixtral_config, to_moe_config

    with pytest.raises(ValueError, match="top_k=1: a single routed expert is gated by 1 in Mixtral.*top_k >= 2"):
        to_mixtral_config(MoEConfig.from_preset("tiny", top_k=1))
    with pytest.raises(ValueError, match="num_experts_per_tok=1: .*num_experts_per_tok >= 2"):
        to_moe_config(MixtralConfig(num_experts_per_tok=1))


def test_group_limited_routing_picks_within_the_best_groups() -> None:
    """n_groups / topk_groups (DeepSeek-V3's node-limited routing): every token's top_k experts lie in its topk_groups
    groups of the highest two-best-score sums, and are the best experts there; one group routes as before."""
    torch.manual_seed(0)
    config = MoEConfig(64, dim=16, n_layers=1, n_heads=2, n_experts=16, top_k=4, n_groups=4, topk_groups=2)
    router = Router(config)
    tokens = torch.randn(200, 16)
    routing = router(tokens)
    scores = router.gate(tokens).float().softmax(dim=-1)
    group_sums = scores.view(200, 4, 4).topk(2, dim=-1).values.sum(-1)
    best_groups = group_sums.topk(2, dim=-1).indices.sort(dim=-1).values
    chosen_groups = routing.expert_ids // 4
    assert all(set(c.tolist()) <= set(b.tolist()) for c, b in zip(chosen_groups, best_groups))
    assert any(len(set(c.tolist())) == 2 for c in chosen_groups)  # both groups used by some tokens
    in_best_groups = best_groups.repeat_interleave(4, dim=1) * 4 + torch.arange(4).repeat(2)  # their 8 experts
    allowed = torch.zeros(200, 16, dtype=torch.bool).scatter_(1, in_best_groups, True)
    best_allowed = scores.masked_fill(~allowed, -1).topk(4, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(routing.expert_ids.sort(dim=-1).values, best_allowed)
    plain = Router(dataclasses.replace(config, n_groups=1, topk_groups=1))
    plain.load_state_dict(router.state_dict())
    free = plain(tokens)
    assert not torch.equal(free.expert_ids, routing.expert_ids)  # some token's best experts span 3 or 4 groups
