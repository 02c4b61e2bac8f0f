"""The GPT model family (pretrain_gpt.py): ``gpt_family.GPT``, whose pieces are the generic floors' own."""
