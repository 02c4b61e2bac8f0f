"""The GPT model family (pretrain_gpt.py; Llama-style models and mixture of experts included): ``GPT``
(``gpt_family.py``), its model as layer specs and builders (``gpt_model.py``), parameter counts and checks
(``gpt_params.py``), FLOPs (``gpt_flops.py``), Hugging Face mappings (``gpt_hf.py``: GPT-2 and Llama;
``mixtral_hf.py``; ``gpt_hf_import.py`` and ``gpt_hf_export.py``, the directories both ways) and quickstart
(``gpt_quickstart.py``)."""
