"""Generate text with a trained GPT (Megatron's tools/generate_samples_gpt.py, reworked).

The model comes from a checkpoint directory written by pretrain_gpt.py (--load; saved at any
tensor / pipeline parallel size, the latest iteration unless --iteration) or from a Hugging Face
export (--hf-model). The tokenizer is the one the checkpoint was trained with unless the tokenizer
flags say otherwise.

Prompts come from the command line (--prompt, repeatable), a JSONL file (--input, one
{"prompt": ...} or {"text": ...} object per line; results go to --output as JSONL with the prompt,
the generated text and its token count), or interactively (neither: type a prompt, empty line or
Ctrl-D to quit). Prompts are batched (--batch-size) with left padding, and a KV cache makes each
new token cost one position.

Decoding: greedy (--greedy, or --temperature 0), else sampling with --temperature, --top-k, --top-p
and --seed; --repetition-penalty (1.0 = off, CTRL/transformers' rule); generation stops at the
end-of-document token unless --no-stop-at-eod. Tokens/s is printed for every batch.

Examples:
  python tools/generate_samples_gpt.py --load checkpoints --prompt "The meaning of" --max-new-tokens 40
  python tools/generate_samples_gpt.py --load checkpoints --input prompts.jsonl --output out.jsonl --greedy
  torchrun --nproc_per_node 2 tools/generate_samples_gpt.py --load checkpoints --prompt "Hello"   # TP = 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_ds.inference.generate import SamplingConfig, generate
from megatron_ds.inference.runtime import add_model_args, close_session, open_session


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    g.add_argument("--input", help="JSONL file of prompts ('prompt' or 'text' key)")
    g.add_argument("--output", help="JSONL file for the results (default: print them)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", "--out-seq-length", dest="max_new_tokens", type=int, default=64,
                   help="tokens to generate after each prompt (Megatron: --out-seq-length)")
    g.add_argument("--greedy", action="store_true", help="always take the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy; must not be negative")
    g.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0, help="keep the k most likely (0: off)")
    g.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0,
                   help="keep the most likely tokens up to this probability mass (1.0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    g.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                   help="keep generating after the end-of-document token")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-kv-cache", dest="use_cache", action="store_false",
                   help="recompute the whole sequence for every token (slow; for comparison)")
    return p


def read_prompts(args) -> list[str] | None:
    """Prompts from --prompt and --input; None means interactive."""
    prompts = list(args.prompt)
    if args.input:
        with open(args.input, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    prompts.append(obj["prompt"] if "prompt" in obj else obj["text"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{args.input}:{lineno}: expected a JSON object with a 'prompt' or "
                                     f"'text' string") from None
    return prompts or None


def run_batches(session, prompts: list[str], cfg: SamplingConfig, batch_size: int) -> list[dict]:
    tok, results = session.tokenizer, []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = [tok.tokenize(p) or [tok.eod] for p in chunk]
        gen = generate(session.model, ids, cfg, eod=tok.eod)
        session.log(f"> generated {gen.new_tokens} tokens for {len(chunk)} prompt(s) in {gen.seconds:.2f} s: "
                    f"{gen.tokens_per_second:.1f} tokens/s")
        for prompt, prompt_ids, new in zip(chunk, ids, gen.tokens):
            text_ids = new[:-1] if new and new[-1] == tok.eod and cfg.stop_at_eod else new
            results.append({"prompt": prompt, "generated": continuation(tok, prompt_ids, text_ids),
                            "new_tokens": len(new)})
    return results


def continuation(tok, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt: decoded together with the prompt, so spaces and
    characters split across tokens come out as they would in the whole text."""
    before, full = tok.detokenize(prompt_ids), tok.detokenize(prompt_ids + new_ids)
    return full[len(before):] if full.startswith(before) else tok.detokenize(new_ids)


def interactive(session, cfg: SamplingConfig) -> None:
    """Rank 0 reads prompts; under tensor parallelism the others receive them."""
    import torch.distributed as dist  # noqa: PLC0415

    while True:
        box = [None]
        if session.is_main:
            try:
                box[0] = input("prompt> ")
            except EOFError:
                box[0] = ""
        if session.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if not box[0]:
            return
        for r in run_batches(session, [box[0]], cfg, 1):
            session.log(r["prompt"] + r["generated"])


def sampling_config(args, parser) -> SamplingConfig:
    """The decoding the flags ask for; a value no decoding can use is a usage error (exit 2).
    --temperature 0 is greedy decoding (the limit of sampling as the temperature goes to 0)."""
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature} is negative: use a temperature > 0 to sample, or 0 "
                     f"(or --greedy) for greedy decoding")
    greedy = args.greedy or args.temperature == 0
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=greedy,
                         temperature=args.temperature if not greedy else 1.0, top_k=args.top_k,
                         top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                         stop_at_eod=args.stop_at_eod, seed=args.seed, use_cache=args.use_cache)
    try:
        cfg.check()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def main(argv=None) -> int:
    """Exit status: 2 for a command line refused as such, 1 when the work fails (pretrain_gpt.py's rule)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = sampling_config(args, parser)
    from megatron_ds.families import weights_family  # noqa: PLC0415 - the training stack, after --help

    try:
        prompts = read_prompts(args)
        session = open_session(args, weights_family(args.load, args.iteration, args.hf_model))
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if prompts is None:
            interactive(session, cfg)
            return 0
        results = run_batches(session, prompts, cfg, args.batch_size)
        if session.is_main:
            write_results(results, args.output)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        close_session()
    return 0


def write_results(results: list[dict], output: str | None) -> None:
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"> wrote {len(results)} result(s) to {output}")
        return
    for r in results:
        print(f"--- prompt: {r['prompt']!r} ({r['new_tokens']} new tokens)\n{r['prompt']}{r['generated']}\n")
