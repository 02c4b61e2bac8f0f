"""The pipeline schedules checked against independent models of them.

* ``_megatron_order``: a transcription of Megatron's interleaved loop in its own terms -- per-chunk
  data iterators and FIFO lists of saved inputs, ``get_model_chunk_id`` -- rather than the closed
  form for the micro-batch index that ``pipeline_schedule`` uses.
* Properties any correct schedule has: every (chunk, micro-batch) forward and backward exactly
  once, a micro-batch's backward after its forward, each rank's list warm-up / strict F-B
  alternation / cool-down, and the peak number of micro-batches in flight (forwarded, not yet
  backwarded) equal to Megatron's ``num_warmup_microbatches + 1``.
* An event simulation of all ranks together: a step starts only once its input exists (the
  previous virtual stage's forward, or the next virtual stage's backward, finished on its
  rank), sends never block (the executor's isend), receives block. It proves every rank finishes
  (no deadlock) and gives the step time, which must equal the bubble the paper predicts.
"""
from collections import deque
from fractions import Fraction

import pytest

from megatron_ds.parallel.partition import chunk_layer_range
from megatron_ds.parallel.schedules import (BACKWARD, FORWARD, ScheduleError, Step, bubble_fraction,
                                            describe_assignment,
                                       pipeline_schedule, virtual_pipeline_size)

CASES = [(pp, v, m) for pp in (2, 3, 4) for v in (1, 2, 3) for m in (pp, 2 * pp, 4 * pp)] + [(4, 1, 3), (2, 4, 6)]


def _megatron_order(pp, rank, v, m):
    """Megatron's forward_backward_pipelining_with_interleaving, reduced to the order of its calls
    (v == 1: forward_backward_pipelining_without_interleaving)."""
    total = m * v
    if v == 1:
        warmup = min(pp - rank - 1, m)
    elif m == pp:
        warmup = total
    else:
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def get_model_chunk_id(microbatch_id, forward):
        in_group = microbatch_id % (pp * v)
        chunk = in_group // pp
        return chunk if forward else v - 1 - chunk

    data_iterators = [iter(range(m)) for _ in range(v)]  # one iterator per chunk, as Megatron's
    input_tensors = [deque() for _ in range(v)]
    order = []

    def forward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=True)
        mb = next(data_iterators[chunk])
        input_tensors[chunk].append(mb)
        order.append(Step(FORWARD, chunk, mb))

    def backward_step_helper(k):
        chunk = get_model_chunk_id(k, forward=False)
        order.append(Step(BACKWARD, chunk, input_tensors[chunk].popleft()))

    for k in range(warmup):
        forward_step_helper(k)
    for k in range(total - warmup):
        forward_step_helper(k + warmup)
        backward_step_helper(k)
    for k in range(total - warmup, total):
        backward_step_helper(k)
    return order


@pytest.mark.parametrize("pp,v,m", CASES)
def test_schedule_equals_megatrons_loop(pp, v, m):
    if v > 1 and m % pp:
        pytest.skip("Megatron refuses this combination")
    for rank in range(pp):
        assert pipeline_schedule(pp, rank, m, v) == _megatron_order(pp, rank, v, m)


def _in_flight_peak(steps):
    live = peak = 0
    for s in steps:
        live += 1 if s.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp,v,m", [c for c in CASES if c[1] == 1 or c[2] % c[0] == 0])
def test_each_rank_runs_a_valid_1f1b_order(pp, v, m):
    for rank in range(pp):
        steps = pipeline_schedule(pp, rank, m, v)
        expected = {Step(k, c, j) for k in (FORWARD, BACKWARD) for c in range(v) for j in range(m)}
        assert len(steps) == len(expected) and set(steps) == expected
        position = {s: i for i, s in enumerate(steps)}
        for c in range(v):
            for j in range(m):
                assert position[Step(FORWARD, c, j)] < position[Step(BACKWARD, c, j)]
        # each chunk handles its micro-batches in order (the executor keeps FIFO queues per chunk)
        for kind in (FORWARD, BACKWARD):
            for c in range(v):
                assert [s.microbatch for s in steps if s.kind == kind and s.chunk == c] == list(range(m))
        # warm-up forwards, then strict F,B alternation, then cool-down backwards
        kinds = "".join(s.kind for s in steps)
        warm = len(kinds) - len(kinds.lstrip(FORWARD))
        cool = len(kinds) - len(kinds.rstrip(BACKWARD))
        middle = kinds[warm:len(kinds) - cool]
        assert middle == "FB" * (len(middle) // 2) or middle == "BF" * (len(middle) // 2), kinds
        # peak in-flight micro-batch passes: Megatron's warm-up count + 1 (all of them when every
        # forward is warm-up); for 1F1B the familiar pp - rank
        total = m * v
        if v == 1:
            megatron_peak = min(pp - rank, m)
        elif m == pp:
            megatron_peak = total
        else:
            megatron_peak = min((pp - rank - 1) * 2 + (v - 1) * pp + 1, total)
        assert _in_flight_peak(steps) == megatron_peak


def _simulate(pp, v, m, t_fwd, t_bwd):
    """Run all ranks' step lists against each other; return the time the last rank finishes.

    Virtual stage s = chunk * pp + rank. F(s, j) needs F(s-1, j) done (s > 0); B(s, j) needs
    B(s+1, j) done (s < last) -- and its own forward, which the order on the rank guarantees.
    Messages cost nothing; a rank idles until the input of its next step exists."""
    lists = {r: deque(pipeline_schedule(pp, r, m, v)) for r in range(pp)}
    clock = {r: Fraction(0) for r in range(pp)}
    done = {}  # (kind, virtual stage, micro-batch) -> finish time
    last = pp * v - 1
    while any(lists.values()):
        progressed = False
        for r in range(pp):
            while lists[r]:
                s = lists[r][0]
                stage = s.chunk * pp + r
                if s.kind == FORWARD:
                    dep = (FORWARD, stage - 1, s.microbatch) if stage > 0 else None
                else:
                    dep = (BACKWARD, stage + 1, s.microbatch) if stage < last else None
                if dep is not None and dep not in done:
                    break  # blocked on a receive; other ranks may unblock it
                start = max(clock[r], done[dep]) if dep is not None else clock[r]
                clock[r] = start + (t_fwd if s.kind == FORWARD else t_bwd)
                done[(s.kind, stage, s.microbatch)] = clock[r]
                lists[r].popleft()
                progressed = True
        if not progressed:
            stuck = {r: lists[r][0] for r in range(pp) if lists[r]}
            raise AssertionError(f"deadlock: every unfinished rank waits for a message: {stuck}")
    return max(clock.values())


@pytest.mark.parametrize("pp,v,m", [c for c in CASES if c[1] == 1 or c[2] % c[0] == 0])
@pytest.mark.parametrize("t_fwd,t_bwd", [(1, 1), (1, 2)])
def test_event_simulation_finishes_with_the_predicted_bubble(pp, v, m, t_fwd, t_bwd):
    # A chunk holds 1/v of a rank's layers, so it takes 1/v of the time of a whole stage.
    makespan = _simulate(pp, v, m, Fraction(t_fwd, v), Fraction(t_bwd, v))
    ideal = m * (t_fwd + t_bwd)  # one rank's compute for the step
    if m == pp and v > 1:
        # Megatron runs all forwards first when m == pp; it is no better than its bubble formula
        assert makespan <= ideal * (1 + bubble_fraction(pp, m, 1))
    else:
        # the paper's bubble, exactly: (p - 1) (t_f + t_b) / v of idle time
        assert makespan == ideal + Fraction((pp - 1) * (t_fwd + t_bwd), v)


def test_chunk_assignment_is_megatrons():
    # 8 layers, PP 2, v 2: virtual stages of 2 layers; rank 0 holds layers 0-1 and 4-5
    assert [list(chunk_layer_range(8, 2, 2, 0, c)) for c in range(2)] == [[0, 1], [4, 5]]
    assert [list(chunk_layer_range(8, 2, 2, 1, c)) for c in range(2)] == [[2, 3], [6, 7]]
    # every layer exactly once over all ranks and chunks
    layers = sorted(i for r in range(4) for c in range(3) for i in chunk_layer_range(24, 4, 3, r, c))
    assert layers == list(range(24))


def test_virtual_size_from_either_flag():
    # Megatron-DeepSpeed: v = num_layers // pp // num_layers_per_virtual_pipeline_stage
    assert virtual_pipeline_size(16, 4, 2, None) == 2
    assert virtual_pipeline_size(16, 4, None, 2) == 2
    assert virtual_pipeline_size(16, 4, 4, None) == 1
    assert virtual_pipeline_size(16, 4, None, None) == 1
    with pytest.raises(ScheduleError, match="4 layers per pipeline rank, not divisible by "
                                            "--num-layers-per-virtual-pipeline-stage 3"):
        virtual_pipeline_size(16, 4, 3, None)
    with pytest.raises(ScheduleError, match="contradicts"):
        virtual_pipeline_size(16, 4, 2, 4)


def test_micro_batches_must_be_a_multiple_of_pp():
    with pytest.raises(ScheduleError, match="multiple of --pipeline-model-parallel-size 4"):
        pipeline_schedule(4, 0, 6, 2)
    assert len(pipeline_schedule(4, 0, 6, 1)) == 12  # plain 1F1B has no such rule


def test_dry_run_lines_name_layers_and_bubble():
    text = "\n".join(describe_assignment(8, 2, 2, 4))
    assert "rank 0: chunk 0: embedding, layers 0-1; chunk 1: layers 4-5" in text
    assert "rank 1: chunk 0: layers 2-3; chunk 1: layers 6-7, final norm, output layer" in text
    assert "(p-1)/(v m) = 1/(2 x 4) = 12.5%" in text and "(p-1)/m = 25.0%" in text
