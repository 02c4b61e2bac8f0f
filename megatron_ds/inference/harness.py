"""lm-evaluation-harness over our inference model: an ``lm_eval`` language model (``TemplateLM``)
whose three request types run on ``InferenceModel`` at any tensor parallel size.

Every request is computed as lm-evaluation-harness's own ``hf`` model computes it on the Hugging
Face export of the same checkpoint (``lm_eval/models/huggingface.py``, ``HFLM``), so the scores are
the same:

* ``loglikelihood``: the pair is tokenized by ``TemplateLM`` (trailing spaces of the context move to
  the continuation; an empty context becomes the prefix token: the tokenizer's bos token if it has
  one, else end-of-document, as ``HFLM.prefix_token_id``); the input is
  ``(context + continuation)[-(max_length + 1):][:-1]`` and the continuation's log-probabilities
  are summed from the last ``len(continuation)`` positions; greedy when the argmax equals the
  continuation at each of them.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens with the
  prefix token in front, each scored as above, summed per document.
* ``generate_until``: greedy (or sampled, when the task asks) continuation of the context, left-
  truncated to ``max_length - max_gen_toks`` tokens, stopped at end-of-document, cut at the first
  stop sequence.

``max_length`` defaults to the model's position count (the export's ``n_positions`` /
``max_position_embeddings``, what ``HFLM`` reads).

Tensor parallelism: every rank runs lm-eval in lockstep (each reports rank 0 of 1, so lm-eval
neither shards requests nor gathers results; lm-eval returns the results on LOCAL_RANK 0 only). lm-eval's task loading, few-shot sampling
(seeded) and request order are functions of the task files alone, so every rank builds the same
requests in the same order, and the forward passes' collectives pair up without a protocol to ship
requests and results between ranks. Only rank 0 prints and writes (the caller's job).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from megatron_ds.inference.generate import SamplingConfig, generate
from megatron_ds.inference.model import InferenceModel

DEFAULT_MAX_GEN_TOKS = 256  # HFLM.max_gen_toks


class MegatronLM(TemplateLM):
    """An lm-eval model over ``InferenceModel`` with one of our tokenizers (``tokenize``,
    ``detokenize``, ``eod``)."""

    def __init__(self, model: InferenceModel, tokenizer, *, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, prefix_token_id: int | None = None):
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max length must be at least 2, got {max_length}")
        if model.max_positions is not None and max_length > model.max_positions:
            raise ValueError(f"max length {max_length} exceeds the model's {model.max_positions} positions")
        self.model, self.tok = model, tokenizer
        self.max_length, self.batch_size, self.max_gen_toks = max_length, max(1, batch_size), max_gen_toks
        # HFLM's rule: the tokenizer's bos token if it has one, else end-of-document (GPT-2's export
        # has bos = eos = <|endoftext|>; a SentencePiece model's bos is its own <s>)
        bos = getattr(tokenizer, "bos_token_id", None)
        bos = getattr(tokenizer, "bos", None) if bos is None else bos  # Llama 2/3, HF tokenizers with one
        self._prefix = prefix_token_id if prefix_token_id is not None else \
            bos if isinstance(bos, int) and bos >= 0 else tokenizer.eod

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # HFLM's default for causal models: no special tokens; a BOS the tokenizer prepends
        # (Llama2Tokenizer, Llama3Tokenizer, a Llama 3 tokenizer.json) goes, the prefix token stays its place
        ids = list(self.tok.tokenize(string))
        return ids[1:] if getattr(self.tok, "adds_bos", False) and not add_special_tokens and ids else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.detokenize(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of each request's continuation tokens after its context."""
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(f"a request needs a context and a continuation of at most {self.max_length} "
                                 f"tokens (got {len(context)} and {len(continuation)})")
            rows.append(((context + continuation)[-(self.max_length + 1):][:-1], continuation))
        # longest first, as HFLM batches; a row's result does not depend on its batch (right padding)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, r in zip(batch, self._score_batch([rows[i] for i in batch])):
                results[i] = r
        return results

    def _score_batch(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        width = max(len(inp) for inp, _ in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (inp, _) in enumerate(rows):
            ids[i, :len(inp)] = torch.tensor(inp, dtype=torch.long)
        ids = ids.to(self.model.device)
        positions = torch.arange(width, device=ids.device).expand_as(ids)
        logits = self.model.logits(ids, positions)
        out = []
        for i, (inp, cont) in enumerate(rows):
            # only the continuation's positions are normalised (a second [batch, seq, vocab] is not needed)
            span = F.log_softmax(logits[i, len(inp) - len(cont):len(inp)], dim=-1)
            target = torch.tensor(cont, dtype=torch.long, device=span.device)
            greedy = bool((span.argmax(-1) == target).all())
            out.append((float(span.gather(1, target[:, None]).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation kwargs run together, ``batch_size`` prompts at a time
        (left-padded: padding changes no prompt's tokens, ``megatron_ds.inference.generate``)."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list = [None] * len(requests)
        for members in groups.values():
            self._generate_group([requests[i].args for i in members], members, out)
        return out

    def _generate_group(self, args: list[tuple[str, dict]], members: list[int], out: list) -> None:
        kwargs = normalize_gen_kwargs(args[0][1], self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]))
        max_gen = kwargs.pop("max_gen_toks")
        room = self.max_length - max_gen
        if room <= 0:
            raise ValueError(f"max_gen_toks {max_gen} leaves no room for a context in {self.max_length} tokens")
        prompts = [(self.tok_encode(context) or [self.prefix_token_id])[-room:] for context, _ in args]
        order = sorted(range(len(args)), key=lambda k: -len(prompts[k]))  # similar lengths share a batch
        cfg = self._sampling(kwargs, max_gen)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            generated = generate(self.model, [prompts[k] for k in batch], cfg, eod=self.eot_token_id).tokens
            for k, tokens in zip(batch, generated):
                if tokens and tokens[-1] == self.eot_token_id:
                    tokens = tokens[:-1]
                text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                self.cache_hook.add_partial("generate_until", args[k], text)
                out[members[k]] = text

    @staticmethod
    def _sampling(kwargs: dict, max_gen: int) -> SamplingConfig:
        """A task's generation kwargs as our sampling settings (greedy unless it samples)."""
        if not kwargs.get("do_sample"):
            return SamplingConfig(max_new_tokens=max_gen, greedy=True)
        return SamplingConfig(max_new_tokens=max_gen, temperature=float(kwargs.get("temperature") or 1.0),
                              top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                              seed=int(kwargs.get("seed", 1234)))
