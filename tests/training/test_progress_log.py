"""--log-progress's progress.txt: Megatron-LM's lines, and where its cumulative throughput starts."""
import time
from datetime import datetime, timedelta

from megatron_ds.training.progress_log import ProgressLog, progress_line, saved_text, start_of_world


def _line(when: str, gpus: int, event: str) -> str:
    return f"{when}\tJob ID: 1\t# GPUs: {gpus}\t{event}\n"


def test_start_of_the_latest_series_at_this_world_size():
    saved = lambda flops: saved_text(10, 1.0, 1.0, flops, 0)  # noqa: E731
    lines = [
        _line("2026-01-01 00:00:00", 8, "Starting job"),
        _line("2026-01-01 01:00:00", 8, saved(1e18)),
        _line("2026-01-01 02:00:00", 16, "Starting job"),  # another size: the series starts again
        _line("2026-01-01 03:00:00", 16, saved(3e18)),
        _line("2026-01-01 04:00:00", 16, "Starting job"),  # the same size: the series goes on
        _line("2026-01-01 05:00:00", 16, "Saving async checkpoint\t" + saved(5e18).split("\t", 1)[1]),
        _line("2026-01-01 06:00:00", 16, "Saved async checkpoint\tIteration: 10"),  # commits 5e18
        _line("2026-01-01 06:30:00", 16, "Deleted checkpoint\tIteration: 5"),
    ]
    assert start_of_world(lines, 16) == (datetime(2026, 1, 1, 2), 1e18)
    assert start_of_world(lines, 8) is None  # its series ended when the 16-GPU jobs came
    lines.append(_line("2026-01-01 07:00:00", 8, "Starting job"))
    assert start_of_world(lines, 8) == (datetime(2026, 1, 1, 7), 5e18)  # from the committed async save


def test_line_prefix_names_the_batch_job():
    now = datetime(2026, 11, 28, 16, 20, 1)
    assert progress_line("Starting job", 16, now, environ={"PBS_JOBID": "123.pbs1"}) == \
        "2026-11-28 16:20:01\tJob ID: 123.pbs1\t# GPUs: 16\tStarting job\n"
    assert progress_line("x", 2, now, environ={"SLURM_JOB_ID": "77"}).startswith("2026-11-28 16:20:01\tJob ID: 77\t")
    assert progress_line("x", 2, now, environ={}) == "2026-11-28 16:20:01\tJob ID: \t# GPUs: 2\tx\n"


def test_job_and_cumulative_throughput(tmp_path):
    # an earlier job of this size started 200 s ago, after a checkpoint that had done 1e15 FLOPs
    earlier = (datetime.now() - timedelta(seconds=200)).strftime("%Y-%m-%d %H:%M:%S")
    (tmp_path / "progress.txt").write_text(_line("2026-01-01 00:00:00", 2, saved_text(5, 1.0, 1.0, 1e15, 0))
                                           + _line(earlier, 2, "Starting job"))
    progress = ProgressLog(str(tmp_path), world_size=2, job_start_time=time.time() - 100)
    progress.start_job()
    progress.job_start_flops = 1e15  # this job resumed from that checkpoint
    progress.saved(20, 1e15 + 4e13, 2 * 10 ** 9)
    last = (tmp_path / "progress.txt").read_text().splitlines()[-1].split("\t")
    assert last[2:] == ["# GPUs: 2", "Saved checkpoint", "Iteration: 20",
                        "Job throughput: 0.2 TFLOP/s/GPU",  # 4e13 FLOPs / (100 s x 1e12 x 2 GPUs)
                        "Cumulative throughput: 0.1 TFLOP/s/GPU",  # 4e13 / (200 s x 1e12 x 2), since the earlier job
                        "Floating-point operations: 1.04e+15", "Tokens (in billions): 2.00"]
