"""Stand-in for pretrain_gpt.py in launcher tests: discover ranks, rendezvous, report.

Run under any launcher (plain python, torchrun, mpirun via the ABCI job scripts). Each process
prints one line `PROBE {json}` with what it discovered, the result of a gloo all-reduce of the
ranks (proves the processes really formed one world), and the argv it was given (proves the job
script passed the pretrain flags through). It ignores every other argument.

With PROBE_OUT_DIR set, each rank also writes its report to PROBE_OUT_DIR/rank<N>.json: Open MPI
forwards the ranks' stdout in chunks, so two long lines can interleave in the job's output.
"""
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, whatever the cwd

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ds.launch import apply_dist_env, discover_dist_env  # noqa: E402


def local_rank_from_argv(argv):
    """--local_rank/--local-rank N or =N, as the deepspeed launcher passes it."""
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    env = discover_dist_env(use_mpi="--use-mpi" in argv, local_rank_arg=local_rank_from_argv(argv))
    apply_dist_env(env)
    report = {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
              "local_world_size": env.local_world_size, "master_addr": env.master_addr,
              "master_port": env.master_port, "launcher": env.launcher, "rank_sum": None,
              "argv": argv}
    if "--dry-run" not in argv:  # like pretrain_gpt.py --dry-run: validate only, no rendezvous
        dist.init_process_group("gloo", init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=datetime.timedelta(seconds=60))
        try:
            total = torch.tensor([env.rank], dtype=torch.int64)
            dist.all_reduce(total)
            report["rank_sum"] = int(total.item())
        finally:
            dist.destroy_process_group()
    line = json.dumps(report)
    print("PROBE " + line, flush=True)
    if os.environ.get("PROBE_OUT_DIR"):
        Path(os.environ["PROBE_OUT_DIR"], f"rank{env.rank}.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
