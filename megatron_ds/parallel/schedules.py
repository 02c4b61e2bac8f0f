"""Pipeline schedules as data: the ordered (forward/backward, model chunk, micro-batch) steps of
one pipeline rank for one optimizer step, separate from the code that executes them.

Two schedules, both Megatron-LM's (Narayanan et al., SC21):

* **1F1B** (``virtual_size == 1``): ``pp - rank - 1`` warm-up forwards, then alternate one forward
  and one backward, then the remaining backwards. Bubble ``(p - 1) / m`` of the ideal step time.
* **Interleaved 1F1B** (``virtual_size = v > 1``): every rank holds ``v`` model chunks, chunk ``c``
  of rank ``r`` being virtual stage ``c * pp + r`` (layers ``[(c*pp + r) * L, (c*pp + r + 1) * L)``
  for ``L`` layers per virtual stage), so a micro-batch visits every rank ``v`` times. Bubble
  ``(p - 1) / (v m)``, for ``v`` times more point-to-point messages.

The interleaved ordering is a transcription of ``forward_backward_pipelining_with_interleaving``
in Megatron-DeepSpeed's ``megatron/core/pipeline_parallel/schedules.py`` (the copy of Megatron-LM's
it ships; the same loop is in NVIDIA/Megatron-LM with ``microbatch_group_size_per_vp_stage`` = pp,
its default):

* forward step ``k`` runs chunk ``(k mod (pp v)) // pp`` (``get_model_chunk_id(k, forward=True)``),
  backward step ``k`` the mirror chunk ``v - 1 - that``; each chunk takes its micro-batches in
  order (per-chunk data iterators / FIFO of saved inputs), i.e. micro-batch
  ``(k // (pp v)) * pp + k mod pp``;
* warm-up ``min((pp - rank - 1) * 2 + (v - 1) * pp, m v)`` forwards, or all ``m v`` forwards when
  ``m == pp`` (Megatron's ``all_warmup_microbatches``); then ``forward k + warmup, backward k``
  pairs; then the remaining backwards;
* it requires ``m % pp == 0`` ("number of microbatches is not divisible by
  pipeline-model-parallel-size when using interleaved schedule"), and Megatron-DeepSpeed's
  arguments require ``--num-layers`` divisible by ``--num-layers-per-virtual-pipeline-stage``, with
  ``v = num_layers / pp / num_layers_per_virtual_pipeline_stage``.

Megatron-DeepSpeed also asserts PP > 2 for interleaving; that is a limit of its paired
send/receive calls, which with two ranks send both directions between the same pair at once. The
executor here (``megatron_ds.pipeline.executor``) posts independent tagged messages, so PP = 2
interleaves too.

Which layers a chunk holds (``chunk_layer_range``) and DeepSpeed's own partition of the layers
without interleaving (``partition_stages``) live in ``megatron_ds.parallel.partition``.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ds.errors import ConfigError
from megatron_ds.parallel.partition import chunk_layer_range

FORWARD = "F"
BACKWARD = "B"  # the whole backward: input and weight gradients
INPUT_BACKWARD = "I"  # zero bubble: the input gradients only ("B" in the paper), weights deferred
WEIGHT = "W"  # zero bubble: the deferred weight gradients of one micro-batch


@dataclass(frozen=True)
class Step:
    kind: str  # FORWARD | BACKWARD | INPUT_BACKWARD | WEIGHT
    chunk: int  # model chunk index on this rank (0 .. v-1)
    microbatch: int  # 0 .. m-1

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


class ScheduleError(ConfigError):
    """The configuration cannot run the requested schedule; the message says why."""


def model_chunk_id(k: int, pp: int, v: int, *, forward: bool) -> int:
    """Megatron's ``get_model_chunk_id``: the chunk of this rank's ``k``-th forward (or backward)."""
    chunk = (k % (pp * v)) // pp
    return chunk if forward else v - 1 - chunk


def microbatch_id(k: int, pp: int, v: int) -> int:
    """The micro-batch of the ``k``-th forward (or backward): each chunk takes them in order,
    ``pp`` at a time per round of the ``pp * v`` step groups."""
    return (k // (pp * v)) * pp + k % pp


def num_warmup_steps(pp: int, rank: int, v: int, m: int) -> int:
    """Forwards run before the first backward on pipeline rank ``rank`` (training)."""
    if v == 1:
        return min(pp - rank - 1, m)  # forward_backward_pipelining_without_interleaving
    if m == pp:
        return m * v  # all_warmup_microbatches
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def pipeline_schedule(pp: int, rank: int, m: int, v: int = 1) -> list[Step]:
    """This rank's steps for one optimizer step of ``m`` micro-batches over ``v`` chunks per rank
    (``v == 1``: plain 1F1B). Every step of the list runs in order; see the module docstring."""
    check_schedule(pp, m, v)
    if not 0 <= rank < pp:
        raise ScheduleError(f"pipeline rank {rank} is outside 0..{pp - 1}")
    total = m * v
    warmup = num_warmup_steps(pp, rank, v, m)

    def fwd(k: int) -> Step:
        return Step(FORWARD, model_chunk_id(k, pp, v, forward=True), microbatch_id(k, pp, v))

    def bwd(k: int) -> Step:
        return Step(BACKWARD, model_chunk_id(k, pp, v, forward=False), microbatch_id(k, pp, v))

    steps = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [fwd(k + warmup), bwd(k)]
    steps += [bwd(k) for k in range(total - warmup, total)]
    return steps


def zbh1_schedule(pp: int, rank: int, m: int, *, exact: bool) -> list[Step]:
    """This rank's ZB-H1 steps (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) for one
    optimizer step of ``m`` micro-batches: 1F1B's order of forwards and (input) backwards, with
    weight passes moved into the cool-down, where 1F1B idles. A transcription of
    ``ZeroBubbleH1Pipeline.steps`` in Megatron-DeepSpeed's
    ``megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py``:

    * ``pp - rank - 1`` warm-up forwards (1F1B's);
    * ``rank`` forward + input-backward pairs whose weight passes wait (the first stage has none);
    * forward + backward pairs: the first stage runs whole backwards; the others run whole ones
      too by default, but input-backward + weight pass in the last pair and, with ``exact``
      (``--enable-zbh1-exact-semantics``), in every pair;
    * the cool-down: input-backward + weight pass (first stage: whole backwards);
    * the weight passes still waiting.

    A weight pass runs the oldest waiting micro-batch's (upstream's FIFO ``WeightGradStore.pop``):
    with ``exact`` the weights take their micro-batches' gradients in order 0..m-1, as 1F1B; by
    default the whole backwards of the middle go first (upstream's README: "4->5->6->7->1->2->3->8"
    on the last of 4 stages, m = 8). A rank never holds more than ``pp`` micro-batches whose
    weight pass is pending, 1F1B's peak (its first stage's)."""
    check_schedule(pp, m, 1)
    if not 0 <= rank < pp:
        raise ScheduleError(f"pipeline rank {rank} is outside 0..{pp - 1}")
    first = rank == 0
    steps: list[Step] = []
    waiting: deque = deque()  # micro-batches whose weight pass is pending, oldest first
    forward = backward = 0

    def input_backward_then_weight() -> None:
        steps.append(Step(INPUT_BACKWARD, 0, backward))
        waiting.append(backward)
        steps.append(Step(WEIGHT, 0, waiting.popleft()))

    for _ in range(min(pp - rank - 1, m)):
        steps.append(Step(FORWARD, 0, forward))
        forward += 1
    for _ in range(min(rank, m - forward)):
        steps += [Step(FORWARD, 0, forward), Step(INPUT_BACKWARD, 0, backward)]
        waiting.append(backward)
        forward, backward = forward + 1, backward + 1
    while forward < m:
        steps.append(Step(FORWARD, 0, forward))
        forward += 1
        if not first and (exact or forward == m):
            input_backward_then_weight()
        else:
            steps.append(Step(BACKWARD, 0, backward))
        backward += 1
    while backward < m:
        if first:
            steps.append(Step(BACKWARD, 0, backward))
        else:
            input_backward_then_weight()
        backward += 1
    steps += [Step(WEIGHT, 0, j) for j in waiting]
    return steps


def simulate_step_time(schedules: Sequence[Sequence[Step]], *, f: float, b: float, w: float) -> float:
    """The time one optimizer step of a non-interleaved pipeline takes when a forward costs ``f``, an
    input backward ``b``, a weight pass ``w`` (a whole backward ``b + w``), messages nothing and every
    rank runs its list (``schedules[rank]``) in order, a step starting once its rank is free and its
    input exists: the previous rank's forward of the micro-batch, the next rank's (input) backward."""
    pp = len(schedules)
    cost = {FORWARD: f, BACKWARD: b + w, INPUT_BACKWARD: b, WEIGHT: w}
    done: dict = {}  # (rank, "F" | "B", micro-batch) -> finish time; B: the input gradient exists
    position, clock = [0] * pp, [0.0] * pp
    while any(position[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(schedules[r]):
                step = schedules[r][position[r]]
                grad = step.kind in (BACKWARD, INPUT_BACKWARD)
                needs = ((r - 1, FORWARD) if step.kind == FORWARD and r > 0 else
                         (r + 1, BACKWARD) if grad and r < pp - 1 else None)
                if needs is not None and (needs[0], needs[1], step.microbatch) not in done:
                    break
                ready = done[(needs[0], needs[1], step.microbatch)] if needs is not None else 0.0
                clock[r] = max(clock[r], ready) + cost[step.kind]
                if step.kind != WEIGHT:
                    done[(r, BACKWARD if grad else FORWARD, step.microbatch)] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("the pipeline schedules deadlock")
    return max(clock)


def describe_zbh1(pp: int, m: int, *, exact: bool) -> list[str]:
    """Lines for --dry-run: the ZB-H1 schedule and its bubble against 1F1B's, timed as the paper does
    (input backward = weight pass = forward), from the schedules themselves."""
    ranks = [zbh1_schedule(pp, r, m, exact=exact) for r in range(pp)]
    ones = [pipeline_schedule(pp, r, m) for r in range(pp)]
    zb, plain = (simulate_step_time(s, f=1, b=1, w=1) / (3 * m) - 1 for s in (ranks, ones))
    how = ("exact semantics: every steady-state backward split, gradients summed in 1F1B's order" if exact else
           "backwards split only where needed (the accumulation order of weight gradients changes)")
    return [f"ZB-H1: weight passes fill 1F1B's cool-down ({how})",
            f"predicted bubble with F = B = W: {zb:.1%} of compute (1F1B: {plain:.1%}); at most {pp} micro-batches "
            f"in flight per rank, 1F1B's peak"]


def forward_only_schedule(m: int, v: int = 1, pp: int = 1) -> list[Step]:
    """Evaluation: Megatron runs every forward in the training order, no backward."""
    return [Step(FORWARD, model_chunk_id(k, pp, v, forward=True), microbatch_id(k, pp, v)) for k in range(m * v)]


def check_schedule(pp: int, m: int, v: int) -> None:
    if pp < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pipeline size {pp}, micro-batches {m} and chunks per rank {v} must be positive")
    if v > 1 and pp < 2:
        raise ScheduleError("the interleaved schedule needs --pipeline-model-parallel-size >= 2")
    if v > 1 and m % pp:
        # Megatron raises the same: each round of the schedule takes pp micro-batches per chunk.
        raise ScheduleError(f"the interleaved schedule needs the micro-batches per step ({m} = global batch / "
                            f"(micro batch x DP)) to be a multiple of --pipeline-model-parallel-size {pp}, as "
                            f"Megatron requires; change --global-batch-size")


def virtual_pipeline_size(num_layers: int, pp: int, layers_per_virtual_stage: int | None,
                          virtual_size: int | None) -> int:
    """``v`` from Megatron's two spellings, checked: ``--num-layers-per-virtual-pipeline-stage L``
    (Megatron-DeepSpeed: ``v = num_layers // pp // L``) or ``--virtual-pipeline-model-parallel-size v``
    (Megatron-LM). Neither given: 1 (no interleaving)."""
    if layers_per_virtual_stage is None and virtual_size is None:
        return 1
    if layers_per_virtual_stage is not None and layers_per_virtual_stage < 1:
        raise ScheduleError(f"--num-layers-per-virtual-pipeline-stage must be positive, got {layers_per_virtual_stage}")
    if virtual_size is not None and virtual_size < 1:
        raise ScheduleError(f"--virtual-pipeline-model-parallel-size must be positive, got {virtual_size}")
    if num_layers % pp:
        raise ScheduleError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    per_rank = num_layers // pp
    if layers_per_virtual_stage is not None:
        if per_rank % layers_per_virtual_stage:
            raise ScheduleError(
                f"cannot interleave: {num_layers} layers / PP {pp} = {per_rank} layers per pipeline rank, not "
                f"divisible by --num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}")
        v = per_rank // layers_per_virtual_stage
        if virtual_size is not None and virtual_size != v:
            raise ScheduleError(
                f"--virtual-pipeline-model-parallel-size {virtual_size} contradicts "
                f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} ({num_layers} layers / PP {pp} "
                f"/ {layers_per_virtual_stage} = {v} chunks per rank); give one of them")
    else:
        v = virtual_size
        if per_rank % v:
            raise ScheduleError(f"cannot interleave: {per_rank} layers per pipeline rank ({num_layers} / PP {pp}) "
                                f"do not split into --virtual-pipeline-model-parallel-size {v} chunks")
    if v > 1 and pp < 2:
        raise ScheduleError("interleaving (virtual pipeline stages) needs --pipeline-model-parallel-size >= 2")
    return v


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """Idle time relative to the ideal compute time: ``(p - 1) / (v m)`` (1F1B: ``v = 1``)."""
    return (pp - 1) / (v * m)


def ideal_efficiency(pp: int, m: int, v: int = 1) -> float:
    """Fraction of the step time spent computing: ``m / (m + (p - 1) / v)``."""
    return m / (m + (pp - 1) / v)


def describe_assignment(num_layers: int, pp: int, v: int, m: int, counts=None) -> list[str]:
    """Lines for --dry-run: each rank's chunks and layers (``counts``: per virtual stage, where uneven), and
    the predicted bubble."""
    lines = [f"pipeline schedule: {'interleaved 1F1B' if v > 1 else '1F1B'}, PP {pp} x {v} chunk(s) per rank, "
             f"{m} micro-batches per step"]
    for rank in range(pp):
        parts = []
        for c in range(v):
            layers = chunk_layer_range(num_layers, pp, v, rank, c, counts)
            members = [] if not layers else [
                f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"]
            if rank == 0 and c == 0:
                members.insert(0, "embedding")
            if rank == pp - 1 and c == v - 1:
                members.append("final norm, output layer")
            parts.append(f"chunk {c}: " + ", ".join(members))
        lines.append(f"  rank {rank}: " + "; ".join(parts))
    lines.append(f"predicted bubble: (p-1)/(v m) = {pp - 1}/({v} x {m}) = {bubble_fraction(pp, m, v):.1%} of compute"
                 f" (1F1B: (p-1)/m = {bubble_fraction(pp, m):.1%}); ideal efficiency "
                 f"{ideal_efficiency(pp, m, v):.1%}")
    return lines
