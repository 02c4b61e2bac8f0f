"""Process groups from DeepSpeed's topology: membership checked against the layout rule
(TP ranks adjacent, then DP, then PP) computed by hand, and each group really communicates."""
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _groups(rank, world, tp, pp):
    from megatron_ds.parallel.groups import ParallelState

    ps = ParallelState(tp, pp)
    sums = {}
    for name, group in (("tp", ps.tp_group), ("dp", ps.dp_group), ("pp", ps.pp_group), ("mp", ps.tp_pp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    return dict(tp=(ps.tp_rank, ps.tp_ranks), dp=(ps.dp_rank, ps.dp_ranks), pp=(ps.pp_rank, ps.pp_ranks),
                mp=ps.tp_pp_ranks, sums=sums, first=ps.is_first_stage, last=ps.is_last_stage,
                mpu=(ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                     ps.get_pipe_parallel_world_size(), ps.get_model_parallel_world_size()))


def test_layout_tp2_pp2_dp2():
    tp, pp, dp = 2, 2, 2
    results = run_distributed(_groups, 8, tp, pp, timeout=180)
    for rank, r in enumerate(results):
        # rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        tp_ranks = [pp_rank * dp * tp + dp_rank * tp + i for i in range(tp)]
        dp_ranks = [pp_rank * dp * tp + i * tp + tp_rank for i in range(dp)]
        pp_ranks = [i * dp * tp + dp_rank * tp + tp_rank for i in range(pp)]
        mp_ranks = sorted(i * dp * tp + dp_rank * tp + j for i in range(pp) for j in range(tp))
        assert r["tp"] == (tp_rank, tp_ranks)
        assert r["dp"] == (dp_rank, dp_ranks)
        assert r["pp"] == (pp_rank, pp_ranks)
        assert r["mp"] == mp_ranks
        assert r["sums"] == {"tp": sum(tp_ranks), "dp": sum(dp_ranks), "pp": sum(pp_ranks), "mp": sum(mp_ranks)}
        assert r["first"] == (pp_rank == 0) and r["last"] == (pp_rank == pp - 1)
        assert r["mpu"] == (tp, dp, pp, tp * pp)
