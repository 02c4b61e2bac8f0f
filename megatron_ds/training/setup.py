"""Start-up: rank discovery, distributed init, process groups, seeds, model, DeepSpeed engine."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from megatron_ds.config import Config, ConfigError, Layout
from megatron_ds.config.derive import guards_optimizer
from megatron_ds.launch import apply_dist_env, discover_dist_env
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.parallel.random import set_parallel_seeds
from megatron_ds.training.batch_schedule import make_lr_schedule
from megatron_ds.training.checkpointing import install_safe_loading
from megatron_ds.training.collective_timeout import apply_timeout_to_new_groups
from megatron_ds.training.log import print_rank0
from megatron_ds.training.lr_schedule import LRSchedule
from megatron_ds.training.optimizer import GuardedOptimizer, build_optimizer
from megatron_ds.training.startup_checks import explain_init_error


def discover_world(cfg: Config):
    """Rank/world from whichever launcher started us; exported for deepspeed/torch env:// init."""
    try:
        env = discover_dist_env(use_mpi=cfg.parallel.use_mpi, local_rank_arg=cfg.parallel.local_rank)
    except ValueError as exc:  # inconsistent launcher variables: the message says which
        raise ConfigError(str(exc)) from None
    apply_dist_env(env)
    return env


def select_device(local_rank: int, local_world_size: int | None = None) -> torch.device:
    """cuda:LOCAL_RANK, or the CPU (DS_ACCELERATOR=cpu or no GPU); a rank without a GPU is a
    one-line ConfigError (see megatron_ds.training.device)."""
    from megatron_ds.training.device import select_device as select  # noqa: PLC0415

    return select(local_rank, local_world_size)


def init_distributed(cfg: Config, device: torch.device) -> None:
    import deepspeed  # noqa: PLC0415 - heavy; keep --dry-run and --help fast

    backend = cfg.parallel.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    apply_timeout_to_new_groups(timedelta(minutes=cfg.parallel.distributed_timeout_minutes), log=print_rank0)
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    except Exception as exc:  # a port clash becomes one line; anything else stays as it is
        clash = explain_init_error(exc)
        if clash is None:
            raise
        raise clash from None


def params_dtype(layout: Layout) -> torch.dtype:
    # DeepSpeed keeps fp32 master weights itself; the module holds the compute precision.
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(layout.precision, torch.float32)


def build_model(cfg: Config, layout: Layout, ps: ParallelState, eod_token: int, device=None):
    """The GPT as a PipelineModule (pipeline engine) or a plain module (--no-pipeline-parallel).

    Built directly in the compute precision on ``device``: each weight is drawn in fp32 on the CPU
    generator (device-independent numbers) and moved at once, so the whole fp32 model never
    exists on the host and no second copy is made afterwards."""
    from megatron_ds.model.pipeline import build_pipeline_gpt, build_sequential_gpt  # noqa: PLC0415

    common = dict(padded_vocab_size=layout.padded_vocab_size, vocab_size=layout.vocab_size,
                  tp_group=ps.tp_group, seed=cfg.training.seed,
                  sequence_parallel=cfg.parallel.sequence_parallel,
                  reset_attention_mask=cfg.data.reset_attention_mask, eod_token=eod_token,
                  recompute_granularity=layout.recompute,
                  activation_checkpoint_interval=(cfg.training.recompute_num_layers
                                                  if layout.recompute == "full" else 0),
                  params_dtype=params_dtype(layout), device=device)
    if layout.virtual_pp > 1:
        from megatron_ds.training.interleaved import build_interleaved_model  # noqa: PLC0415
        return build_interleaved_model(layout, ps, common)
    if layout.use_pipeline:
        return build_pipeline_gpt(layout.model, topology=ps.topology,
                                  partition_method=cfg.parallel.pipeline_partition_method, **common)
    return build_sequential_gpt(layout.model, **common)


def model_is_plain(layout: Layout) -> bool:
    """DeepSpeed's plain engine runs the model (--no-pipeline-parallel, or the interleaved
    schedule, whose executor drives the plain engine); it then takes our groups as its mpu."""
    return not layout.use_pipeline or layout.virtual_pp > 1


@dataclass
class Runtime:
    engine: object
    optimizer_desc: str
    scheduler: LRSchedule
    ps: ParallelState
    device: torch.device


def build_engine(cfg: Config, layout: Layout, ps: ParallelState, device: torch.device, eod_token: int) -> Runtime:
    import deepspeed  # noqa: PLC0415

    # Model init draws from the default generators (identically on every rank); the tracker's
    # streams are re-seeded per stage after the build below.
    set_parallel_seeds(cfg.training.seed, ps.tp_rank)
    model = build_model(cfg, layout, ps, eod_token, device)
    if cfg.parallel.sequence_parallel:
        from megatron_ds.parallel.layers import register_sequence_parallel_grad_hooks  # noqa: PLC0415
        register_sequence_parallel_grad_hooks(model, ps.tp_group)
    if layout.precision != "fp32":
        model = model.to(params_dtype(layout))
    model = model.to(device)
    optimizer, desc = build_optimizer(model, cfg.optimizer, device)
    guarded = guards_optimizer(layout.precision, layout.zero_stage)
    if guarded:
        optimizer = GuardedOptimizer(optimizer, cfg.optimizer.clip_grad)
    scheduler = make_lr_schedule(optimizer, cfg, layout)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=layout.ds_config, mpu=ps if model_is_plain(layout) else None,
                                           dist_init_required=False)
    if guarded:
        optimizer.mpu = engine.mpu if engine.mpu is not None else ps
    install_safe_loading(engine, log=print_rank0)
    if layout.virtual_pp > 1:
        from megatron_ds.training.interleaved import wrap_engine  # noqa: PLC0415
        engine = wrap_engine(engine, cfg, layout, ps)
    # Dropout streams: identical across TP ranks outside TP regions, distinct per pipeline stage
    # (Megatron's seed + 100 * stage), distinct per TP rank inside TP regions (the tracker).
    set_parallel_seeds(cfg.training.seed + 100 * ps.pp_rank, ps.tp_rank)
    return Runtime(engine=engine, optimizer_desc=desc, scheduler=scheduler, ps=ps, device=device)


def describe_kernels(optimizer_desc: str, model_cfg=None, tp: int = 1) -> str:
    try:
        from megatron_ds.model.fused import describe_kernels as model_kernels  # noqa: PLC0415
        kernels = model_kernels(model_cfg, tp)
    except ImportError:
        kernels = {}
    parts = [f"{k}: {v}" for k, v in kernels.items()] + [f"optimizer: {optimizer_desc}"]
    return ", ".join(parts)


def log_startup(cfg: Config, layout: Layout, rt: Runtime, ignored: list[str]) -> None:
    print_rank0(f"> megatron_ds on {rt.device.type}: {layout.summary()}")
    print_rank0(f"> kernels: {describe_kernels(rt.optimizer_desc, layout.model, layout.tp)}")
    if ignored:
        print_rank0(f"WARNING: ignoring flags with no effect here: {' '.join(sorted(set(ignored)))}")
    if os.environ.get("MEGATRON_DS_DEBUG_RANKS"):
        print(f"> {rt.ps.describe()}", flush=True)
