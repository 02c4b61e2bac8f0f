"""The ZB-H1 step lists checked against independent facts:

* ``_upstream_order``: Megatron-DeepSpeed's ``ZeroBubbleH1Pipeline.steps``
  (``megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py``) transcribed in its own terms --
  forward/backward/weight counters, ``continue`` past the last micro-batch, a FIFO of deferred
  weight passes standing in for ``WeightGradStore``'s queue;
* 1F1B: with the weight passes dropped and input backwards read as backwards, every rank's list is
  1F1B's (the split moves work, never reorders forwards and backwards);
* the accumulation order the upstream README gives for the default mode ("4->5->6->7->1->2->3->8"
  on device 4 of 4, m = 8) and, with exact semantics, 0..m-1 as 1F1B;
* peak activations in flight (forwarded, weight pass pending) equal 1F1B's peak, counted;
* the paper's bubble: an event simulation of all ranks gives 1F1B's (p - 1)(F + B + W) and ZB-H1's
  (p - 1)(F + B - W) of idle time (Qi et al., ICLR 2024, section 3), i.e. a third of 1F1B's when
  B = W = F.
"""
from collections import deque

import pytest

from megatron_ds.parallel.schedules import (BACKWARD, FORWARD, INPUT_BACKWARD, WEIGHT, Step, pipeline_schedule,
                                       simulate_step_time, zbh1_schedule)

CASES = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, pp - 1, pp, pp + 1, 2 * pp, 4 * pp) if m >= 1]


def _upstream_order(stages, stage_id, micro_batches, exact):
    first = stage_id == 0
    out, queue = [], deque()
    forward = backward = weight = 0
    warmup = stages - stage_id

    def backward_only(b):
        out.append(Step(INPUT_BACKWARD, 0, b))
        queue.append(b)

    def weight_pass():
        out.append(Step(WEIGHT, 0, queue.popleft()))

    for _ in range(warmup - 1):  # F section
        if forward == micro_batches:
            continue
        out.append(Step(FORWARD, 0, forward))
        forward += 1
    for _ in range(stage_id):  # FB section
        if forward == micro_batches:
            continue
        out.append(Step(FORWARD, 0, forward))
        backward_only(backward)
        forward += 1
        backward += 1
    while forward < micro_batches:  # FBW section
        out.append(Step(FORWARD, 0, forward))
        forward += 1
        if first:
            out.append(Step(BACKWARD, 0, backward))
        elif forward == micro_batches or exact:
            backward_only(backward)
            weight_pass()
        else:
            out.append(Step(BACKWARD, 0, backward))
        backward += 1
        weight += 1
    while backward < micro_batches:  # BW section
        if first:
            out.append(Step(BACKWARD, 0, backward))
        else:
            backward_only(backward)
            weight_pass()
        backward += 1
        weight += 1
    while weight < micro_batches:  # W section
        weight += 1
        weight_pass()
    return out


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
@pytest.mark.parametrize("pp,m", CASES)
def test_equals_upstream_and_1f1b(pp, m, exact):
    for rank in range(pp):
        steps = zbh1_schedule(pp, rank, m, exact=exact)
        assert steps == _upstream_order(pp, rank, m, exact)
        as_1f1b = [Step(BACKWARD if s.kind == INPUT_BACKWARD else s.kind, 0, s.microbatch)
                   for s in steps if s.kind != WEIGHT]
        assert as_1f1b == pipeline_schedule(pp, rank, m)
        # every micro-batch's weight gradients exactly once, after its input backward
        position = {s: i for i, s in enumerate(steps)}
        for j in range(m):
            if Step(BACKWARD, 0, j) not in position:
                assert position[Step(INPUT_BACKWARD, 0, j)] < position[Step(WEIGHT, 0, j)]
        if rank == 0:  # nobody waits for the first stage's input gradient: it never splits
            assert {s.kind for s in steps} == {FORWARD, BACKWARD}


def _weight_order(steps):
    return [s.microbatch for s in steps if s.kind in (BACKWARD, WEIGHT)]


def test_accumulation_order_of_upstream_readme():
    # device 4 of 4, m = 8, default mode: "4->5->6->7->1->2->3->8" (1-based micro-batches)
    assert [j + 1 for j in _weight_order(zbh1_schedule(4, 3, 8, exact=False))] == [4, 5, 6, 7, 1, 2, 3, 8]


@pytest.mark.parametrize("pp,m", CASES)
def test_exact_semantics_accumulate_in_1f1b_order(pp, m):
    for rank in range(pp):
        assert _weight_order(zbh1_schedule(pp, rank, m, exact=True)) == list(range(m))


def _activations_peak(steps):
    """Micro-batches whose activations are held: forwarded, weight gradients not yet taken."""
    live = peak = 0
    for s in steps:
        live += {FORWARD: 1, BACKWARD: -1, WEIGHT: -1, INPUT_BACKWARD: 0}[s.kind]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
@pytest.mark.parametrize("pp,m", CASES)
def test_peak_activations_equal_1f1b(pp, m, exact):
    zb = [_activations_peak(zbh1_schedule(pp, r, m, exact=exact)) for r in range(pp)]
    plain = [_activations_peak(pipeline_schedule(pp, r, m)) for r in range(pp)]
    # 1F1B holds pp - rank on rank r, its first stage the most; ZB-H1 keeps every rank at that peak
    assert plain == [min(pp - r, m) for r in range(pp)]
    assert max(zb) == max(plain) and all(z <= max(plain) for z in zb)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
@pytest.mark.parametrize("pp,m", [c for c in CASES if c[1] >= c[0]])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 3, 1), (1, 1, 2)])
def test_bubble_is_the_papers(pp, m, exact, f, b, w):
    compute = m * (f + b + w)
    plain = simulate_step_time([pipeline_schedule(pp, r, m) for r in range(pp)], f=f, b=b, w=w)
    assert plain == compute + (pp - 1) * (f + b + w)
    zb = simulate_step_time([zbh1_schedule(pp, r, m, exact=exact) for r in range(pp)], f=f, b=b, w=w)
    if w <= b:  # the paper's ZB-H1 assumption; a weight pass longer than B then delays the last W
        assert zb == compute + (pp - 1) * (f + b - w)
    assert zb <= plain


def test_a_third_of_1f1b_at_pp4_m8():
    ranks = [zbh1_schedule(4, r, 8, exact=True) for r in range(4)]
    zb = simulate_step_time(ranks, f=1, b=1, w=1) - 24
    plain = simulate_step_time([pipeline_schedule(4, r, 8) for r in range(4)], f=1, b=1, w=1) - 24
    assert (zb, plain) == (3, 9)
