"""Group-limited routing (--moe-router-num-groups / --moe-router-group-topk, Megatron-LM's
moe_utils.group_limited_topk) against a per-token transcription of its rule: score each group by the sum of its
top (topk / group_topk) scores, keep the group_topk best groups, take the top k experts of those."""
import pytest
import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.moe_selection import check
from megatron_ds.config.schema import ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.model.mlm_moe import topk_routing


def _reference(scores, topk, groups, group_topk):
    tokens, experts = scores.shape
    size = experts // groups
    chosen = []
    for row in scores.tolist():
        group_score = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:topk // group_topk])
                       for g in range(groups)]
        keep = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
        allowed = [e for g in keep for e in range(g * size, (g + 1) * size)]
        chosen.append(set(sorted(allowed, key=lambda e: -row[e])[:topk]))
    return chosen


@pytest.mark.parametrize("score_function,bias", [("sigmoid", True), ("sigmoid", False), ("softmax", False)])
def test_group_limited_routing_equals_the_rule(score_function, bias):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=g)
    expert_bias = 0.3 * torch.randn(16, generator=g) if bias else None
    probs, routing_map = topk_routing(logits, 4, score_function=score_function, expert_bias=expert_bias,
                                      groups=(4, 2))
    scores = torch.sigmoid(logits) if score_function == "sigmoid" else logits
    choice = scores + expert_bias if bias else scores
    want = _reference(choice, 4, 4, 2)
    assert [set(r.nonzero().flatten().tolist()) for r in routing_map] == want
    # the weights: the chosen scores without the bias, renormalized (sigmoid) / softmaxed over the chosen (softmax)
    chosen = scores.masked_fill(~routing_map, float("-inf") if score_function == "softmax" else 0.0)
    expected = torch.softmax(chosen, -1) if score_function == "softmax" else chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected)
    # plain top-k differs on some tokens: the groups do restrict the choice
    _, plain = topk_routing(logits, 4, score_function=score_function, expert_bias=expert_bias)
    assert not torch.equal(plain, routing_map)


def test_group_flags_are_checked_as_megatron_lm_does():
    m = resolve_model_config(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                         num_experts=(8,), moe_router_topk=4, moe_router_group_topk=2,
                                         moe_router_num_groups=3))
    with pytest.raises(ConfigError, match="--moe-router-group-topk 2 needs --moe-router-num-groups G dividing"):
        check(m, tp=1, pp=1, dp=1, sp=1, ep=1, expert_tp=None, sequence_parallel=False)
