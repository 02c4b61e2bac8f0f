"""The parallelism planner: the fastest layout that fits, ranked by the time model.

``plan(request)`` enumerates layouts of the request's model on its cluster -- TP (inside a node),
PP with interleaving (model chunks per rank), Megatron's sequence parallelism, DeepSpeed-Ulysses
(plain engine), Megatron-LM's context parallelism, ZeRO stage (2 and 3 on the plain engine), micro
batch, recompute (none, selective, full) -- resolves each through the same ``config.resolve`` a
``--dry-run`` runs (a layout it refuses is not a candidate), keeps those whose memory estimate
(``config.memory.estimate_memory``, the one ``--dry-run`` prints) fits the GPU, and ranks them by
``time_model.step_time`` (layouts within its expected error of each other are ties:
``time_model.tie_groups``). Layouts differing only in micro batch, recompute, ZeRO and the like are
derived from one resolution per (TP, PP, chunks, sequence parallelism, Ulysses, CP, ZeRO) and
evaluated fastest first, so a 1T model on thousands of GPUs is planned in seconds. The ranking is of
(TP, PP) pairs, each with its fastest fitting variant: what a user chooses first. docs/planner.md has
the output and the model.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

from megatron_ds.config import Config, moe_selection, resolve
from megatron_ds.config.layout import Layout, uneven_flags
from megatron_ds.config.memory import GB, MemoryEstimate, choose_fused_loss, estimate_memory
from megatron_ds.config.schema import ParallelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.parallel.schedules import check_schedule
from megatron_ds.planner.time_model import Cluster, StepTime, expected_error, step_time, tie_groups

RECOMPUTE = (None, "selective", "full")
FEATURES = ("interleaved", "zbh1", "sequence-parallel", "ulysses", "expert-parallel", "uneven-stages",
            "context-parallel")
MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Knobs:
    """One layout's choices, as flags of pretrain_*.py."""
    tp: int
    pp: int
    v: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    seq_par: bool = False  # Megatron's sequence parallelism (TP > 1)
    sp: int = 1  # DeepSpeed-Ulysses ranks
    zero: int = 0
    mb: int = 1
    recompute: str | None = None
    zbh1: bool = False  # the ZB-H1 zero-bubble schedule
    ep: int = 1  # MoE expert parallel ranks
    mlm_moe: bool = False  # the line builds Megatron-LM's MoE layer: EP is --expert-model-parallel-size
    partition: str | None = None  # --pipeline-partition-method (None: the command line's)
    cp: int = 1  # Megatron-LM's context parallel ranks (--context-parallel-size)

    def flags(self) -> list[str]:
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--micro-batch-size", str(self.mb), "--zero-stage", str(self.zero)]
        if self.v > 1:
            out += ["--virtual-pipeline-model-parallel-size", str(self.v)]
        if self.seq_par:
            out.append("--sequence-parallel")
        if self.sp > 1:
            out += ["--ds-sequence-parallel-size", str(self.sp)]
        if self.zero >= 2 or self.sp > 1:  # ZeRO 2/3 and Ulysses run on DeepSpeed's plain engine
            out.append("--no-pipeline-parallel")
        if self.recompute:
            out += ["--recompute-granularity", self.recompute]
        if self.zbh1:
            out.append("--enable-zbh1-pipeline")
        if self.ep > 1:
            out += ["--expert-model-parallel-size" if self.mlm_moe else "--moe-expert-parallel-size", str(self.ep)]
        if self.partition:
            out += ["--pipeline-partition-method", self.partition]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        return out

    def apply(self, cfg: Config) -> Config:
        par = dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.v if self.v > 1 else None,
            num_layers_per_virtual_pipeline_stage=None, sequence_parallel=self.seq_par,
            ds_sequence_parallel_size=self.sp, no_pipeline_parallel=self.zero >= 2 or self.sp > 1,
            enable_zbh1_pipeline=self.zbh1, enable_zbh1_exact_semantics=False,
            # the EP flag of the line's MoE layer (config/moe_selection.py); the other family's at its default
            moe_expert_parallel_size=1 if self.mlm_moe else self.ep,
            expert_model_parallel_size=(self.ep if self.ep > 1 else None) if self.mlm_moe else None,
            context_parallel_size=self.cp,
            **({"pipeline_partition_method": self.partition} if self.partition else {}))
        tr = dataclasses.replace(cfg.training, micro_batch_size=self.mb, recompute_granularity=self.recompute,
                                 checkpoint_activations=False, deepspeed_activation_checkpointing=False,
                                 recompute_activations=False, activations_checkpoint_method=None)
        ds = dataclasses.replace(cfg.deepspeed, zero_stage=self.zero)
        return dataclasses.replace(cfg, parallel=par, training=tr, deepspeed=ds)

    def describe(self) -> str:
        extra = (f" x {self.v} chunks" if self.v > 1 else "") + (" ZB-H1" if self.zbh1 else "") + (
            " +SP" if self.seq_par else "") + (f" Ulysses {self.sp}" if self.sp > 1 else "") + (
            f" EP {self.ep}" if self.ep > 1 else "") + (f" CP {self.cp}" if self.cp > 1 else "")
        return (f"TP {self.tp} x PP {self.pp}{extra}, micro batch {self.mb}, recompute {self.recompute or 'none'}, "
                f"ZeRO {self.zero}")


# The flags a Knobs sets: a command line's own values of them are replaced (``strip_knobs``).
KNOB_FLAGS_WITH_VALUE = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                         "--zero-stage", "--virtual-pipeline-model-parallel-size",
                         "--num-layers-per-virtual-pipeline-stage", "--recompute-granularity",
                         "--ds-sequence-parallel-size", "--recompute-method", "--activations-checkpoint-method",
                         "--moe-expert-parallel-size", "--context-parallel-size")
KNOB_SWITCHES = ("--checkpoint-activations", "--deepspeed-activation-checkpointing", "--recompute-activations",
                 "--sequence-parallel", "--no-pipeline-parallel", "--enable-zbh1-pipeline",
                 "--enable-zbh1-exact-semantics")


def strip_knobs(argv: list[str], with_value=KNOB_FLAGS_WITH_VALUE, switches=KNOB_SWITCHES) -> list[str]:
    """``argv`` without the given flags (``--flag value`` and ``--flag=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in with_value:
            skip = "=" not in arg
            continue
        if name in switches:
            continue
        out.append(arg)
    return out


@dataclass(frozen=True)
class Candidate:
    knobs: Knobs
    layout: Layout
    time: StepTime
    memory: MemoryEstimate | None = None


@dataclass(frozen=True)
class Request:
    flags: Config  # the parsed command line: the model, batch, precision, DeepSpeed JSON
    cluster: Cluster
    vocab_size: int
    family: object
    template: dict | None = None  # the DeepSpeed JSON as loaded (None: none given)
    # where the command line names none: the JSON (path, as loaded) for each ZeRO stage, as the ABCI
    # scripts choose them (ds_configs/zero<stage>_<precision>.json)
    stage_templates: dict | None = None
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    recompute: tuple[str | None, ...] = RECOMPUTE
    zero: tuple[int, ...] = (0, 1, 2, 3)
    flash: bool = True  # attention by fused kernels (docs/planner.md)
    without: frozenset = frozenset()  # of FEATURES: not to enumerate (a published run's software lacked them)


@dataclass(frozen=True)
class Plan:
    ranked: tuple[Candidate, ...]  # the fastest fitting variant of each (TP, PP), fastest first
    enumerated: int  # layouts the resolution accepted
    checked: int  # of them, memory estimates made (fastest first, one fit per (TP, PP) suffices)
    seconds: float


def _divisors_pow2(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


UNEVEN_PARTITION = "type:transformer|embedding"


def structures(request: Request):
    """(TP, PP, chunks or ZB-H1, sequence parallel, Ulysses, ZeRO, EP) the world size and the model allow
    (a family that cannot interleave, run ZB-H1 or Ulysses is refused those by the resolution). PP need not
    divide the layers: such stages run on DeepSpeed's 1F1B engine, placed by ``UNEVEN_PARTITION`` unless the
    command line places them itself (--pipeline-partition-method, Megatron-LM's uneven-stage flags)."""
    m, world = request.flags.model, request.cluster.world_size
    heads = m.num_attention_heads
    kv = m.num_key_value_heads or heads
    experts = max(m.num_experts or (1,))
    mlm = uses_mlm_moe(request.flags)
    off = request.without
    par = request.flags.parallel
    own_placement = par.pipeline_partition_method != ParallelConfig.pipeline_partition_method or bool(
        uneven_flags(par))
    for tp in _divisors_pow2(min(request.cluster.gpus_per_node, heads)):
        if heads % tp or kv % tp or world % tp:
            continue
        for pp in range(1, m.num_layers + 1):
            per_rank, uneven = m.num_layers // pp, m.num_layers % pp
            if world % (tp * pp) or (uneven and "uneven-stages" in off):
                continue
            # PP not dividing the layers: the command line's own placement, else DeepSpeed's balance of BLOOM's
            # run, where the embedding and the output layer weigh as a transformer layer each
            partition = UNEVEN_PARTITION if uneven and not own_placement else None
            # (chunks, ZB-H1): the interleaved schedule's chunk counts, and ZB-H1 without chunks; both need even
            # stages, uneven ones run on DeepSpeed's 1F1B engine
            schedules = [(1, False)]
            if pp > 1 and not uneven:
                schedules = [(v, False) for v in (1, 2, 4, 8) if per_rank % v == 0 and (
                    v == 1 or "interleaved" not in off)] + ([(1, True)] if "zbh1" not in off else [])
            seq_pars = (False, True) if tp > 1 and "sequence-parallel" not in off else (False,)
            for (v, zbh1), seq_par, zero in itertools.product(schedules, seq_pars, request.zero):
                if (zero >= 2 and pp > 1) or (zbh1 and seq_par):
                    continue
                dp_world = world // (tp * pp)
                sps = [s for s in _divisors_pow2(dp_world) if heads % (tp * s) == 0 and kv % (tp * s) == 0
                       and not (s > 1 and (seq_par or m.seq_length % s))] if pp == 1 and "ulysses" not in off else [1]
                for sp in sps:
                    for ep in _divisors_pow2(min(experts, dp_world // sp) if "expert-parallel" not in off else 1):
                        if experts % ep == 0 and (dp_world // sp) % ep == 0:
                            yield Knobs(tp, pp, v, seq_par, sp, zero, zbh1=zbh1, ep=ep, mlm_moe=mlm,
                                        partition=partition)
                # context parallelism: a power of two of the DP ranks whose 2 x CP chunks split the sequence (the
                # resolution refuses it with Ulysses, DeepSpeed-MoE and what else it does not run; Megatron-LM's MoE
                # runs at EP 1 here)
                cps = [] if "context-parallel" in off else [
                    c for c in _divisors_pow2(dp_world)[1:] if m.seq_length % (2 * c) == 0]
                for cp in cps:
                    yield Knobs(tp, pp, v, seq_par, 1, zero, zbh1=zbh1, mlm_moe=mlm, partition=partition, cp=cp)


def resolve_knobs(request: Request, knobs: Knobs) -> Layout:
    """The layout ``--dry-run`` would resolve with ``knobs``' flags (ConfigError where it refuses them)."""
    run = resolve(knobs.apply(request.flags), world_size=request.cluster.world_size, vocab_size=request.vocab_size,
                  ds_template=template_of(request, knobs)[1], family=request.family,
                  gpu_memory=request.cluster.gpu.memory_gb * GB)
    return run.layout


def template_of(request: Request, knobs: Knobs) -> tuple[str | None, dict | None]:
    """(the JSON's path when the plan chose it, the JSON) a layout resolves with."""
    if request.stage_templates and knobs.zero in request.stage_templates:
        return request.stage_templates[knobs.zero]
    return None, request.template


def flags_of(request: Request, knobs: Knobs) -> list[str]:
    """The flags that give ``knobs`` on the request's command line (the JSON too, where the plan chose it)."""
    path = template_of(request, knobs)[0]
    return knobs.flags() + (["--deepspeed_config", path] if path else [])


def variant(request: Request, base: Layout, knobs: Knobs) -> Layout:
    """``base`` (resolved at another micro batch / recompute) with ``knobs``' micro batch and recompute:
    what ``resolve`` gives for them, without resolving again (tests/planner/test_planner.py checks it
    against ``--dry-run``)."""
    dp = base.dp
    if base.global_batch_size % (knobs.mb * dp):
        raise ConfigError("global batch not divisible")
    gas = base.global_batch_size // (knobs.mb * dp)
    check_schedule(base.pp, gas, base.virtual_pp)
    ds = dict(base.ds_config)
    ds.update({k: v for k, v in (("train_micro_batch_size_per_gpu", knobs.mb), ("gradient_accumulation_steps", gas))
               if k in ds})
    layout = dataclasses.replace(base, micro_batch_size=knobs.mb, grad_accum_steps=gas, recompute=knobs.recompute,
                                 ds_config=ds, model=dataclasses.replace(
                                     base.model, liger_kernel=request.flags.model.liger_kernel))
    fused, _ = choose_fused_loss(layout, request.cluster.gpu.memory_gb * GB)
    return dataclasses.replace(layout, model=dataclasses.replace(layout.model, liger_kernel=fused))


def candidates(request: Request) -> list[Candidate]:
    """Every layout the resolution accepts, with its predicted step time (memory not yet estimated)."""
    out, flops = [], {}
    for structure in structures(request):
        base = None
        for mb in request.micro_batches:
            for recompute in request.recompute:
                knobs = dataclasses.replace(structure, mb=mb, recompute=recompute)
                try:
                    if base is None:
                        base = resolve_knobs(request, knobs)
                        layout = base
                    else:
                        layout = variant(request, base, knobs)
                except ConfigError:
                    continue
                if recompute not in flops:  # the step's model FLOPs: the same for every layout but recompute's
                    family = request.family
                    flops[recompute] = family.flops(layout, layout.model.seq_length)
                out.append(Candidate(knobs, layout, step_time(layout, request.cluster, flash=request.flash,
                                                              flops=flops[recompute])))
    return out


def plan(request: Request) -> Plan:
    """The (TP, PP) pairs whose fastest variant fits, fastest first (module docstring). A structure
    whose smallest variant (micro batch and recompute at their least memory) does not fit has no
    variant that does: more micro batch or less recompute only add activations."""
    start = time.perf_counter()
    if request.flags.training.bf16 and not request.cluster.gpu.bf16:
        raise ConfigError(f"{request.cluster.gpu.name} has no bf16 tensor cores: plan with --fp16")
    # (held to the measured-efficiency bound, equal steps are ordered by what their terms alone predict)
    found = sorted(candidates(request), key=lambda c: (c.time.step_s, c.time.step_s - c.time.bound_s))
    budget = request.cluster.gpu.memory_gb * GB
    order = {r: i for i, r in enumerate(("full", "selective", None))}
    smallest: dict[Knobs, Candidate] = {}
    for cand in found:
        key = _structure(cand.knobs)
        if key not in smallest or _least(cand, order) < _least(smallest[key], order):
            smallest[key] = cand
    structure_fits: dict[Knobs, bool] = {}
    ranked, taken, checked = [], set(), 0
    for cand in found:
        pair = (cand.knobs.tp, cand.knobs.pp)
        key = _structure(cand.knobs)
        if pair in taken:
            continue
        if key not in structure_fits:
            checked += 1
            structure_fits[key] = estimate_memory(smallest[key].layout).total <= budget
        if not structure_fits[key]:
            continue
        checked += 1
        est = estimate_memory(cand.layout)
        if est.total <= budget:
            taken.add(pair)
            ranked.append(dataclasses.replace(cand, memory=est))
    return Plan(tuple(ranked), len(found), checked, time.perf_counter() - start)


def _structure(knobs: Knobs) -> Knobs:
    return dataclasses.replace(knobs, mb=0, recompute=None)


def _least(cand: Candidate, order: dict) -> tuple[int, int]:
    return cand.knobs.mb, order[cand.knobs.recompute]


def evaluate(request: Request, knobs: Knobs) -> Candidate:
    """One given layout, as the plan would see it (ConfigError where ``--dry-run`` would refuse it); its expert
    parallel size goes to the flag of the line's MoE layer."""
    knobs = dataclasses.replace(knobs, mlm_moe=uses_mlm_moe(request.flags))
    layout = resolve_knobs(request, knobs)
    return Candidate(knobs, layout, step_time(layout, request.cluster, flash=request.flash), estimate_memory(layout))


def knobs_of(flags: Config, layout: Layout) -> Knobs:
    """The choices a command line made (its resolved layout)."""
    return Knobs(layout.tp, layout.pp, max(1, layout.virtual_pp), layout.sequence_parallel, layout.sp,
                 layout.zero_stage, layout.micro_batch_size, layout.recompute, ep=layout.ep,
                 mlm_moe=moe_selection.is_mlm_moe(layout.model), cp=layout.cp)


def uses_mlm_moe(flags: Config) -> bool:
    """Whether the command line builds Megatron-LM's MoE layer (its EP flag is --expert-model-parallel-size)
    rather than DeepSpeed-MoE (--moe-expert-parallel-size), as ``--dry-run`` decides (config/moe_selection.py)."""
    if max(flags.model.num_experts or (1,)) <= 1:
        return False
    return moe_selection.select(flags.model, flags.parallel, **moe_selection.line_context(flags)
                                )[0] == moe_selection.MEGATRON_LM_MOE


def table(ranked, *, top: int, train_tokens: float | None, tokens_per_step: int, gpu) -> list[str]:
    """The top layouts, one line each (the columns docs/planner.md explains): ``#`` is the tie group (``tie_groups``,
    ``=`` where it holds more than one layout), ``err`` the expected error (``?``: unknown on this GPU)."""
    head = (f"{'#':>3} {'TP':>3} {'PP':>3} {'v':>2} {'DP':>5} {'SP':>3} {'CP':>3} {'ZeRO':>4} {'mb':>3} {'recompute':>9} "
            f"{'GB/GPU':>7} {'TFLOP/s':>8} {'MFU':>6} {'err':>4} {'step s':>8} {'bubble':>7} {'comm':>6}"
            + (f" {'days':>7}" if train_tokens else ""))
    lines = [head]
    groups = tie_groups(ranked)
    for g, c in zip(groups, ranked[:top]):
        k, t, lay = c.knobs, c.time, c.layout
        sp = "Uly" + str(k.sp) if k.sp > 1 else ("yes" if k.seq_par else "-")
        tied = f"{g}{'=' if groups.count(g) > 1 else ''}"
        err = expected_error(lay, gpu)
        line = (f"{tied:>3} {k.tp:>3} {k.pp:>3} {'zb' if k.zbh1 else k.v:>2} {lay.dp:>5} {sp:>3} {k.cp:>3} {k.zero:>4} {k.mb:>3} "
                f"{k.recompute or 'none':>9} {c.memory.total / GB:>7.1f} {t.tflops_per_gpu:>8.1f} {100 * t.mfu:>5.1f}% "
                f"{'?' if err is None else f'{100 * err:.0f}%':>4} "
                f"{t.step_s:>8.3f} {100 * t.bubble_s / t.step_s:>6.1f}% {100 * t.comm_share:>5.1f}%")
        if train_tokens:
            line += f" {train_tokens / tokens_per_step * t.step_s / 86400:>7.1f}"
        lines.append(line)
    return lines


TERMS = (("compute (matmuls, attention, memory-bound work)", "compute_s"), ("recompute", "recompute_s"),
         ("TP, Ulysses, context and expert parallel communication", "tp_comm_s"),
         ("pipeline messages", "pp_comm_s"), ("pipeline bubble", "bubble_s"),
         ("data parallel reduction and ZeRO traffic", "dp_comm_s"), ("optimizer step", "optimizer_s"),
         ("up to the most a published run of this GPU reached", "bound_s"))


def explain(a: Candidate, b: Candidate) -> str:
    """Which of two layouts the model predicts faster, by how much, and the terms that make the difference."""
    fast, slow = (a, b) if a.time.step_s <= b.time.step_s else (b, a)
    diffs = sorted(((getattr(slow.time, attr) - getattr(fast.time, attr), name) for name, attr in TERMS),
                   reverse=True)
    why = "; ".join(f"{name} {'+' if d > 0 else '-'}{abs(d):.3f} s" for d, name in diffs
                    if abs(d) >= 0.005 * slow.time.step_s)
    return (f"{fast.knobs.describe()} is predicted {100 * (slow.time.step_s / fast.time.step_s - 1):.1f}% faster "
            f"than {slow.knobs.describe()} ({fast.time.step_s:.3f} s against {slow.time.step_s:.3f} s per step); "
            f"the slower one spends, per step: {why or 'about the same in every term'}")
