"""The GPT model family (pretrain_gpt.py; Llama-style models and mixture of experts included): ``GPT``,
the ``ModelFamily`` (``config/family.py``) its entry point gives the shared stack -- model builders,
datasets and micro-batches here, its layers and builders (``gpt_model.py``), parameter counts and
checks (``gpt_params.py``), FLOPs (``gpt_flops.py``), Hugging Face mappings (``gpt_hf.py``,
``mixtral_hf.py``, ``gpt_hf_import.py``, ``gpt_hf_export.py``) and quickstart (``gpt_quickstart.py``).

The other modules of the package never import this one: what needs the family object gets it as an
argument. The heavy imports (the model, DeepSpeed) happen inside the functions, so --help and flag
errors stay fast.
"""
from __future__ import annotations

from megatron_ds.config.family import ExportOptions, HFMapping, ModelFamily
from megatron_ds.config.memory import stack_activations
from megatron_ds.config.moe_selection import is_mlm_moe
from megatron_ds.families.gpt.gpt_flops import gpt_iteration_flops
from megatron_ds.families.gpt.gpt_params import check_gpt, count_gpt_parameters, gpt_active_parameters
from megatron_ds.families.gpt.gpt_quickstart import EVALUATION, QUICKSTART


def _model_kwargs(run, tp_group, eod_token: int, device) -> dict:
    from megatron_ds.training.engine import model_kwargs  # noqa: PLC0415

    return model_kwargs(run, tp_group, eod_token, device)


def build_gpt_model(run, ps, eod_token: int, device, loss_report):
    """This rank's GPT: its model chunks (interleaved / ZB-H1 schedules, our executor), a PipelineModule
    (DeepSpeed's pipeline engine) or one plain module (--no-pipeline-parallel); its loss reports to
    ``loss_report``."""
    from megatron_ds.families.gpt.gpt_model import (build_interleaved_gpt, build_pipeline_gpt,  # noqa: PLC0415
                                                     build_sequential_gpt)
    from megatron_ds.pipeline.p2p import tied_embedding_group  # noqa: PLC0415

    from megatron_ds.parallel.context_parallel import ContextParallel  # noqa: PLC0415

    layout = run.layout
    common = dict(_model_kwargs(run, ps.tp_group, eod_token, device), loss_report=loss_report,
                  ep_rank=ps.expert_grid_rank(layout.ep, layout.etp)[0] if is_mlm_moe(layout.model)
                  else ps.expert_parallel_rank(layout.ep, layout.expert_tp_groups))
    if layout.cp > 1:
        common["cp"] = ContextParallel(ps.cp_group, layout.cp_comm_type, layout.cp_block_kernel)
    if layout.own_schedule:
        return build_interleaved_gpt(layout.model, pp=layout.pp, pp_rank=ps.pp_rank, v=layout.virtual_pp,
                                     tie_group=tied_embedding_group(ps), chunk_layers=layout.chunk_layers, **common)
    if layout.use_pipeline:
        return build_pipeline_gpt(layout.model, topology=ps.topology,
                                  partition_method=run.distributed.pipeline_partition_method, **common)
    return build_sequential_gpt(layout.model, sp_group=ps.sp_group, **common)


def build_gpt_stage(run, stage: int, tp_group, eod_token: int):
    """The modules pipeline stage ``stage`` builds in training, on the meta device, cast to the compute
    precision as training casts them (engine.build_module: DeepSpeed's MoE builds its gate and PR-MoE
    coefficient as fp32 torch.nn.Linear layers)."""
    from megatron_ds.families.gpt.gpt_model import (build_interleaved_gpt, build_sequential_gpt,  # noqa: PLC0415
                                                     build_stage_gpt)
    from megatron_ds.training.engine import params_dtype  # noqa: PLC0415

    layout = run.layout
    common = _model_kwargs(run, tp_group, eod_token, "meta")
    if layout.own_schedule:  # interleaved or ZB-H1: our executor's chunks
        # no tie_group: synchronizing the tied copy moves values, and there are none on meta
        model = build_interleaved_gpt(layout.model, pp=layout.pp, pp_rank=stage, v=layout.virtual_pp,
                                      chunk_layers=layout.chunk_layers, **common)
    elif layout.use_pipeline:
        model = build_stage_gpt(layout.model, num_stages=layout.pp, stage=stage,
                                partition_method=run.distributed.pipeline_partition_method, **common)
    else:
        model = build_sequential_gpt(layout.model, **common)
    return model.to(params_dtype(layout)) if layout.precision != "fp32" else model


def _gpt_datasets(run, tokenizer, num_samples, log):
    from megatron_ds.training.data import build_datasets  # noqa: PLC0415

    return build_datasets(run.data, num_samples=num_samples, seq_length=run.layout.model.seq_length,
                          seed=run.training.seed, vocab_size=tokenizer.vocab_size, log=log)


def _gpt_collator(run, tokenizer):
    from megatron_ds.training.data import BatchCollator, describe_source  # noqa: PLC0415

    return BatchCollator(run.data, tokenizer.eod, tokenizer.vocab_size, describe_source(run.data))


def gpt_checkpoint_specs(model, padded_vocab_size: int, **kwargs) -> list:
    """``ModelFamily.layer_specs`` of the GPT (with MoE layers too): ``gpt_model.py``'s specs."""
    from megatron_ds.families.gpt.gpt_model import gpt_layer_specs  # noqa: PLC0415

    return gpt_layer_specs(model, padded_vocab_size=padded_vocab_size, **kwargs)


def _loss_names(layout) -> tuple[str, ...]:
    """What the GPT's loss reports: nothing beyond the loss, or with MoE layers the language-model and
    auxiliary losses and the dropped routes (Megatron-DeepSpeed's log names)."""
    from megatron_ds.config.moe_selection import is_mlm_moe, per_layer_names  # noqa: PLC0415
    from megatron_ds.config.moe_params import is_moe  # noqa: PLC0415
    from megatron_ds.model.language_model import reported_names  # noqa: PLC0415
    from megatron_ds.model.mlm_moe import ROUTING_NAMES  # noqa: PLC0415

    m = layout.model
    return reported_names(is_moe(m)) + (ROUTING_NAMES + per_layer_names(m) if is_mlm_moe(m) and is_moe(m) else ())


def _import_hf(hf_dir: str, save_dir: str, log=print) -> None:
    from megatron_ds.families.gpt.gpt_hf_import import import_hf  # noqa: PLC0415

    import_hf(hf_dir, save_dir, family=GPT, log=log)


def _export_hf(load_dir: str, out_dir: str, options: ExportOptions, log=print) -> None:
    from megatron_ds.families.gpt.gpt_hf_export import export_hf  # noqa: PLC0415

    export_hf(load_dir, out_dir, family=GPT, iteration=options.iteration, dtype=options.dtype,
              vocab_size=options.vocab_size, from_masters=options.from_masters,
              max_shard_bytes=options.max_shard_bytes, architecture=options.architecture, log=log,
              data_overrides=dict(tokenizer_type=options.tokenizer_type, vocab_file=options.vocab_file,
                                  merge_file=options.merge_file, tokenizer_model=options.tokenizer_model))


# the family of every checkpoint and run from before families were named (legacy_unnamed)
GPT = ModelFamily(name="gpt", label="GPT", check=check_gpt, count_parameters=count_gpt_parameters,
                  activations=stack_activations, build_model=build_gpt_model, build_stage=build_gpt_stage,
                  build_datasets=_gpt_datasets, make_collator=_gpt_collator, flops=gpt_iteration_flops,
                  layer_specs=gpt_checkpoint_specs, loss_names=_loss_names, active_parameters=gpt_active_parameters,
                  universal_checkpoints=True, legacy_unnamed=True,
                  hf=HFMapping(model_types=("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral"),
                               import_dir=_import_hf, export=_export_hf,
                               architectures="GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
                                             "Qwen3ForCausalLM, MistralForCausalLM or MixtralForCausalLM"),
                  evaluation=EVALUATION, generates=True, quickstart=QUICKSTART)
