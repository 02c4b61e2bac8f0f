"""Megatron's zero-shot tasks: the WikiText detokenizer against hand-applied rules, the windows and
the WIKITEXT103 / LAMBADA numbers against a transcription of Megatron's ``tasks/zeroshot_gpt``
(``_LMDataset``, ``_LambadaDataset``, ``forward_step``, ``evaluate_and_print_results``) run on the
dense training-path model, and tensor parallel 2 against one process."""
from __future__ import annotations

import json
import math
import re
import string

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from megatron_ds.inference.model import build_inference_model
from megatron_ds.inference.scoring import lambada_accuracy, lambada_samples
from megatron_ds.inference.zeroshot import (detokenizer_for, lm_windows, read_text, wikitext_detokenizer,
                                            wikitext_perplexity)
from tests.distributed import run_distributed
from tests.inference.common import CONFIGS, EOD, VOCAB, random_weights


class CharTokenizer:
    """One id per character, covering every id of the tiny models' real vocabulary above EOD, so any
    greedy prediction decodes to a character."""
    ALPHABET = " \n" + string.ascii_letters + string.digits + string.punctuation
    ALPHABET += "".join(chr(0xC0 + k) for k in range(VOCAB - 4 - len(ALPHABET)))
    eod = EOD

    def tokenize(self, text):
        return [4 + self.ALPHABET.index(c) for c in text]

    def detokenize(self, ids):
        return "".join(self.ALPHABET[i - 4] for i in ids)


class PieceTokenizer:
    """GPT-2-like pieces: a character, or a space and a character (so a word's first token carries
    its space and a model can predict " word" greedily); every id above EOD decodes."""
    CHARS = string.ascii_letters + ".,;:!?"
    PIECES = list(CHARS) + [" " + c for c in CHARS]
    assert len(PIECES) == VOCAB - 4
    eod = EOD

    def tokenize(self, text):
        pieces = re.findall(r" ?[^ ]", text)
        assert "".join(pieces) == text, text
        return [4 + self.PIECES.index(p) for p in pieces]

    def detokenize(self, ids):
        return "".join(self.PIECES[i - 4] for i in ids)


WIKI = (" = Valkyria Chronicles = \n \n The N game ( of 1 @,@ 000 @-@ year ) is bad . It 's the players ' "
        "\" best \" game , at 3 @.@ 5 ° C : yes ; no ! ok ? \n = = Gameplay = = \n = = = Sub = = = \n")


def test_wikitext_detokenizer_applies_megatrons_rules():
    # Applied by hand, rule by rule in Megatron's order: the "s '" rule first, the number separators,
    # punctuation, brackets and quotes (the two single quotes enclose "s the players": unchanged),
    # headings, the degree sign, spaces around newlines, " N " and " 's".
    assert wikitext_detokenizer(WIKI) == (" = Valkyria Chronicles =\n\nThe 1 game (of 1,000-year) is bad. It's the "
                                          "players' \"best\" game, at 3.5°C: yes; no! ok?\n== Gameplay ==\n"
                                          "=== Sub ===\n")
    assert detokenizer_for("data/wikitext-103/wiki.test.tokens") is wikitext_detokenizer
    with pytest.raises(ValueError, match="--detokenizer"):
        detokenizer_for("data/test.txt")


def megatron_lm_dataset(tokens, seq_len, pad_idx, overalapping_eval):
    """Megatron's ``_LMDataset`` (``__init__`` and ``__getitem__``), transcribed: (text, pad_mask) per item."""
    overalapping_eval = max(1, seq_len if overalapping_eval is None else overalapping_eval)
    total_targets = len(tokens) - 1
    targets = max(total_targets - overalapping_eval, 0)
    total_sequences = max(math.ceil(targets / overalapping_eval) + 1, 1)
    items = []
    for idx in range(total_sequences):
        start_idx = idx * overalapping_eval
        end_idx = start_idx + seq_len
        toks = tokens[start_idx:end_idx + 1]
        num_tokens = len(toks)
        pad_mask = [1] * num_tokens
        if num_tokens < seq_len + 1:
            num_pad = seq_len + 1 - num_tokens
            pad_mask += [0] * num_pad
            toks += [pad_idx] * num_pad
        pad_mask = torch.tensor(pad_mask[1:])
        if overalapping_eval != seq_len and idx != 0:
            pad_mask[:-overalapping_eval] *= 0
        items.append((toks, pad_mask.tolist()))
    return items


@pytest.mark.parametrize("n,seq_len,overlap", [(100, 16, 6), (100, 16, 16), (100, 16, 20), (17, 16, 5),
                                               (5, 16, 32), (1, 8, 4), (40, 8, None), (30, 8, 0)])
def test_windows_equal_megatrons_lm_dataset(n, seq_len, overlap):
    tokens = list(range(10, 10 + n))
    ids, mask = lm_windows(tokens, seq_len, EOD, overlap)
    ref = megatron_lm_dataset(tokens, seq_len, EOD, overlap)
    assert ids.tolist() == [t for t, _ in ref]
    assert mask.tolist() == [m for _, m in ref]
    if overlap is not None and 0 < overlap <= seq_len:  # every target scored exactly once
        scored = sorted(int(ids[r, 1 + j]) for r, j in zip(*mask.nonzero()))
        assert scored == tokens[1:]


def _dense(weights):
    module = build_sequential_gpt(weights.model, padded_vocab_size=weights.padded_vocab_size, seed=0).eval()
    module.load_state_dict(weights.state_dict)
    return lambda ids: module((ids, torch.arange(ids.shape[1])[None].expand_as(ids)))[..., :weights.vocab_size]


def megatron_wikitext(weights, path, tokenizer, seq_len, overlap):
    """``_build_wikitext103_dataset`` + ``forward_step('loss')`` + ``evaluate_and_print_results``, one
    window at a time on the dense model."""
    with open(path, "rb") as reader:
        entire_data = reader.read().decode("utf-8")
    num_original_tokens = len(entire_data.strip().split(" "))
    tokenized_data = tokenizer.tokenize(wikitext_detokenizer(entire_data))
    num_tokenized_tokens = len(tokenized_data)
    forward, output = _dense(weights), 0.0
    with torch.no_grad():
        for text, pad_mask in megatron_lm_dataset(tokenized_data, seq_len, tokenizer.eod, overlap):
            tokens_ = torch.tensor(text)[None]
            losses = F.cross_entropy(forward(tokens_[:, :-1]).transpose(1, 2), tokens_[:, 1:], reduction="none")
            output += float(torch.sum(losses.view(-1) * torch.tensor(pad_mask, dtype=torch.float)))
    val_loss = output / (num_tokenized_tokens - 1)
    token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
    return {"ppl": math.exp(min(20, val_loss)), "adjusted_ppl": math.exp(min(20, val_loss * token_ratio)),
            "token_ratio": token_ratio}


def _wiki_file(tmp_path):
    path = tmp_path / "wiki.test.tokens"
    body = WIKI.replace("°", "o") * 2 + " The season 's rain was 2 @.@ 4 in ( 61 mm ) , \" wet \" . \n"
    path.write_bytes(body.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize("overlap", [6, 16, 20])
def test_wikitext_adjusted_perplexity_equals_megatrons(tmp_path, overlap):
    weights = random_weights(CONFIGS["gpt2"]())
    path, tok = _wiki_file(tmp_path), CharTokenizer()
    got = wikitext_perplexity(build_inference_model(weights, family=GPT), read_text(path), tok, seq_len=16,
                              overlapping_eval=overlap, detokenize=detokenizer_for(path), batch_size=5,
                              show_progress=False)
    ref = megatron_wikitext(weights, path, tok, 16, overlap)
    assert got["token_ratio"] == ref["token_ratio"] and got["token_ratio"] > 1.5  # chars per word
    if overlap <= 16:
        assert got["scored_tokens"] == got["num_tokenized_tokens"] - 1
    # fp32 logits up to summation order; the NLL sums (~300 terms) then agree to ~1e-6 relative,
    # and exp(loss * ratio) keeps that; a wrong window, mask or count moves it by far more.
    assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
    assert got["adjusted_ppl"] == pytest.approx(ref["adjusted_ppl"], rel=1e-5)


def megatron_lambada_correct(weights, path, tokenizer, seq_len, strict):
    """``_LambadaDataset`` + ``forward_step('accuracy')``: padded to seq_len + 1 with EOD, the
    argmax at every unmasked position must be the label."""
    forward, total = _dense(weights), 0.0
    with open(path) as f, torch.no_grad():
        for line in f.readlines():
            text = json.loads(line)["text"]
            if not strict:
                ids = tokenizer.tokenize(text)
                tokens, labels = ids[:-1], [ids[-1]]
            else:
                last_token = text.split()[-1]
                start_idx = text.rfind(last_token)
                tokens, labels = tokenizer.tokenize(text[:start_idx].strip()), tokenizer.tokenize(" " + last_token)
            pad_mask = [0] * len(tokens) + [1] * len(labels)
            tokens = tokens + labels
            num_pad = seq_len + 1 - len(tokens)
            pad_mask += [0] * num_pad
            tokens += [tokenizer.eod] * num_pad
            tokens_ = torch.tensor(tokens)[None]
            loss_mask = torch.tensor(pad_mask[1:])[None]
            correct = (forward(tokens_[:, :-1]).argmax(-1) == tokens_[:, 1:]).float()
            correct[(1 - loss_mask).bool()] = 1
            total += float(correct.prod(-1).sum())
    return int(total)


def _lambada_file(tmp_path, weights):
    """Lines right in both modes (a context and its greedy " word"), right only in the non-strict
    one (a context and its greedy next character, no space), and random ones."""
    tok, forward = PieceTokenizer(), _dense(weights)
    g = torch.Generator().manual_seed(5)
    words = ["".join(string.ascii_lowercase[i] for i in torch.randint(0, 26, (3,), generator=g)) for _ in range(120)]
    contexts = [" ".join(words[i:i + 3]) for i in range(0, 120, 3)]
    greedy = []
    with torch.no_grad():
        for c in contexts:  # up to 3 greedy pieces; a word ends before the next space
            ids = tok.tokenize(c)
            for _ in range(3):
                n = int(forward(torch.tensor([ids])).argmax(-1)[0, -1])
                if len(ids) > len(tok.tokenize(c)) and tok.detokenize([n]).startswith(" "):
                    break
                ids.append(n)
            greedy.append(tok.detokenize(ids[len(tok.tokenize(c)):]))
    lines = [c + w for c, w in zip(contexts, greedy) if w.startswith(" ")][:4]
    lines += [c + w[0] for c, w in zip(contexts, greedy) if not w.startswith(" ")][:4]
    lines += contexts[-4:]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return str(path), len(lines)


def test_lambada_strict_and_non_strict_equal_megatrons(tmp_path):
    weights = random_weights(CONFIGS["gpt2"]())
    path, n = _lambada_file(tmp_path, weights)
    model, tok, counts = build_inference_model(weights, family=GPT), PieceTokenizer(), {}
    for strict in (True, False):
        got = lambada_accuracy(model, lambada_samples(path, tok, strict=strict), pad_id=EOD, batch_size=3,
                               show_progress=False)
        counts[strict] = megatron_lambada_correct(weights, path, tok, 32, strict)
        assert got["correct"] == counts[strict] and got["samples"] == n
    assert 2 <= counts[True] < counts[False] < n  # the lines separate the modes


def _tp_task_numbers(rank, world_size, weights, wiki_path, lambada_path):
    import torch.distributed as dist

    model, tok = build_inference_model(weights, tp_group=dist.new_group([0, 1]), family=GPT), CharTokenizer()
    wiki = wikitext_perplexity(model, read_text(wiki_path), tok, seq_len=16, overlapping_eval=6,
                               detokenize=detokenizer_for(wiki_path), batch_size=4, show_progress=False)
    correct = [lambada_accuracy(model, lambada_samples(lambada_path, PieceTokenizer(), strict=s), pad_id=EOD,
                                show_progress=False)["correct"] for s in (True, False)]
    return wiki["adjusted_ppl"], correct


def test_tensor_parallel_task_numbers_equal_single_process(tmp_path):
    weights = random_weights(CONFIGS["gpt2"]())
    wiki_path, (lambada_path, _) = _wiki_file(tmp_path), _lambada_file(tmp_path, weights)
    model, tok = build_inference_model(weights, family=GPT), CharTokenizer()
    ppl = wikitext_perplexity(model, read_text(wiki_path), tok, seq_len=16, overlapping_eval=6,
                              detokenize=detokenizer_for(wiki_path), show_progress=False)["adjusted_ppl"]
    correct = [lambada_accuracy(model, lambada_samples(lambada_path, PieceTokenizer(), strict=s), pad_id=EOD,
                                show_progress=False)["correct"] for s in (True, False)]
    for tp_ppl, tp_correct in run_distributed(_tp_task_numbers, 2, weights, wiki_path, lambada_path, timeout=240):
        # The vocab-parallel loss sums partial softmax terms over 2 ranks: ~1e-6 relative in fp32.
        assert tp_ppl == pytest.approx(ppl, rel=1e-5)
        assert tp_correct == correct
