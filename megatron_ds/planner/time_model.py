"""The time one training iteration of a ``Layout`` takes on a cluster, from first principles.

The planner (``planner/search.py``, ``tools/plan.py``) ranks layouts by it. Every term is written
here and in docs/planner.md; nothing is fitted per layout. Per micro-batch and pipeline stage:

- matmuls: each GEMM's FLOPs at the GPU's peak times an efficiency that grows with the GEMM's size
  (``matmul_efficiency``: ``e_max * n / (n + n_half)``, n the geometric mean of M, N, K), backward
  twice the forward's GEMMs;
- attention: the fused (flash) kernel's causal FLOPs at its own efficiency, backward 2.5x forward
  (it recomputes the scores);
- memory-bound work (norms, bias + activation, dropout + residual adds, the loss over the logits):
  bytes over HBM bandwidth;
- tensor parallel all-reduces (or sequence parallel's reduce-scatter + all-gather, the same bytes)
  over NVLink; the forward's exposed, the backward's hidden behind the weight-gradient GEMMs under
  --async-tensor-model-parallel-allreduce (``backward_tp_rings``);
- context parallelism (``context_parallel_seconds``): s / CP tokens a rank, its share of the attention blocks,
  the K/V ring partly hidden behind them;
- full recompute re-runs the forward (matmuls, attention, memory-bound work and TP collectives).

Per step: the pipeline runs ``m`` micro-batches through ``p`` stages; 1F1B and the interleaved
schedule take ``(m - 1) max_s t_s + (1 + (p - 1) / v) mean_s t_s`` (``pipeline_time``: the
bottleneck stage's steady state plus the fill and drain, which for equal stages is the
``(m + (p - 1) / v)`` of ``parallel.schedules.bubble_fraction``, and what ``parallel.schedules.simulate_step_time``
gives for 1F1B's step lists), each micro-batch's point-to-point messages exposed (1/TP of them per GPU under
scatter/gather or sequence parallelism, plus a fixed cost each). Then the data
parallel gradient reduction (a ring over NVLink inside a node and the node's network between
nodes, shared by the node's GPUs), exposed after the pipeline as DeepSpeed's pipeline engine runs it
(``ReduceGrads`` after the last backward), overlapped with the last micro-batch's backward by the
plain engine's ZeRO ``overlap_comm``; ZeRO-3's weight all-gathers in every forward, backward and recompute and
its gradient reduce-scatters over the node network, partly hidden behind the compute;
and the optimizer step, memory-bound: the bytes Adam reads and writes per parameter it steps.

The constants fitted to published runs (SC21, Korthikanti et al. 2022) are named below (``ZERO3_*``,
``DP_NET_EFF``, ``P2P_MESSAGE_S``), with the expected error of a prediction per regime (``EXPECTED_ERROR``);
docs/planner.md says which came from where. Model FLOPs are the family's count (``ModelFamily.flops``,
docs/flops.md), so TFLOP/s per GPU and MFU mean what the iteration line's mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.config.deepspeed_json import grad_accum_bytes, uses_bf16_optimizer
from megatron_ds.config.layout import Layout
from megatron_ds.config.moe_params import model_experts
from megatron_ds.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    """One GPU type. Bandwidths in GB/s; ``nvlink_gbs`` per GPU and direction."""
    name: str
    memory_gb: float
    peak_tflops: float  # dense 16-bit tensor-core peak (fp16; bf16 where the GPU has it)
    hbm_gbs: float
    nvlink_gbs: float
    # the matmul efficiency curve: e_max * n / (n + n_half), n = (M N K)^(1/3) (docs/planner.md)
    matmul_max: float
    matmul_half: float
    attention_eff: float  # the fused attention kernel's share of peak on its (causal) FLOPs
    bf16: bool = True
    # the largest share of peak a published end-to-end run on this GPU kind reached, its FLOPs counted as the
    # iteration line counts them (recompute included): no prediction is faster (None: no such run known)
    measured_share: float | None = None


# Sources: NVIDIA's data sheets. V100 SXM2: 125 TFLOP/s fp16 tensor, 900 GB/s HBM2, NVLink 2 300 GB/s
# (both directions, 150 per direction), no bf16. A100 SXM4: 312 TFLOP/s bf16 dense, 1,555 GB/s (40 GB)
# and 2,039 GB/s (80 GB) HBM2e, NVLink 3 600 GB/s (300 per direction). H100 SXM5: 989 TFLOP/s bf16
# dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 per direction). H200 SXM: H100's compute and NVLink,
# 141 GB HBM3e at 4.8 TB/s.
# The curve's e_max and n_half per architecture are the model's two constants for matmuls: A100's
# from Megatron-LM's published per-GPU throughput (its README table, tests/planner/test_planner.py),
# H100/H200's from this project's H200 measurement (bench/RESULTS.md), V100's from its generation's
# cuBLAS fp16 GEMMs reaching ~80% of peak only at large sizes (the same shape as A100's).
# attention_eff: flash attention's forward + backward at about 50% of peak on A100 and ~40% on
# Hopper with FlashAttention-2 (Dao 2023, Fig. 5-7); V100 runs the memory-efficient SDPA kernel.
# measured_share: A100 57.0%, the hardware FLOPs utilisation of Korthikanti et al. 2022's 530B and 1T runs (Table 5;
# their MFU 56.0 / 56.3%), the most a published A100 run reached; Hopper 49%, Megatron-LM's H100 benchmarks reaching
# "up to 47-48% MFU" (its README, core_v0.19) with selective recompute, whose hardware FLOPs are ~1.03x the model's
# (Korthikanti et al.'s 1 + s / 6h at seq 4096); V100: no published end-to-end share of that kind, no bound.
A100_SHARE, HOPPER_SHARE = 0.57, 0.49
GPUS = {
    "v100-16": GPU("v100-16", 16, 125, 900, 150, 0.70, 1200, 0.30, bf16=False),
    "v100-32": GPU("v100-32", 32, 125, 900, 150, 0.70, 1200, 0.30, bf16=False),
    "a100-40": GPU("a100-40", 40, 312, 1555, 300, 0.80, 400, 0.50, measured_share=A100_SHARE),
    "a100-80": GPU("a100-80", 80, 312, 2039, 300, 0.80, 400, 0.50, measured_share=A100_SHARE),
    "h100": GPU("h100", 80, 989, 3350, 450, 0.75, 2200, 0.40, measured_share=HOPPER_SHARE),
    "h200": GPU("h200", 141, 989, 4800, 450, 0.75, 2200, 0.40, measured_share=HOPPER_SHARE),
}
GPU_ALIASES = {"v100": "v100-16", "a100": "a100-40", "a100-80gb": "a100-80", "a100-40gb": "a100-40",
               "v100-16gb": "v100-16", "v100-32gb": "v100-32"}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    nodes: int
    network_gbs: float  # the node's network bandwidth, GB/s per direction, all its adapters together
    resource: str | None = None  # the ABCI resource type a job script asks for

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


# ABCI's resource types (https://docs.abci.ai/en/system-overview/ for ABCI 2.0: a V100 node has
# 4 x V100 SXM2 16 GB and 2 x InfiniBand EDR 100 Gb/s, an A100 node 8 x A100 SXM4 40 GB and
# 4 x InfiniBand HDR 200 Gb/s; https://docs.abci.ai/v3/en/system-overview/ for ABCI 3.0: 8 x H200
# SXM 141 GB and 8 x InfiniBand NDR 200 Gb/s). rt_HG is one GPU of an H200 node.
RESOURCES = {
    "rt_F": ("v100-16", 4, 2 * 100 / 8),
    "rt_AF": ("a100-40", 8, 4 * 200 / 8),
    "rt_HF": ("h200", 8, 8 * 200 / 8),
    "rt_HG": ("h200", 1, 0.0),
}
# A node of a GPU type named without a resource: 8 GPUs (4 for V100, as DGX-1 and ABCI's) and one
# 200 Gb/s adapter per GPU (DGX A100's and DGX H100's compute network: 8 x HDR 200 / 8 x NDR 400 Gb/s).
DEFAULT_NETWORK_GBS = {"v100-16": 2 * 100 / 8, "v100-32": 4 * 100 / 8, "a100-40": 8 * 200 / 8,
                       "a100-80": 8 * 200 / 8, "h100": 8 * 400 / 8, "h200": 8 * 400 / 8}

# Share of a link's bandwidth a ring collective reaches (NCCL's bus bandwidth against the link's:
# ~80% on NVLink and InfiniBand in nccl-tests) and each message's fixed latency, seconds.
LINK_EFF = 0.8
LATENCY_S = 10e-6
# Memory-bound element-wise passes per layer and micro-batch, forward, in elements of the hidden
# size per token: two norms (a read and a write each) and two fused bias + dropout + residual adds
# (two reads, a write and the mask: 3.5 each), 11, plus one for RoPE's or a bias's extra pass; of the
# ffn size: the fused bias + GeLU's read and write (SwiGLU: two reads and a write, ``+ 1``); backward
# twice. Loss: the logits written, read for the max and the exponentials, the softmax's gradient
# written (bytes per logit element).
ELEMENTWISE_H = 12
ELEMENTWISE_F = 2
LOGIT_PASSES = 6
ADAM_BYTES = 4 + 4 + 8 + 8 + 4 + 2  # fp32 master read + write, moments read + write, grad read, 16-bit copy
HBM_EFF = 0.8  # share of HBM bandwidth element-wise kernels reach
# Fitted to published runs (docs/planner.md, tests/planner/test_published_runs.py), the only constants besides the
# matmul curves that are: the share of the node
# network's bandwidth DeepSpeed ZeRO-3's per-layer gathers and reduce-scatters reach, and the share of the
# shorter of its traffic and the compute that hides behind the other (SC21 Table 2); the share a data parallel
# gradient all-reduce across nodes reaches (Korthikanti et al. 2022 section 6.3: 8-way DP cost the 530B run 3%)
ZERO3_NET_EFF = 0.1405
ZERO3_OVERLAP = 0.555
DP_NET_EFF = 0.4
# Each pipeline message's fixed cost beyond its bytes: Megatron's point-to-point exchange synchronises the device
# after every batch_isend_irecv (Megatron-DeepSpeed's megatron/p2p_communication.py ``_communicate``, "to protect
# against race condition"), so the next kernels' launch and NCCL's send/recv set-up are exposed per message;
# fitted to the interleaved, scatter/gather pipelines of SC21 Tables 1-2 and Korthikanti et al.'s Table 5
P2P_MESSAGE_S = 0.002


def find_gpu(name: str) -> GPU:
    key = name.lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise ConfigError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def make_cluster(*, gpu: str | None, gpus: int | None, resource: str | None, nodes: int | None,
                 gpus_per_node: int | None = None, network_gbs: float | None = None) -> Cluster:
    """The cluster of an ABCI resource x nodes, or of a GPU type x count (``gpus_per_node`` a node)."""
    if resource:
        if resource not in RESOURCES:
            raise ConfigError(f"unknown resource type {resource!r}; known: {', '.join(sorted(RESOURCES))}")
        name, per_node, net = RESOURCES[resource]
        if per_node == 1 and (nodes or 1) > 1:
            raise ConfigError(f"{resource} is one GPU of a node; for more GPUs plan whole nodes (rt_HF)")
        return Cluster(GPUS[name], per_node, nodes or 1, net if network_gbs is None else network_gbs, resource)
    if not gpu or not gpus:
        raise ConfigError("name the GPUs: --resource rt_HF --nodes N, or --gpu-type h200 --gpus N")
    g = find_gpu(gpu)
    per_node = gpus_per_node or (4 if g.name.startswith("v100") else 8)
    if gpus % per_node and gpus > per_node:
        raise ConfigError(f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes")
    net = DEFAULT_NETWORK_GBS[g.name] if network_gbs is None else network_gbs
    return Cluster(g, min(per_node, gpus), max(1, gpus // per_node), net)


def matmul_efficiency(gpu: GPU, m: float, n: float, k: float) -> float:
    """Share of peak a GEMM of M x K by K x N reaches: saturating in its size (docs/planner.md)."""
    size = (m * n * k) ** (1 / 3)
    return gpu.matmul_max * size / (size + gpu.matmul_half)


def gemm_seconds(gpu: GPU, m: float, n: float, k: float) -> float:
    return 2 * m * n * k / (gpu.peak_tflops * 1e12 * matmul_efficiency(gpu, m, n, k))


def ring_seconds(nbytes: float, ranks: int, gbs: float, *, all_reduce: bool = True, eff: float = LINK_EFF) -> float:
    """A ring all-reduce (or, ``all_reduce`` False, one all-gather / reduce-scatter) of ``nbytes``
    per rank over links of ``gbs`` reaching ``eff`` of it: 2 (n - 1) / n of the bytes cross each link (half that)."""
    if ranks <= 1 or nbytes == 0:
        return 0.0
    if gbs <= 0:
        raise ConfigError("a collective across nodes needs a network: give --network-gbs")
    share = (2 if all_reduce else 1) * (ranks - 1) / ranks
    return share * nbytes / (gbs * 1e9 * eff) + (2 if all_reduce else 1) * (ranks - 1) * LATENCY_S


@dataclass(frozen=True)
class MicroBatchTimes:
    """Seconds one GPU of a stage spends on one micro-batch, by kind (forward, backward, recompute)."""
    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    tp_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory + self.tp_comm

    def __add__(self, o: MicroBatchTimes) -> MicroBatchTimes:
        return MicroBatchTimes(self.matmul + o.matmul, self.attention + o.attention, self.memory + o.memory,
                               self.tp_comm + o.tp_comm)

    def scale(self, k: float) -> MicroBatchTimes:
        return MicroBatchTimes(self.matmul * k, self.attention * k, self.memory * k, self.tp_comm * k)


def _gated(m) -> bool:
    return bool(m.swiglu or getattr(m, "geglu", False))


def layer_forward(layout: Layout, gpu: GPU, experts: int = 1, *, causal: bool = True, flash: bool = True,
                  gpus_per_node: int = 8, network_gbs: float = 0.0) -> tuple[
        MicroBatchTimes, MicroBatchTimes, float]:
    """(the forward of one transformer layer for one micro-batch, the part selective recompute
    re-runs: the attention core, the seconds of its TP rings among ``tp_comm``). TP shards every GEMM's N (column parallel) or K (row parallel);
    DeepSpeed-Ulysses gives a rank s / SP positions outside attention and a / SP heads inside;
    ``network_gbs`` is a GPU's share of its node's network (MoE all-to-alls across nodes)."""
    m, t, sp, cp = layout.model, layout.tp, layout.sp, layout.cp
    h, a, s, b = m.hidden_size, m.num_attention_heads, m.seq_length, layout.micro_batch_size
    d = m.kv_channels or h // a
    g = m.num_key_value_heads or a
    f = m.ffn_hidden_size or 4 * h
    tokens = s // (sp * cp) * b
    # the experts a token runs (MoE: top-k MLPs; Megatron-LM's layer: --moe-router-topk, DeepSpeed-MoE's: --topk)
    active = min(m.moe_router_topk or m.topk, experts) if experts > 1 else 1
    gemm = (gemm_seconds(gpu, tokens, (a + 2 * g) * d / t, h) + gemm_seconds(gpu, tokens, h, a * d / t)
            + active * (gemm_seconds(gpu, tokens, f * (2 if _gated(m) else 1) / t, h)
                        + gemm_seconds(gpu, tokens, h, f / t)))
    heads = a / t / sp
    if cp > 1:  # context parallelism's blocks: the explicit math path, over the key chunks the mask leaves visible
        attention = unfused_attention_seconds(gpu, b * heads, s, d, share=cp_attention_share(cp, causal))
    elif flash:  # the fused kernel: every query of a sequence against its keys, causal half of them
        flops = 2 * 2 * b * s * s * heads * d * (0.5 if causal else 1.0)
        attention = flops / (gpu.peak_tflops * 1e12 * gpu.attention_eff)
    else:
        attention = unfused_attention_seconds(gpu, b * heads, s, d)
    replicated = h / t if layout.sequence_parallel else h
    elements = tokens * (ELEMENTWISE_H * replicated + active * (ELEMENTWISE_F + _gated(m)) * f / t)
    mem = 2 * elements / (gpu.hbm_gbs * 1e9 * HBM_EFF)
    activation = 2 * tokens * h  # bytes of one [s, b, h] 16-bit tensor
    # two all-reduces (attention and MLP outputs), or their reduce-scatter + all-gather pairs
    rings = comm = 2 * ring_seconds(activation, t, gpu.nvlink_gbs)
    if sp > 1:  # Ulysses: four all-to-alls (q, k, v and the output), each moving (SP - 1) / SP of its tensor
        comm += 4 * activation * (sp - 1) / sp / (gpu.nvlink_gbs * 1e9 * LINK_EFF)
    if experts > 1 and layout.ep > 1:
        # MoE: the dispatch and combine all-to-alls of the tokens' k capacity slots (Megatron-LM's dropless layer:
        # the k routes themselves, or its --moe-expert-capacity-factor), (EP - 1) / EP of them leaving the rank;
        # the EP group is DP ranks TP apart, over NVLink while it fits in a node
        capacity = (m.moe_expert_capacity_factor or 1.0) if m.moe_router_topk else m.moe_train_capacity_factor
        slots = activation * active * capacity
        link = gpu.nvlink_gbs if layout.tp * layout.ep <= gpus_per_node else network_gbs
        comm += 2 * slots * (layout.ep - 1) / layout.ep / (link * 1e9 * LINK_EFF)
    ring_fwd, ring_bwd = context_parallel_seconds(layout, gpu, attention, gpus_per_node, network_gbs)
    comm += ring_fwd
    return (MicroBatchTimes(gemm, attention, mem, comm), MicroBatchTimes(attention=attention, tp_comm=ring_fwd), rings,
            ring_bwd - ring_fwd)


def cp_attention_share(cp: int, causal: bool) -> float:
    """The share of a sequence's s x s scores one of ``cp`` ranks computes: rank r holds chunks r and 2 cp - 1 - r
    of the 2 cp (load-balanced, parallel/context_parallel.py) and under the causal mask computes each query chunk
    against the key chunks at or below it, (r + 1) + (2 cp - r) = 2 cp + 1 blocks of (s / 2 cp)^2, the diagonal
    ones whole; without the mask all its 2 chunks' rows."""
    return (2 * cp + 1) / (4 * cp * cp) if causal else 1 / cp


def context_parallel_seconds(layout: Layout, gpu: GPU, attention: float, gpus_per_node: int,
                             network_gbs: float) -> tuple[float, float]:
    """Exposed seconds of a layer's context parallel exchange (forward, backward). ``p2p``: cp - 1 ring hops of
    this rank's K and V, each in flight while the previous blocks compute (hidden behind the attention up to its
    time); backward sends the K/V around again with their gradients (twice the bytes, behind the backward's twice
    the attention). ``all_gather``: the K/V all-gathered before the blocks, their gradients reduce-scattered
    after, nothing to hide behind. CP groups are TP ranks apart (parallel/groups.py): NVLink while TP x CP fits
    a node, else the GPU's share of the node's network."""
    cp = layout.cp
    if cp <= 1:
        return 0.0, 0.0
    m = layout.model
    kv_heads = (m.num_key_value_heads or m.num_attention_heads) / layout.tp
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    kv = 2 * 2 * layout.micro_batch_size * m.seq_length / cp * kv_heads * d  # this rank's K and V, 16-bit
    link = gpu.nvlink_gbs if layout.tp * cp <= gpus_per_node else network_gbs
    if layout.cp_comm_type == "all_gather":
        gather = ring_seconds(kv * cp, cp, link, all_reduce=False)
        return gather, gather
    hops = (cp - 1) * (kv / (link * 1e9 * LINK_EFF) + LATENCY_S)
    return max(0.0, hops - attention), max(0.0, 2 * hops - 2 * attention)


def backward_tp_rings(layout: Layout, rings: float) -> float:
    """Exposed seconds of a layer's backward TP collectives, its forward's rings taking ``rings``.
    Synchronous (this project's default, the SC21 runs' Megatron of 2021): the two column-parallel
    layers' input-gradient all-reduces, as long as the forward's. Overlapped with the weight-gradient
    GEMM (``--async-tensor-model-parallel-allreduce``, Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication`` in core/tensor_parallel/layers.py, on in
    Korthikanti et al.'s 2022 runs): nothing left exposed, except under sequence parallelism the
    all-gathers of the row-parallel outputs' gradients (half the forward's bytes), which come before
    any GEMM they could hide behind. Korthikanti et al. Table 4 (tests/planner) measures exactly this:
    the 22B layer's backward 11.9 ms without SP, 11.8 with it."""
    if not layout.model.async_tensor_model_parallel_allreduce:
        return rings
    return rings / 2 if layout.sequence_parallel else 0.0


def unfused_attention_seconds(gpu: GPU, heads: float, s: int, d: int, share: float = 1.0) -> float:
    """Forward attention as Megatron-LM ran it before fused kernels (the published runs of 2021-22):
    batched GEMMs for the scores and over the values, all s x s of them (``share`` of them: a context parallel
    rank's blocks), and the ``[heads, s, s]`` 16-bit scores written by the first, read and written by the fused
    scale-mask-softmax, read by dropout, which writes its output and a 1-byte mask, read by the second GEMM."""
    gemms = 2 * gemm_seconds(gpu, heads * s * share, s, d)  # a batched GEMM fills the GPU as one of heads x s rows
    passes = 2 + 2 + 2 + 2 + 1 + 2
    return gemms + passes * heads * s * s * share / (gpu.hbm_gbs * 1e9 * HBM_EFF)


def stage_times(layout: Layout, gpu: GPU, stage, *, flash: bool = True, layer_cache: dict | None = None,
                node: tuple[int, float] = (8, 0.0)) -> tuple[MicroBatchTimes, MicroBatchTimes, MicroBatchTimes]:
    """(forward, backward, recompute) of one micro-batch on one GPU of ``stage``; ``flash`` False:
    attention unfused (``unfused_attention_seconds``). ``layer_cache``: one layer's times by expert
    count, shared by the stages of one layout (the layers of a dense model all cost the same)."""
    causal = layout.family.causal_attention
    cache = {} if layer_cache is None else layer_cache
    if "experts" not in cache:
        cache["experts"] = list(model_experts(layout.model))
    experts = cache["experts"]
    counts: dict[int, int] = {}
    for i in range(*stage.layers):
        e = experts[i] if i < len(experts) else 1
        counts[e] = counts.get(e, 0) + 1
    fwd = bwd = rec = MicroBatchTimes()
    for e, n in counts.items():
        if e not in cache:
            f, selective, rings, ring_extra = layer_forward(layout, gpu, e, causal=causal, flash=flash,
                                                            gpus_per_node=node[0], network_gbs=node[1])
            # backward: two GEMMs per forward GEMM (unfused attention's two batched GEMMs too), flash attention's
            # backward 2.5 forwards (it recomputes the scores), twice the bytes; the all-to-alls of Ulysses and
            # MoE as in the forward, the TP rings as ``backward_tp_rings`` says
            b = MicroBatchTimes(2 * f.matmul, (2.5 if flash else 2.0) * f.attention, 2 * f.memory,
                                f.tp_comm - rings + backward_tp_rings(layout, rings) + ring_extra)
            r = f if layout.recompute == "full" else selective if layout.recompute == "selective" else MicroBatchTimes()
            cache[e] = (f, b, r)
        f, b, r = cache[e]
        fwd, bwd, rec = fwd + f.scale(n), bwd + b.scale(n), rec + r.scale(n)
    if stage.stage == layout.pp - 1:
        m = layout.model
        tokens = m.seq_length // (layout.sp * layout.cp) * layout.micro_batch_size
        out = gemm_seconds(gpu, tokens, layout.padded_vocab_size / layout.tp, m.hidden_size)
        loss = LOGIT_PASSES * 2 * tokens * layout.padded_vocab_size / layout.tp / (gpu.hbm_gbs * 1e9 * HBM_EFF)
        fwd = fwd + MicroBatchTimes(matmul=out, memory=loss / 2)
        bwd = bwd + MicroBatchTimes(matmul=2 * out, memory=loss / 2)
    return fwd, bwd, rec


@dataclass(frozen=True)
class Placement:
    """Where a layout's groups sit, ranks ordered TP fastest, then DP, then PP (DeepSpeed's
    ``PipeModelDataParallelTopology``, axes pipe, data, model)."""
    dp_per_node: int  # members of one DP group in a node
    dp_nodes: int  # nodes one DP group spans
    pp_inter_node: bool  # neighbouring pipeline stages on different nodes


def placement(layout: Layout, cluster: Cluster) -> Placement:
    gpn, tp, dp = cluster.gpus_per_node, layout.tp, layout.dp * layout.sp * layout.cp  # CP ranks share the weights
    per_node = max(1, min(dp, gpn // tp))
    return Placement(per_node, math.ceil(dp / per_node), tp * dp * layout.pp > gpn)


def zbh1_time(stage_seconds: list[float], tail_seconds: list[float], m: int) -> float:
    """ZB-H1's step: the bottleneck's steady state, one micro-batch through, and p - 1 of the stages'
    ``F + B - W`` (``tail_seconds``): ``m (F + B + W) + (p - 1)(F + B - W)`` for equal stages, what
    ``parallel.schedules.simulate_step_time`` gives for ``zbh1_schedule``'s step lists when ``m >= p``."""
    p = len(stage_seconds)
    return (m - 1) * max(stage_seconds) + sum(stage_seconds) / p + (p - 1) * sum(tail_seconds) / p


def pipeline_time(stage_seconds: list[float], m: int, v: int) -> float:
    """1F1B / interleaved 1F1B step: the bottleneck stage's steady state plus fill and drain."""
    mean = sum(stage_seconds) / len(stage_seconds)
    return (m - 1) * max(stage_seconds) + (1 + (len(stage_seconds) - 1) / v) * mean


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's predicted time and where it goes (seconds on the critical path)."""
    step_s: float
    compute_s: float  # matmuls, attention and memory-bound work of the bottleneck stage, all micro-batches
    recompute_s: float  # of the bottleneck stage's work, what recompute runs again (its TP collectives: tp_comm_s)
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float  # the pipeline's fill and drain: its time beyond the slowest stage's own micro-batches
    dp_comm_s: float  # exposed gradient reduction and ZeRO traffic
    optimizer_s: float
    flops: float  # model FLOPs of the step (docs/flops.md)
    world_size: int
    peak_tflops: float
    bound_s: float = 0.0  # what the measured-efficiency bound adds: the terms predicted a faster step than any run reached

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / self.step_s / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.peak_tflops

    @property
    def comm_share(self) -> float:
        return (self.tp_comm_s + self.pp_comm_s + self.dp_comm_s) / self.step_s


def _uses_split_optimizer(layout: Layout) -> bool:
    return layout.zero_stage >= 1 or uses_bf16_optimizer(layout.ds_config, layout.precision, layout.zero_stage,
                                                         layout.use_pipeline)


def data_parallel_seconds(layout: Layout, cluster: Cluster, params: int, backward_s: float,
                          compute_s: float = 0.0) -> float:
    """Exposed seconds of the gradient reduction (and ZeRO's gathers) over the DP (x Ulysses SP) group;
    ``backward_s`` one micro-batch's backward (and recompute), ``compute_s`` the step's compute."""
    place = placement(layout, cluster)
    gpu, gpn = cluster.gpu, cluster.gpus_per_node
    nbytes = params * grad_accum_bytes(layout.ds_config, layout.precision)
    # the node's network is shared by the DP groups with members in the node
    net = cluster.network_gbs * place.dp_per_node / gpn

    def ring(size: float, *, all_reduce: bool = True, eff: float = DP_NET_EFF) -> float:
        return (ring_seconds(size, place.dp_per_node, gpu.nvlink_gbs, all_reduce=all_reduce)
                + ring_seconds(size, place.dp_nodes, net, all_reduce=all_reduce, eff=eff))

    m = layout.grad_accum_steps
    if layout.zero_stage == 3:
        # every micro-batch gathers the weights for its forward, again for its backward and for full recompute's
        # second forward (DeepSpeed's checkpointed layers fetch their partitions again), and reduce-scatters the
        # gradients; DeepSpeed prefetches the gathers and reduces on a side stream, but only ZERO3_OVERLAP of the
        # shorter of compute and traffic hides behind the other (both fitted to SC21 Table 2, docs/planner.md)
        weights = params * (4 if layout.precision == "fp32" else 2)
        gathers = 3 if layout.recompute == "full" else 2
        traffic = m * (gathers * ring(weights, all_reduce=False, eff=ZERO3_NET_EFF)
                       + ring(nbytes, all_reduce=False, eff=ZERO3_NET_EFF))
        return max(0.0, traffic - compute_s) + (1 - ZERO3_OVERLAP) * min(traffic, compute_s)
    reduce = ring(nbytes)  # ZeRO 1/2: reduce-scatter + all-gather of the weights: the same bytes
    if layout.zero_stage == 2 and m > 1:  # stage 2 reduce-scatters its buckets in every micro-batch's backward
        reduce += (m - 1) * ring(nbytes, all_reduce=False)
    overlap = (layout.ds_config.get("zero_optimization") or {}).get("overlap_comm")
    if layout.use_pipeline or not overlap or layout.zero_stage == 0:
        return reduce  # DeepSpeed's pipeline engine reduces after the last backward
    # the plain engine's ZeRO overlap_comm: buckets reduce while backward runs
    return max(0.0, reduce - backward_s * (m if layout.zero_stage >= 2 else 1))


def optimizer_seconds(layout: Layout, gpu: GPU, params: int) -> float:
    """Adam over the parameters this GPU steps (1/DP of them when split), plus one read of every gradient
    (the norm for clipping, the overflow check)."""
    stepped = params / (layout.dp * layout.sp * layout.cp) if _uses_split_optimizer(layout) else params
    grads = params * grad_accum_bytes(layout.ds_config, layout.precision)
    return (stepped * ADAM_BYTES + grads) / (gpu.hbm_gbs * 1e9 * HBM_EFF)


def split_stage_messages(layout: Layout) -> bool:
    """Whether each TP rank sends 1/TP of a stage's message (``Layout._describe_stage_messages`` says which)."""
    if layout.sequence_parallel:
        return True
    if layout.own_schedule:
        return layout.scatter_gather_p2p
    return bool((layout.ds_config.get("pipeline") or {}).get("pipe_partitioned"))


def step_time(layout: Layout, cluster: Cluster, *, flash: bool = True, flops: float | None = None) -> StepTime:
    """The predicted time of one optimizer step of ``layout`` on ``cluster`` (module docstring);
    ``flash`` False: attention as unfused kernels ran it (the published runs this is checked on);
    ``flops``: the step's model FLOPs where the caller has them (default: the family's count)."""
    gpu, m, pp, v = cluster.gpu, layout.grad_accum_steps, layout.pp, max(1, layout.virtual_pp)
    place = placement(layout, cluster)
    m_cfg = layout.model
    message = 2 * m_cfg.seq_length // (layout.sp * layout.cp) * layout.micro_batch_size * m_cfg.hidden_size
    link = cluster.network_gbs / cluster.gpus_per_node if place.pp_inter_node else gpu.nvlink_gbs
    # a forward activation out and its gradient back per micro-batch and model chunk; split into 1/TP per GPU under
    # sequence parallelism (each rank's own shard) or scatter/gather (SC21's, the receiving stage all-gathers it)
    split = split_stage_messages(layout)
    gather = ring_seconds(message, layout.tp, gpu.nvlink_gbs, all_reduce=False) if split and not (
        layout.sequence_parallel) else 0.0
    sent = message / layout.tp if split else message
    p2p = 0.0 if pp == 1 else 2 * v * (sent / (link * 1e9 * LINK_EFF) + LATENCY_S + gather + P2P_MESSAGE_S)
    cache: dict = {}
    by_shape: dict = {}  # a dense model's stages of as many layers (the last apart) cost the same
    dense = max(model_experts(m_cfg)) == 1
    per_stage = []
    for s in layout.stages:
        shape = (s.layers[1] - s.layers[0], s.stage == pp - 1) if dense else s.stage
        if shape not in by_shape:
            by_shape[shape] = stage_times(layout, gpu, s, flash=flash, layer_cache=cache, node=(
                cluster.gpus_per_node, cluster.network_gbs / cluster.gpus_per_node))
        per_stage.append(by_shape[shape])
    seconds = [f.total + b.total + r.total + p2p for f, b, r in per_stage]
    if layout.zbh1 is not None and m >= pp:  # (fewer micro-batches leave no steady state to fill: 1F1B's time)
        # ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): weight passes (one GEMM per forward
        # GEMM) fill the cool-down, leaving (p - 1)(F + B - W) of idle time instead of (p - 1)(F + B + W)
        tail = [f.total + b.total + r.total - 2 * f.matmul + p2p for f, b, r in per_stage]
        pipe = zbh1_time(seconds, tail, m)
    else:
        pipe = pipeline_time(seconds, m, v)
    worst = max(range(len(seconds)), key=seconds.__getitem__)
    f, b, r = per_stage[worst]
    compute = m * (f.matmul + f.attention + f.memory + b.matmul + b.attention + b.memory)
    tp_comm = m * (f.tp_comm + b.tp_comm + r.tp_comm)
    params = max(s.params_per_tp_rank for s in layout.stages)
    dp = data_parallel_seconds(layout, cluster, params, b.total + r.total, m * (f.total + b.total + r.total))
    opt = optimizer_seconds(layout, gpu, params)
    if flops is None:
        flops = layout.family.flops(layout, m_cfg.seq_length)
    step = pipe + dp + opt
    # compute efficiency bounded by what the GPU kind has been measured to reach (``GPU.measured_share``)
    floor = 0.0 if gpu.measured_share is None else flops / (layout.world_size * gpu.peak_tflops * 1e12 * gpu.measured_share)
    return StepTime(step_s=max(step, floor), compute_s=compute, recompute_s=m * (r.total - r.tp_comm),
                    tp_comm_s=tp_comm, pp_comm_s=m * p2p,
                    bubble_s=pipe - m * seconds[worst], dp_comm_s=dp, optimizer_s=opt, flops=flops,
                    world_size=layout.world_size, peak_tflops=gpu.peak_tflops, bound_s=max(0.0, floor - step))


# Largest |predicted / measured - 1| on the published A100 runs of each regime (tests/planner/test_published_runs.py
# asserts every row within it; docs/planner.md lists the rows):
#   ptd-p         tensor + pipeline + data parallel with full recompute: SC21 Table 1, Table 2 (PTD-P),
#                 Korthikanti et al. 2022 Table 5 (full recompute)
#   no-recompute  selective or no recompute: Korthikanti et al. Table 4 (per layer), Table 5 (selective + SP)
#   zero-3        ZeRO-3 without model parallelism: SC21 Table 2
EXPECTED_ERROR = {"ptd-p": 0.08, "no-recompute": 0.09, "zero-3": 0.10}
MEASURED_GPUS = ("a100-40", "a100-80")  # the GPUs the published runs ran on


def regime(layout) -> str:
    """Which published comparison a layout's prediction is judged by."""
    if layout.zero_stage == 3:
        return "zero-3"
    return "ptd-p" if layout.recompute == "full" else "no-recompute"


def expected_error(layout, gpu) -> float | None:
    """The relative error to expect of a prediction (None: unknown, no published run on this GPU)."""
    return EXPECTED_ERROR[regime(layout)] if gpu.name in MEASURED_GPUS else None


def tie_groups(ranked) -> list[int]:
    """A group number per candidate (sorted fastest first): a candidate joins the current group while its
    step, less its expected error, is within the group's fastest step plus that one's error -- predictions
    overlapping within the error are ties, not a ranking. An unknown error counts as the A100's."""
    groups, group, lead_high = [], 0, None
    for cand in ranked:
        err = EXPECTED_ERROR[regime(cand.layout)]
        low, high = cand.time.step_s * (1 - err), cand.time.step_s * (1 + err)
        if lead_high is None or low > lead_high:
            group, lead_high = group + 1, high
        groups.append(group)
    return groups


def error_text(layout, gpu) -> str:
    err = expected_error(layout, gpu)
    if err is None:
        return (f"expected error unknown on {gpu.name} until measured (on A100 runs of this regime, "
                f"{regime(layout)}: +-{100 * EXPECTED_ERROR[regime(layout)]:.0f}%)")
    return f"expected error +-{100 * err:.0f}% ({regime(layout)} regime, published A100 runs)"
