"""bench/moe.py's layer comparison, at its smallest: every row runs on 2 gloo processes, and the bytes it counts
are what the dispatch must move, worked out here from the shape.

DeepSpeed-MoE with capacity factor 1 sends, per layer and direction, an [experts, capacity, hidden] tensor of
which the half for the other rank crosses (EP 2); capacity = tokens x k / experts, so per token it sends
k x hidden x 4 bytes / 2 in each of its four all-to-alls (dispatch and combine, forward and backward):
8 x k x hidden bytes. Megatron-LM's all-to-all sends each route whose expert lives on the other rank once per
all-to-all (tokens and probabilities forward, their gradients backward): about half the k routes, so close to
the same figure for random tokens."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_layer_rows_run_and_count_the_dispatch_bytes(bench, capsys):
    moe = bench("moe")
    assert moe.main(["--iters", "2", "--warmup", "1", "--tokens", "512"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in {label for label, _ in moe.DS_ROWS + moe.MLM_ROWS}:
            rows[cells[0]] = float(cells[3])
    assert len(rows) == 4
    k, hidden = moe.LAYER["topk"], moe.LAYER["hidden"]
    assert rows["DeepSpeed-MoE, capacity factor 1"] == 8 * k * hidden
    alltoall = rows["Megatron-LM, alltoall dispatch"]
    assert 0.6 * 8 * k * hidden < alltoall < 1.4 * 8 * k * hidden
