"""Evaluation library: sliding windows as Hugging Face's perplexity guide cuts them, perplexity and
LAMBADA accuracy against direct computations with the training-path forward, TP = 2 vs 1."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.inference.model import build_inference_model
from megatron_ds.inference.scoring import lambada_accuracy, perplexity, sliding_windows
from tests.distributed import run_distributed
from tests.inference.common import CONFIGS, EOD, VOCAB, random_weights


def hf_guide_windows(seq_len, max_length, stride):
    """Transcribed from Hugging Face's perplexity guide: (begin, end, trg_len) per window."""
    out, prev_end_loc = [], 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        out.append((begin_loc, end_loc, trg_len))
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return out


@pytest.mark.parametrize("n,window,stride", [(100, 16, 8), (100, 16, 16), (17, 16, 5), (16, 16, 8), (5, 16, 4)])
def test_windows_score_what_the_hf_guide_scores(n, window, stride):
    ours = sliding_windows(n, window, stride)
    ref = hf_guide_windows(n, window, stride)
    # The guide masks all but the last trg_len labels, then the model shifts them by one: the
    # scored targets are absolute positions max(end - trg_len, begin + 1) .. end - 1.
    scored_ref = [list(range(max(e - t, b + 1), e)) for b, e, t in ref]
    scored_ours = [list(range(w.score_from, w.end)) for w in ours]
    assert scored_ours == [s for s in scored_ref if s]
    assert [(w.begin, w.end) for w in ours] == [(b, e) for (b, e, _), s in zip(ref, scored_ref) if s]
    flat = [i for s in scored_ours for i in s]
    if stride < window:  # overlapping windows score every token but the first exactly once
        assert flat == list(range(1, n))


def _direct_perplexity(weights, stream, window, stride):
    """Each window through the training-path forward with F.cross_entropy and -100 labels."""
    module = build_sequential_gpt(weights.model, padded_vocab_size=weights.padded_vocab_size, seed=0).eval()
    module.load_state_dict(weights.state_dict)
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, trg_len in hf_guide_windows(len(stream), window, stride):
            ids = torch.tensor(stream[begin:end])[None]
            labels = ids.clone()
            labels[:, :-trg_len] = -100
            logits = module((ids, torch.arange(ids.shape[1])[None]))[..., :weights.vocab_size]
            losses = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
            nll += float(losses)
            count += int((labels[0, 1:] != -100).sum())
    return math.exp(nll / count), count


def _stream(n=150, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_perplexity_equals_direct_computation(arch):
    weights = random_weights(CONFIGS[arch]())
    stream = _stream()
    model = build_inference_model(weights, family=GPT)
    got = perplexity(model, stream, window=24, stride=10, batch_size=3, show_progress=False)
    ppl, count = _direct_perplexity(weights, stream, 24, 10)
    assert got["scored_tokens"] == count == len(stream) - 1
    # fp32, the same logits up to summation order; NLL sums of ~150 terms agree to ~1e-6 relative.
    assert got["perplexity"] == pytest.approx(ppl, rel=1e-5)


def _lambada_direct(weights, samples):
    module = build_sequential_gpt(weights.model, padded_vocab_size=weights.padded_vocab_size, seed=0).eval()
    module.load_state_dict(weights.state_dict)
    correct = 0
    with torch.no_grad():
        for context, target in samples:  # one sample at a time, no padding
            ids = torch.tensor(context + target)[None]
            logits = module((ids[:, :-1], torch.arange(ids.shape[1] - 1)[None]))[0, :, :weights.vocab_size]
            pred = logits[len(context) - 1:].argmax(-1).tolist()
            correct += pred == target
    return correct


def test_lambada_accuracy_equals_direct_computation():
    weights = random_weights(CONFIGS["gpt2"]())
    model = build_inference_model(weights, family=GPT)
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(12):
        context = torch.randint(4, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        target = torch.randint(4, VOCAB, (1 + i % 2,), generator=g).tolist()
        samples.append((context, target))
    # Make some samples right by construction: the target is the model's own greedy continuation.
    for i in range(0, 12, 3):
        context = samples[i][0]
        ids = torch.tensor(context)[None]
        samples[i] = (context, [int(model.logits(ids, torch.arange(len(context))[None])[0, -1].argmax())])
    got = lambada_accuracy(model, samples, pad_id=EOD, batch_size=5, show_progress=False)
    expected = _lambada_direct(weights, samples)
    assert expected >= 4
    assert got["correct"] == expected and got["samples"] == 12


def _tp_perplexity(rank, world_size, weights, stream):
    import torch.distributed as dist

    model = build_inference_model(weights, tp_group=dist.new_group([0, 1]), family=GPT)
    return perplexity(model, stream, window=24, stride=10, batch_size=3, show_progress=False)["perplexity"]


def test_tensor_parallel_perplexity_equals_single_process():
    weights = random_weights(CONFIGS["llama"]())
    stream = _stream()
    single = perplexity(build_inference_model(weights, family=GPT), stream, window=24, stride=10, show_progress=False)
    for ppl in run_distributed(_tp_perplexity, 2, weights, stream, timeout=240):
        # The vocab-parallel loss sums partial softmax terms over 2 ranks: ~1e-6 relative in fp32.
        assert ppl == pytest.approx(single["perplexity"], rel=1e-5)
