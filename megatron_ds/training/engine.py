"""The model, its optimizer and LR schedule inside DeepSpeed's engine, seeded as Megatron seeds them."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

import deepspeed

from megatron_ds import ds_compat
from megatron_ds.checkpoint.checkpointing import install_safe_loading
from megatron_ds.config.arguments import describe_ignored
from megatron_ds.config.deepspeed_json import guards_optimizer
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import Layout
from megatron_ds.config.run import Run
from megatron_ds.model.compile_layers import compile_layers, describe_compiled_layers
from megatron_ds.model.kernels import describe_kernels
from megatron_ds.model.loss_report import LossReport
from megatron_ds.model.moe_layer import is_moe_model
from megatron_ds.model.token_loss import GlobalTokenScale
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.parallel.layers import ColumnParallelLinear, RowParallelLinear, register_sequence_parallel_grad_hooks
from megatron_ds.parallel.random import set_parallel_seeds
from megatron_ds.parallel.utils import PRECISION_DTYPES
from megatron_ds.pipeline.executor import wrap_engine
from megatron_ds.progress import print_rank0
from megatron_ds.training.lr_schedule import make_lr_schedule
from megatron_ds.training.optimizer import GuardedOptimizer, build_optimizer

def params_dtype(layout: Layout) -> torch.dtype:
    # DeepSpeed keeps fp32 master weights itself; the module holds the compute precision.
    return PRECISION_DTYPES[layout.precision]


def model_kwargs(run: Run, tp_group, eod_token: int, device=None) -> dict:
    """The model builders' arguments for this run (all but the pipeline placement), shared by the
    families' builders of training and of --dry-run's build on the meta device (``training.meta_build``)."""
    layout = run.layout
    return dict(padded_vocab_size=layout.padded_vocab_size, vocab_size=layout.vocab_size, tp_group=tp_group,
                seed=run.training.seed, sequence_parallel=layout.sequence_parallel,
                reset_attention_mask=run.data.reset_attention_mask, eod_token=eod_token,
                recompute_granularity=layout.recompute,
                activation_checkpoint_interval=(layout.recompute_num_layers if layout.recompute == "full" else 0),
                params_dtype=params_dtype(layout), device=device, fp8=layout.fp8,
                # the expert parallel size only where MoE layers exist (GPT only: other families take no ep_size)
                **({"ep_size": layout.ep, "expert_tp": layout.etp} if layout.active_params is not None else {}))


def build_module(run: Run, ps: ParallelState, device: torch.device, eod_token: int,
                 loss_report: LossReport | None = None, *, build) -> torch.nn.Module:
    """This rank's model, seeded, in its compute precision, on ``device``: what DeepSpeed's engine
    is given (and what the fake-CUDA tests run on ``cuda``). ``build``: the model family's builder
    (``config.family.ModelFamily.build_model``).

    A family's builder builds its model directly in the compute precision on ``device``: each weight is
    drawn in fp32 on the CPU generator (device-independent numbers) and moved at once, so the whole fp32
    model never exists on the host and no second copy is made afterwards."""
    # Model init draws from the default generators (identically on every rank); the tracker's
    # streams are re-seeded per stage once the engine exists (build_engine).
    set_parallel_seeds(run.training.seed, ps.tp_rank)
    model = build(run, ps, eod_token, device, loss_report)
    # the norms under --sequence-parallel, and --qk-layernorm's per-head norms at any TP size: partial gradients
    # over TP (the projection-scope norm's weight is split over TP with the heads: whole per rank, model/norms.py)
    register_sequence_parallel_grad_hooks(model, ps.tp_group)
    if run.layout.precision != "fp32":
        model = model.to(params_dtype(run.layout))
    model = model.to(device)
    if run.layout.model.compile_layers:  # regional compilation, once, on the built and placed model
        compile_layers(model)
    return model


def model_is_plain(layout: Layout) -> bool:
    """DeepSpeed's plain engine runs the model (--no-pipeline-parallel, or the interleaved or ZB-H1
    schedule, whose executor drives the plain engine); it then takes our groups as its mpu."""
    return not layout.use_pipeline or layout.own_schedule


@dataclass(frozen=True)
class Runtime:
    engine: object
    loss_fn: object  # loss(logits, (labels, loss_mask)) of the plain engine's loop (the model's own)
    optimizer_desc: str
    ps: ParallelState
    device: torch.device
    loss_report: LossReport  # what the model's loss function reports besides its loss (the loop prints it)
    fused_weights: int = 0  # weights whose gradient GEMM adds into DeepSpeed's fp32 gradient (--gradient-accumulation-fusion)


def scale_fp16_loss(engine, model) -> None:
    """DeepSpeed 0.18.3-0.19.x trains --fp16 without ZeRO unscaled (``ds_compat.FP16_ZERO0_UNSCALED_SINCE``):
    ``engine.backward`` leaves the loss as it is while the fp16 optimizer's step divides the gradients by
    the loss scale, so every update would shrink by that scale (2^16 by default) and small fp16
    gradients would underflow to zero. Where that is so, the model's loss multiplies its own gradient
    by the optimizer's current scale in backward, as ``FP16_Optimizer.backward`` used to. The plain and
    the pipeline engine and the interleaved executor all take their loss from ``model.loss_fn``; its
    value (what the log reports) stays unscaled."""
    optimizer = ds_compat.unscaled_fp16_optimizer(engine)
    if optimizer is None:
        return
    loss_fn = model.loss_fn

    def scaled_loss_fn(output, labels):
        loss = loss_fn(output, labels)
        if loss.requires_grad:  # training (evaluation runs without autograd)
            loss.register_hook(lambda grad: grad * ds_compat.loss_scale(optimizer))
        return loss

    ds_compat.replace_loss_fn(model, functools.update_wrapper(scaled_loss_fn, loss_fn))


def describe_run_kernels(run: Run, optimizer: str, *, on_cuda: bool = False, skip: tuple[str, ...] = ()) -> str:
    """The ``kernels:`` line: what runs each piece of this run's model (``on_cuda``: as a CUDA run
    would, from any host: --dry-run), the pieces named in ``skip`` left out."""
    layout = run.layout
    kernels = {**describe_kernels(layout.model, layout.tp, run.fused_loss_reason, on_cuda=on_cuda),
               "transformer layers": describe_compiled_layers(layout.model), "optimizer": optimizer}
    return ", ".join(f"{k}: {v}" for k, v in kernels.items() if k not in skip)


def fuse_grad_accumulation(layout: Layout, engine, model: torch.nn.Module) -> int:
    """--gradient-accumulation-fusion: the tensor-parallel linear layers' own weights take DeepSpeed's
    fp32 gradient as their ``main_grad`` (``parallel.weight_grad``), where its optimizer keeps one
    (``config.deepspeed_json.keeps_fp32_grads``; the layout's summary says so); returns how many.
    Weights tied across pipeline stages (``ds_pipe_replicated``) keep their ``.grad``: the pipeline
    engine all-reduces those itself."""
    opt = engine.optimizer
    if not layout.grad_accum_fusion or not ds_compat.is_bf16_optimizer(opt) or opt.grad_acc_dtype != torch.float32:
        return 0
    weights = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and isinstance(m.weight, torch.nn.Parameter) and not getattr(m.weight, "ds_pipe_replicated", False)]
    return ds_compat.link_main_grads(opt, weights)


def build_engine(run: Run, ps: ParallelState, device: torch.device, eod_token: int, *,
                 family: ModelFamily) -> Runtime:
    """The model built for this rank, its optimizer (NaN-guarded in fp32 ZeRO-0) and LR schedule,
    inside ``deepspeed.initialize``'s engine (the interleaved executor around it where asked).
    ``family``: the model family (its builder and the terms its loss reports)."""
    layout = run.layout
    # DeepSpeed-MoE, or Megatron-LM's MoE split over expert parallel ranks (config/moe_selection.py), whose experts'
    # gradients DeepSpeed reduces over their expert data parallel groups
    moe = is_moe_model(layout.model) or layout.expert_grid
    if layout.expert_grid:  # Megatron-LM's expert grid, registered as DeepSpeed's expert groups (parallel/groups.py)
        ps.expert_grid(layout.ep, layout.etp)
    elif moe:  # DeepSpeed's expert groups, on every rank, before its engine (parallel/groups.py)
        ps.expert_groups(layout.ep, layout.expert_tp_groups)
    # the family's reported terms (BERT: lm loss, sop loss; an MoE GPT: lm loss, moe loss, ...)
    # --calculate-per-token-loss: the scale the loss applies and the loop sets per step (model/token_loss.py)
    loss_report = LossReport(family.loss_names(layout),
                             token_scale=GlobalTokenScale() if run.training.calculate_per_token_loss else None)
    model = build_module(run, ps, device, eod_token, loss_report, build=family.build_model)
    optimizer, desc = build_optimizer(model, run.optimizer, device)
    guarded = guards_optimizer(layout.precision, layout.zero_stage)
    if guarded:
        optimizer = GuardedOptimizer(optimizer, run.optimizer.clip_grad,
                                     expert_group=ds_compat.moe_group_name(layout.ep) if moe else None,
                                     expert_norm_groups=(ps.expert_mp_group, ps.pp_group) if layout.expert_grid
                                     else None)
    scheduler = make_lr_schedule(optimizer, run)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=layout.ds_config, mpu=ps if model_is_plain(layout) else None,
                                           dist_init_required=False)
    if guarded:
        optimizer.mpu = engine.mpu if engine.mpu is not None else ps
    # DeepSpeed's ZeRO-0 fp16 optimizers: the loss scale its backward leaves out, the norm they clip by
    scale_fp16_loss(engine, model)
    ds_compat.count_fp16_grads_once(engine.optimizer)
    install_safe_loading(engine, log=print_rank0)
    fused = fuse_grad_accumulation(layout, engine, model)
    if layout.own_schedule:
        engine = wrap_engine(engine, run, ps)
    # Dropout streams: identical across TP ranks outside TP regions, distinct per pipeline stage
    # (Megatron's seed + 100 * stage), distinct per TP rank inside TP regions (the tracker).
    # --data-parallel-random-init: + 10 per data parallel rank (megatron/initialize.py _set_random_seed); the
    # initial weights stay equal all the same, as deepspeed.initialize broadcast them from DP rank 0
    # DeepSpeed-Ulysses' SP ranks share these streams (their dropout masks repeat over the shards), as in
    # Megatron-DeepSpeed, whose seeds follow the PP and TP ranks only; a resume restores one state per DP rank
    dp_offset = 10 * ps.dp_rank if run.training.data_parallel_random_init else 0
    set_parallel_seeds(run.training.seed + 100 * ps.pp_rank + dp_offset, ps.tp_rank)
    return Runtime(engine=engine, loss_fn=model.loss_fn, optimizer_desc=desc, ps=ps, device=device,
                   loss_report=loss_report, fused_weights=fused)


def log_startup(run: Run, rt: Runtime) -> None:
    """The layout, the kernels in use, the flags without effect and the overrides, once."""
    layout = run.layout
    print_rank0(f"> megatron_ds on {rt.device.type}: {layout.summary()}")
    print_rank0(f"> kernels: {describe_run_kernels(run, rt.optimizer_desc)}")
    if rt.fused_weights:
        print_rank0(f"> gradient accumulation fusion: {rt.fused_weights} weights add their gradients into "
                    "DeepSpeed's fp32 gradients")
    if run.ignored_flags:
        print_rank0(f"WARNING: ignoring flags with no effect here: {describe_ignored(run.ignored_flags)}")
    if os.environ.get("MEGATRON_DS_DEBUG_RANKS"):
        print(f"> {rt.ps.describe()}", flush=True)
    for note in run.notes:
        print_rank0(f"WARNING: {note}")
