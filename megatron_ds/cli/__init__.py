"""The bodies of the command lines in tools/ (and tasks/main.py): each tools/X.py (tools/checkpoint/X.py)
only calls the main(argv=None) of the module of the same name here (tasks/main.py: ``tasks``), which
tests call directly too. The top floor: it may import any other, and nothing in the package imports
it. The shared tools name no model family: they loop over the registry (``megatron_ds.families``) or
take the family a checkpoint or a Hugging Face directory holds; a family's own tools (evaluate_mlm.py,
evaluate_t5.py, tasks.py's BERT fine-tuning) use its package."""
