"""--log-straggler and the other Megatron-LM logging flags in real runs of pretrain_gpt.py: the straggler
report names a rank slowed on purpose; --log-throughput's field; --log-progress's progress.txt across a
resume; --manual-gc's collections; --logging-level silencing the report. Also the report's lines and
its controller (--straggler-ctrlr-port, --disable-straggler-on-startup) on their own."""
import re
import socket
import time
from datetime import datetime

from megatron_ds.launch.scheduler import current_job
from megatron_ds.training.straggler import RankTime, report_lines
from tests.distributed import run_distributed
from tests.training.cli import SMALL_GPT, cli_many


def test_report_lines_rank_the_ranks():
    times = [RankTime(0, 10.0, 3.0), RankTime(1, 30.0, 1.0), RankTime(2, 12.0, 2.5), RankTime(3, 9.0, 3.3)]
    lines = report_lines(times, 2, datetime(2026, 11, 28, 16, 20, 1))
    assert lines == [
        "[2026-11-28 16:20:01] | MnRtt/Rnk: 9.00ms/3 | MxRtt/Rnk: 30.00ms/1 | MnEtpt/Rnk: 1.00TF/1 | "
        "MxEtpt/Rnk: 3.30TF/3",
        "^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 1.00/1, 2.50/2,",
        "^^^^ Top    2 Ranks with highest Etpt(TF): 3.00/0, 3.30/3,"]
    # upstream lists ranks only for 1 < count < world size
    assert len(report_lines(times, 1, datetime.now())) == 1 and len(report_lines(times, 4, datetime.now())) == 1


def _controller(rank, world):
    """One rank: a report started off, switched on through the controller's port, then reporting."""
    import logging

    import torch

    from megatron_ds.training.straggler import StragglerDetector

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megatron_ds.training.straggler").addHandler(handler)
    logging.getLogger("megatron_ds.training.straggler").setLevel(logging.INFO)
    module = torch.nn.Linear(4, 4)
    det = StragglerDetector(module, torch.device("cpu"), minmax_count=1, enabled=False, port=0)
    module(torch.ones(1, 4))
    off_report = det.report(1e9, 1)
    with socket.create_connection(("127.0.0.1", det.port), timeout=30) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        answer = conn.recv(1024).decode()
    det.report(1e9, 1)  # applies the switch
    module(torch.ones(1, 4))
    module.eval()
    module(torch.ones(1, 4))  # evaluation is not timed
    on_report = det.report(1e9, 1)
    det.close()
    return off_report, answer, on_report, det.enabled, records


def test_controller_switches_the_report_on():
    off_report, answer, on_report, enabled, records = run_distributed(_controller, 1, timeout=300)[0]
    assert not off_report and on_report and enabled
    assert answer.startswith("HTTP/1.0 200 OK\r\n") and answer.endswith(
        "Will turn StragglerDetector ON at next logging interval")
    assert records[0].startswith("Controller ready to recv commands on port ")
    assert records[0].endswith("Current state OFF")
    assert "Toggling StragglerDetector State ON" in records
    assert re.fullmatch(r"\[[-0-9 :]+\] \| MnRtt/Rnk: [0-9.]+ms/0 \| MxRtt/Rnk: [0-9.]+ms/0 \| "
                        r"MnEtpt/Rnk: [0-9.]+TF/0 \| MxEtpt/Rnk: [0-9.]+TF/0", records[-1]), records


SLOW_RANK, SLEEP_S = 1, 0.2  # far above a forward pass of SMALL_GPT (~1-5 ms), even on a busy machine


def _runs_with_a_slow_rank(rank, world, argvs):
    """pretrain_gpt.py's main for each argv, rank SLOW_RANK's embedding sleeping in every training forward;
    manual_gc.py's collections counted."""
    import gc

    from megatron_ds.model import language_model
    from megatron_ds.training import manual_gc

    collections = []

    class CountingGC:
        def __getattr__(self, name):
            return getattr(gc, name)

        def collect(self, generation=2):
            collections.append(generation)
            return gc.collect(generation)

    manual_gc.gc = CountingGC()
    if rank == SLOW_RANK:
        forward = language_model.LanguageModelEmbedding.forward

        def slow(self, *args, **kwargs):
            if self.training:
                time.sleep(SLEEP_S)
            return forward(self, *args, **kwargs)

        language_model.LanguageModelEmbedding.forward = slow
    return cli_many(rank, world, argvs), collections, gc.isenabled()


# Megatron's closed form for GPT-2 shapes (docs/flops.md) for SMALL_GPT at DP 2: global batch 4 (micro 2 x DP 2),
# s 16, 2 layers, h 32, vocabulary 128 (already a multiple of --make-vocab-size-divisible-by 4)
B, S, L, H, V = 4, 16, 2, 32, 128
FLOPS = 72 * B * S * L * H ** 2 * (1 + S / (6 * H) + V / (12 * L * H))
STRAGGLER = re.compile(r"^INFO:megatron_ds\.training\.straggler:\[[-0-9 :]+\] \| MnRtt/Rnk: ([0-9.]+)ms/(\d) \| "
                       r"MxRtt/Rnk: ([0-9.]+)ms/(\d) \| MnEtpt/Rnk: [0-9.]+TF/(\d) \| MxEtpt/Rnk: [0-9.]+TF/(\d)$", re.M)


def test_megatron_lm_logging_flags_in_a_run_and_its_resume(tmp_path):
    save = str(tmp_path / "ckpt")
    common = SMALL_GPT + ["--lr-decay-iters", "6", "--save", save, "--save-interval", "2", "--log-throughput",
                          "--log-progress", "--log-straggler", "--straggler-ctrlr-port", "0", "--manual-gc",
                          "--manual-gc-interval", "2"]
    first = common + ["--train-iters", "4", "--eval-interval", "3", "--eval-iters", "1"]
    resumed = common + ["--train-iters", "6", "--load", save, "--logging-level", "30"]
    # one launch per run, as a job and its follow-on job (a second process group in the same test processes
    # failed to connect its gloo pairs)
    ranks = [run_distributed(_runs_with_a_slow_rank, 2, [argv], timeout=600) for argv in (first, resumed)]
    for launch in ranks:
        for [(rc, _, err)], _, _ in launch:
            assert rc == 0, err[-3000:]
    out0_first, out0_resumed = ranks[0][0][0][0][1], ranks[1][0][0][0][1]
    out_last_first = ranks[0][1][0][0][1]

    # --log-straggler: rank 0 logs every --log-interval (1) iteration; the slow rank is named
    reports = STRAGGLER.findall(out0_first)
    assert len(reports) == 4, out0_first[-3000:]
    for min_ms, min_rank, max_ms, max_rank, min_tf_rank, max_tf_rank in reports:
        assert (int(max_rank), int(min_rank)) == (SLOW_RANK, 1 - SLOW_RANK)
        assert float(max_ms) >= SLEEP_S * 1000 > float(min_ms)  # at least the sleep, once per iteration
        assert (int(min_tf_rank), int(max_tf_rank)) == (SLOW_RANK, 1 - SLOW_RANK)  # slowest: lowest TFLOP/s
    # --logging-level 30: the INFO report (and the controller's line) silenced
    assert "INFO:megatron_ds" not in out0_resumed, out0_resumed[-3000:]
    assert "saved checkpoint at iteration 6" in out0_resumed  # rank 0's own lines are prints, as upstream's

    # --log-throughput: upstream's field after the time per iteration, the model TFLOP/s per GPU
    lines = re.findall(r"^ iteration .*$", out_last_first, re.M)
    assert len(lines) == 4
    for line in lines:
        m = re.search(r"\| elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
                      r"([0-9.]+) \| learning rate: ", line)
        assert m, line
        assert m.group(2) == f"{FLOPS / (float(m.group(1)) / 1000) / 2 / 1e12:.1f}"

    # --log-progress: Megatron-LM's progress.txt, FLOPs carried through the checkpoint into the resumed job
    job = current_job()[1] or ""
    rows = [row.split("\t") for row in (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()]
    assert [r[1:4] for r in rows] == [[f"Job ID: {job}", "# GPUs: 2", event] for event in
                                      ("Starting job", "Saved checkpoint", "Saved checkpoint", "Starting job",
                                       "Saved checkpoint")]
    saves = [r for r in rows if r[3] == "Saved checkpoint"]
    for row, it in zip(saves, (2, 4, 6)):
        datetime.strptime(row[0], "%Y-%m-%d %H:%M:%S")
        assert row[4] == f"Iteration: {it}"
        assert re.fullmatch(r"Job throughput: [0-9.]+ TFLOP/s/GPU", row[5])
        assert re.fullmatch(r"Cumulative throughput: [0-9.]+ TFLOP/s/GPU", row[6])
        assert row[7:] == [f"Floating-point operations: {it * FLOPS:.2e}",
                           f"Tokens (in billions): {it * B * S / 1e9:.2f}"]

    # --manual-gc --manual-gc-interval 2, as megatron/training/training.py: a full collection before training,
    # every 2nd iteration, before the validation at iteration 3 and of generation 0 after it
    for launch, expected in zip(ranks, ([2, 2, 2, 0, 2], [2, 2])):  # resumed: before training, at iteration 6
        for _, collections, enabled in launch:
            assert collections == expected
            assert enabled  # the collector on again once training is over
