"""Generation engine: KV cache vs none, left-padded batches vs one prompt at a time, TP = 2 vs 1,
and the sampling filters against transformers' logits processors."""
from __future__ import annotations

import pytest
import torch

from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.inference.generate import (SamplingConfig, apply_repetition_penalty, attention_mask,
                                            filter_top_k_top_p, generate)
from megatron_ds.inference.model import build_inference_model
from tests.distributed import run_distributed
from tests.inference.common import CONFIGS, EOD, VOCAB, prompts, random_weights, reference_greedy

NEW = 12


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_kv_cache_equals_no_cache_and_reference(arch):
    weights = random_weights(CONFIGS[arch]())
    model = build_inference_model(weights, family=GPT)
    batch = prompts()
    greedy = dict(max_new_tokens=NEW, greedy=True, stop_at_eod=False)
    cached = generate(model, batch, SamplingConfig(**greedy), eod=EOD).tokens
    uncached = generate(model, batch, SamplingConfig(use_cache=False, **greedy), eod=EOD).tokens
    assert cached == uncached
    for prompt, got in zip(batch, cached):
        expected, margin = reference_greedy(weights, prompt, NEW)
        # fp32: cached/padded and reference logits differ by ~1e-6; every choice had a larger gap.
        assert margin > 1e-4
        assert got == expected
    assert all(t < VOCAB for row in cached for t in row)  # padded vocabulary ids are never produced


def test_sampling_same_with_and_without_cache_and_stops_at_eod():
    weights = random_weights(CONFIGS["gpt2"]())
    model = build_inference_model(weights, family=GPT)
    batch = prompts()
    cfg = dict(max_new_tokens=NEW, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=5,
               stop_at_eod=False)
    a = generate(model, batch, SamplingConfig(**cfg), eod=EOD).tokens
    b = generate(model, batch, SamplingConfig(use_cache=False, **cfg), eod=EOD).tokens
    assert a == b and all(len(row) == NEW for row in a)
    # Make the second prompt's first greedy token the end-of-document id: that row stops after it,
    # the others run to max_new_tokens.
    first = generate(model, batch, SamplingConfig(max_new_tokens=1, greedy=True), eod=EOD).tokens
    stopped = generate(model, batch, SamplingConfig(max_new_tokens=NEW, greedy=True), eod=first[1][0]).tokens
    eod = first[1][0]
    assert stopped[1] == [eod]
    for row in stopped:  # every row ends at its first end-of-document token, or runs to the limit
        assert (row[-1] == eod and eod not in row[:-1]) or (len(row) == NEW and eod not in row)


def test_mask_hides_padding_and_future():
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    m = attention_mask(valid, 0, 4)[:, 0]
    assert m[0].tolist() == [[True, False, False, False], [False, True, False, False],
                             [False, True, True, False], [False, True, True, True]]
    assert m[1].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()


def test_filters_match_transformers():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 7), generator=g)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    ours = apply_repetition_penalty(logits, seen, 1.5)
    ref = transformers.RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # same elementwise formula: exact
    for top_k, top_p in ((5, 1.0), (0, 0.7), (10, 0.5)):
        ours = filter_top_k_top_p(logits, top_k, top_p)
        ref = logits.clone()
        if top_k:
            ref = transformers.TopKLogitsWarper(top_k)(ids, ref)
        if top_p < 1:
            ref = transformers.TopPLogitsWarper(top_p)(ids, ref)
        assert torch.equal(ours.isinf(), ref.isinf()), (top_k, top_p)


def _tp_generate(rank, world_size, weights, batch):
    import torch.distributed as dist

    model = build_inference_model(weights, tp_group=dist.new_group([0, 1]), family=GPT)
    greedy = generate(model, batch, SamplingConfig(max_new_tokens=NEW, greedy=True, stop_at_eod=False), eod=EOD)
    sampled = generate(model, batch, SamplingConfig(max_new_tokens=NEW, top_k=10, seed=3, stop_at_eod=False),
                       eod=EOD)
    return greedy.tokens, sampled.tokens


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tensor_parallel_generation_equals_single_process(arch):
    weights = random_weights(CONFIGS[arch]())
    batch = prompts()
    model = build_inference_model(weights, family=GPT)
    greedy = generate(model, batch, SamplingConfig(max_new_tokens=NEW, greedy=True, stop_at_eod=False), eod=EOD)
    sampled = generate(model, batch, SamplingConfig(max_new_tokens=NEW, top_k=10, seed=3, stop_at_eod=False),
                       eod=EOD)
    results = run_distributed(_tp_generate, 2, weights, batch, timeout=240)
    for tp_greedy, tp_sampled in results:
        assert tp_greedy == greedy.tokens
        assert tp_sampled == sampled.tokens
