"""Text generation: batched prompts of different lengths, a KV cache, greedy or sampled decoding.

Prompts are left-padded to a common length, so every sequence's next token is at the same column.
Padding never influences a real token: the attention mask hides padded keys, and position ids
count only real tokens (learned positions; rotary embeddings depend on relative positions only,
so a constant shift per row changes nothing). Each padded position attends to itself alone, which
keeps its (unused) activations finite.

With the cache, the prompt runs once and each new token costs one position; ``use_cache=False``
re-runs the whole sequence for every token (the reference the cache is tested against).

At TP > 1 every rank runs the same loop; the gathered logits are identical on all ranks, and the
chosen tokens are broadcast from the group's first rank anyway, so sampling can never diverge.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.inference.model import InferenceModel
from megatron_ds.model.kv_cache import KVCache
from megatron_ds.parallel.utils import tp_world_size


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop_at_eod: bool = True
    seed: int = 1234
    use_cache: bool = True

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got {self.top_k} and {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Generation:
    tokens: list[list[int]]
    """Per prompt, the new tokens (up to and including the end-of-document token when it stopped there)."""
    seconds: float
    new_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty as transformers applies it: the logit of every token already in the sequence
    is divided by ``penalty`` if positive, multiplied if negative. ``seen``: ``[b, vocab]`` bool."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the ``top_k`` largest and outside the smallest set whose
    probability reaches ``top_p`` (the most likely token always stays)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, seen: torch.Tensor, cfg: SamplingConfig,
                generator: torch.Generator) -> torch.Tensor:
    """``[b, vocab]`` fp32 logits of the last position -> ``[b]`` next tokens."""
    logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if cfg.greedy:
        return logits.argmax(-1)
    logits = filter_top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p)
    probs = logits.softmax(-1).cpu()  # sampled on the CPU generator: the same draws on any device
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def attention_mask(valid: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``[b, 1, end - start, end]`` bool: query ``i`` (absolute ``start + i``) may see key ``j``
    when ``j <= start + i`` and ``j`` is a real token, or ``j`` is the query itself."""
    q = torch.arange(start, end, device=valid.device)[:, None]
    k = torch.arange(end, device=valid.device)[None, :]
    allowed = (k <= q) & valid[:, None, None, :end]
    return allowed | (k == q)


def _broadcast(tokens: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_world_size(tp_group) > 1:
        dist.broadcast(tokens, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return tokens


class _Batch:
    """Left-padded token buffer for the whole generation, with its validity and positions."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device):
        self.width = max(len(p) for p in prompts)
        total = self.width + max_new_tokens
        self.tokens = torch.full((len(prompts), total), pad_id, dtype=torch.long, device=device)
        self.valid = torch.zeros((len(prompts), total), dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            self.tokens[i, self.width - len(p):self.width] = torch.tensor(p, dtype=torch.long)
            self.valid[i, self.width - len(p):self.width] = True
        self.valid[:, self.width:] = True  # generated columns (finished rows keep padding tokens)

    def positions(self, start: int, end: int) -> torch.Tensor:
        return (self.valid[:, :end].long().cumsum(1) - 1).clamp(min=0)[:, start:end]


def _check_prompts(model: InferenceModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if model.max_positions is not None and longest > model.max_positions:
        raise ValueError(f"prompt ({max(len(p) for p in prompts)} tokens) + max new tokens ({max_new_tokens}) "
                         f"exceed the model's {model.max_positions} positions")


@torch.no_grad()
def generate(model: InferenceModel, prompts: list[list[int]], cfg: SamplingConfig, *, eod: int) -> Generation:
    """Generate up to ``cfg.max_new_tokens`` tokens after each prompt (token id lists)."""
    cfg.check()
    _check_prompts(model, prompts, cfg.max_new_tokens)
    # Padding (and finished rows) hold id 0: never attended to, and inside any vocabulary.
    batch = _Batch(prompts, cfg.max_new_tokens, 0, model.device)
    generator = torch.Generator().manual_seed(cfg.seed)
    seen = torch.zeros((len(prompts), model.vocab_size), dtype=torch.bool, device=model.device)
    for i, prompt in enumerate(prompts):
        seen[i, torch.tensor(prompt, dtype=torch.long)] = True
    done = torch.zeros(len(prompts), dtype=torch.bool, device=model.device)
    out: list[list[int]] = [[] for _ in prompts]
    cache, start = KVCache(batch.tokens.shape[1]), 0
    t0 = time.perf_counter()
    for col in range(batch.width, batch.tokens.shape[1]):
        if not cfg.use_cache:
            cache, start = KVCache(batch.tokens.shape[1]), 0
        cache.mask = attention_mask(batch.valid, start, col)
        logits = model.logits(batch.tokens[:, start:col], batch.positions(start, col), cache)[:, -1]
        token = _broadcast(next_tokens(logits, seen, cfg, generator), model.tp_group)
        token = torch.where(done, torch.zeros_like(token), token)
        batch.tokens[:, col] = token
        seen[torch.arange(len(prompts)), token] = True
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(token[i]))
        if cfg.stop_at_eod:
            done |= token == eod
        start = col
        if bool(done.all()):
            break
    seconds = time.perf_counter() - t0
    return Generation(tokens=out, seconds=seconds, new_tokens=sum(len(t) for t in out))
