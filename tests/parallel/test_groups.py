"""Process groups from DeepSpeed's topology: membership checked against the layout rule
(TP ranks adjacent, then DP, then PP) computed by hand, and each group really communicates."""
import pytest
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


def _ulysses_groups(rank, world, tp, sp):
    from megatron_ds.parallel.groups import ParallelState

    ps = ParallelState(tp, 1, sp=sp)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_sequence_parallel_group())
    return dict(sp=(ps.get_sequence_parallel_rank(), ps.sp_ranks), sp_sum=t.item(), tp=ps.tp_ranks, dp=ps.dp_ranks,
                sp_dp=(ps.get_sequence_data_parallel_rank(), ps.sp_dp_ranks), mp=ps.tp_pp_ranks,
                sizes=(ps.get_sequence_parallel_world_size(), ps.get_sequence_data_parallel_world_size(),
                       ps.get_data_parallel_world_size(), ps.get_model_parallel_world_size()))


def test_ulysses_layout_tp2_sp2():
    """TP ranks adjacent, then the sequence parallel ranks, then DP (here 1): rank = sp_rank * tp + tp_rank.
    The SP ranks hold the same weights: they form the sequence data parallel group, not the model parallel one."""
    tp, sp = 2, 2
    for rank, r in enumerate(run_distributed(_ulysses_groups, 4, tp, sp, timeout=180)):
        tp_rank, sp_rank = rank % tp, rank // tp
        sp_ranks = [i * tp + tp_rank for i in range(sp)]
        assert r["sp"] == (sp_rank, sp_ranks) and r["sp_sum"] == sum(sp_ranks)
        assert r["tp"] == [sp_rank * tp + i for i in range(tp)]
        assert r["dp"] == [rank]
        assert r["sp_dp"] == (sp_rank, sp_ranks)
        assert r["mp"] == r["tp"]
        assert r["sizes"] == (sp, sp, 1, tp)


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 2, 2, 1), (2, 2, 1, 2), (1, 4, 2, 2)])
def test_context_parallel_ranks_follow_megatron_lm_order(tp, cp, dp, pp):
    """Megatron-LM's rank order "tp-cp-ep-dp-pp" (megatron/core/parallel_state.py RankGenerator and
    generate_masked_orthogonal_rank_groups: rank = tp + cp x TP + dp x TP x CP + pp x TP x CP x DP): our topology
    (data axis DP x CP) places every rank there, and a CP group is the ranks differing only in cp."""
    from megatron_ds.parallel.groups import context_parallel_groups, make_topology

    topo = make_topology(tp, pp, dp * cp)
    for rank in range(tp * cp * dp * pp):
        c = topo.get_coord(rank)
        t, cp_rank, dp_rank, p = c.model, c.data % cp, c.data // cp, c.pipe
        assert rank == t + cp_rank * tp + dp_rank * tp * cp + p * tp * cp * dp
    expected = sorted([t + i * tp + d * tp * cp + p * tp * cp * dp for i in range(cp)]
                      for t in range(tp) for d in range(dp) for p in range(pp))
    assert sorted(context_parallel_groups(topo, cp)) == expected


def _megatron_lm_groups(sizes: dict, order: str, mask: str) -> list[list[int]]:
    """Transcription of Megatron-LM's RankGenerator.get_ranks(mask) (megatron/core/parallel_state.py, core_v0.19.0,
    generate_masked_orthogonal_rank_groups): the ranks varying along the masked axes of ``order`` (fastest first),
    one group per combination of the others."""
    axes = order.split("-")
    shape, masked = [sizes[a] for a in axes], [a in mask.split("-") for a in axes]
    stride = [1]
    for s in shape:
        stride.append(stride[-1] * s)
    inner = [(s, d) for s, d, m in zip(shape, stride, masked) if m]
    outer = [(s, d) for s, d, m in zip(shape, stride, masked) if not m]

    def ranks_of(index, dims):
        out = []
        for s, d in dims:
            out.append((index % s) * d)
            index //= s
        return sum(out)

    n_inner = 1
    for s, _ in inner:
        n_inner *= s
    world = stride[-1]
    return [[ranks_of(g, outer) + ranks_of(r, inner) for r in range(n_inner)] for g in range(world // n_inner)]


@pytest.mark.parametrize("tp, cp, dp, pp, etp, ep", [(4, 1, 1, 1, 2, 2), (4, 1, 2, 2, 2, 1), (2, 2, 2, 1, 1, 4),
                                                     (2, 1, 4, 2, 2, 2), (4, 1, 2, 1, 4, 2)])
def test_expert_grid_is_megatron_lms(tp, cp, dp, pp, etp, ep):
    """Megatron-LM's expert grid (initialize_model_parallel's expert RankGenerator: tp = ETP, ep = EP, dp = EDP,
    order "tp-ep-dp-pp") over our ranks, which follow its dense order "tp-cp-dp-pp": the same ETP, EP and EDP groups,
    and ETP x EP ("tp-ep", whose groups with the stages, "tp-ep-pp", sum Megatron-LM's expert gradient norms)."""
    from megatron_ds.parallel.groups import expert_grid_lists

    stage = tp * cp * dp
    ours = {k: [] for k in ("etp", "ep", "edp", "emp")}
    for p in range(pp):
        for kind, groups in expert_grid_lists(list(range(p * stage, (p + 1) * stage)), ep, etp).items():
            ours[kind] += groups
    sizes = dict(tp=etp, ep=ep, dp=stage // (etp * ep), pp=pp)
    for kind, mask in (("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("emp", "tp-ep")):
        assert sorted(ours[kind]) == sorted(_megatron_lm_groups(sizes, "tp-ep-dp-pp", mask)), kind
