"""Zero-shot evaluation: sliding-window perplexity and LAMBADA-style last-word accuracy.

Perplexity follows the sliding-window recipe of Hugging Face's perplexity guide (the one wikitext
numbers are usually computed with): windows of ``window`` tokens start every ``stride`` tokens and
each window scores only the tokens the previous window did not (``trg_len = end - prev_end``), so
every scored token sees up to ``window - stride`` tokens of context. Inside a window the labels are
shifted by one, so a window's first token is never a target. Perplexity is
``exp(sum of scored negative log-likelihoods / number of scored tokens)``.

LAMBADA follows Megatron-LM's ``tasks/zeroshot_gpt`` (``_LambadaDataset.get_tokens``): in strict
mode the target is the whole last word, tokenized with its leading space after the context (the
text before it, stripped); otherwise it is the last token. A sample is correct when the greedy
prediction at every target position equals the target token (teacher-forced), as Megatron counts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ds.inference.model import InferenceModel
from megatron_ds.progress import progress


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    score_from: int
    """Absolute index of the first target scored in this window."""


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows of Hugging Face's perplexity guide over a stream of ``num_tokens`` tokens."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"need window >= 2 and 0 < stride <= window, got window {window}, stride {stride}")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return [w for w in windows if w.score_from < w.end]


def _window_batches(windows: list[Window], batch_size: int):
    """Consecutive windows of equal length, ``batch_size`` at a time (all but the last are full)."""
    batch: list[Window] = []
    for w in windows:
        if batch and (len(batch) == batch_size or w.end - w.begin != batch[0].end - batch[0].begin):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


def perplexity(model: InferenceModel, tokens: np.ndarray, *, window: int, stride: int, batch_size: int = 4,
               show_progress: bool = True) -> dict:
    """Sliding-window perplexity of a token stream (see the module docstring)."""
    if model.max_positions is not None and window - 1 > model.max_positions:
        raise ValueError(f"window {window} needs {window - 1} positions; the model has {model.max_positions}")
    windows = sliding_windows(len(tokens), window, stride)
    stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    nll, count = 0.0, 0
    with progress(total=sum(w.end - w.score_from for w in windows), desc="perplexity", unit="tokens",
                  enabled=show_progress) as bar:
        for batch in _window_batches(windows, batch_size):
            ids = torch.stack([stream[w.begin:w.end] for w in batch]).to(model.device)
            losses = model.token_losses(ids[:, :-1], ids[:, 1:])  # target j is absolute begin + 1 + j
            target_pos = torch.arange(1, ids.shape[1], device=ids.device)
            for row, w in enumerate(batch):
                scored = losses[row][w.begin + target_pos >= w.score_from]
                nll += float(scored.double().sum())
                count += scored.numel()
                bar.update(scored.numel())
    return {"tokens": int(len(tokens)), "scored_tokens": count, "window": window, "stride": stride,
            "windows": len(windows), "nll": nll / count, "perplexity": math.exp(nll / count)}


def lambada_samples(path: str, tokenizer, *, strict: bool = True, key: str = "text") -> list[tuple[list, list]]:
    """(context tokens, target tokens) per JSONL line, as Megatron's ``_LambadaDataset``."""
    samples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a {key!r} string") from None
            if not isinstance(text, str) or not text.split():
                raise ValueError(f"{path}:{lineno}: the {key!r} text is empty")
            if strict:
                last = text.split()[-1]
                context = tokenizer.tokenize(text[:text.rfind(last)].strip())
                target = tokenizer.tokenize(" " + last)
            else:
                ids = tokenizer.tokenize(text)
                context, target = ids[:-1], ids[-1:]
            if not context or not target:
                raise ValueError(f"{path}:{lineno}: text too short for a context and a last word")
            samples.append((context, target))
    return samples


def lambada_accuracy(model: InferenceModel, samples: list[tuple[list, list]], *, pad_id: int, batch_size: int = 8,
                     show_progress: bool = True) -> dict:
    """Teacher-forced last-word accuracy (every target token must be the argmax) and the targets' PPL.
    Rows are right-padded: with causal attention, padding after a sample cannot change it."""
    if model.max_positions is not None:  # keep the end of a context too long for the positions
        samples = [(c[max(0, len(c) + len(t) - 1 - model.max_positions):], t) for c, t in samples]
    correct, nll, count = 0, 0.0, 0
    with progress(total=len(samples), desc="lambada", unit="samples", enabled=show_progress) as bar:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start:start + batch_size]
            seqs = [c + t for c, t in chunk]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
            ids = ids.to(model.device)
            positions = torch.arange(width - 1, device=ids.device).expand(len(seqs), -1)
            logits = model.logits(ids[:, :-1], positions)
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            predicted = logits.argmax(-1)
            for i, (context, target) in enumerate(chunk):
                span = slice(len(context) - 1, len(context) - 1 + len(target))
                correct += bool((predicted[i, span] == ids[i, 1:][span]).all())
                nll += float(losses[i, span].double().sum())
                count += len(target)
            bar.update(len(chunk))
    return {"samples": len(samples), "correct": correct, "accuracy": correct / len(samples),
            "target_tokens": count, "target_perplexity": math.exp(nll / count)}
