"""Using a trained model: generation with a KV cache, perplexity and LAMBADA evaluation.

    model.py     full weights -> a GPT at any tensor parallel size, full-vocabulary logits
    generate.py  batched, left-padded decoding: greedy, temperature, top-k/top-p, repetition penalty
    evaluate.py  sliding-window perplexity, LAMBADA-style last-word accuracy
    zeroshot.py  Megatron's zero-shot WIKITEXT103 numbers: its detokenizer, windows, adjusted perplexity
    harness.py   an lm-evaluation-harness model (lm_eval's TemplateLM) over the inference model
    runtime.py   what the CLIs share (launcher, device, checkpoint / HF export, tokenizer)
"""
