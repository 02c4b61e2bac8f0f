"""The per-GPU memory estimate (megatron_ds/config/memory.py) and its --dry-run check.

The parameter-state part is compared with what a real DeepSpeed engine holds after one step on CPU
(every live tensor storage in the process, counted once, before and after), the activation part
with torch.cuda.max_memory_allocated on a GPU when there is one, and the whole with the layouts
of the job scripts and of a known failure (GPT 6.7B on one 80 GB GPU).
"""
import gc
import json
from pathlib import Path

import pytest
import torch

from megatron_ds.config import memory, parse_args, resolve
from megatron_ds.config.memory import (GB, activation_bytes_per_layer, check_memory, estimate_memory, estimate_stages,
                                       gpu_memory_bytes, logits_bytes)
from megatron_ds.families import main as pretrain_main
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.training.device import select_device
from tests.distributed import cuda_env, run_distributed

REPO = Path(__file__).resolve().parents[2]

TINY = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 500 "
        "--make-vocab-size-divisible-by 4 --num-workers 0 --attention-dropout 0 --hidden-dropout 0").split()


def _layout(argv, world):
    cfg, _ = parse_args(argv)
    return cfg, resolve(cfg, world_size=world, vocab_size=cfg.data.vocab_size or 50257, device_type="cuda",
                        family=GPT).layout


def _gpt_flags(layers, hidden, heads, seq, micro, gbs, tp=1, pp=1):
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} --seq-length {seq} "
            f"--micro-batch-size {micro} --global-batch-size {gbs} --train-iters 10 --lr 1e-4 --mock-data "
            f"--vocab-size 50257 --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}").split()


# --------------------------------------------------------------------------- the arithmetic

def saved_bytes(layer, inputs, held_elsewhere=()) -> int:
    """Bytes ``layer(inputs)`` keeps for backward, measured: every tensor autograd saves during its
    forward (saved-tensor hooks), each storage once, parameters and ``held_elsewhere`` left out."""
    outside = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    outside |= {t.untyped_storage().data_ptr() for t in held_elsewhere}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in outside:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(inputs)
    return sum(saved.values())


def _saved_by_one_layer(model_cfg) -> int:
    """Bytes one bf16 transformer layer keeps for backward (``saved_bytes``)."""
    from megatron_ds.model.transformer import ParallelTransformerLayer
    from megatron_ds.parallel.random import set_parallel_seeds

    set_parallel_seeds(1, 0)
    m = model_cfg
    layer = ParallelTransformerLayer(m, 1, params_dtype=torch.bfloat16, device="cpu")
    stream = torch.float32 if m.fp32_residual_connection else torch.bfloat16  # the layer's input
    return saved_bytes(layer, torch.randn(m.seq_length, 2, m.hidden_size, dtype=stream, requires_grad=True))


LAYER_CASES = {
    "gpt": [],
    # SwiGLU with its own ffn size, grouped-query attention, RoPE, no biases, no hidden dropout.
    # LayerNorm, because torch's RMSNorm is a composite of fp32 ops on the CPU (fused on CUDA).
    "llama_like": ["--swiglu", "--ffn-hidden-size", "688", "--num-key-value-heads", "2",
                   "--use-rotary-position-embeddings", "--disable-bias-linear", "--hidden-dropout", "0",
                   "--no-rope-fusion", "--no-bias-swiglu-fusion"],
    # as a GPU runs it: the compiled split + RoPE and SwiGLU (inductor's C++ on the CPU, ~30 s),
    # which keep no rotated copies and no SiLU(gate)
    "llama_like_fused": ["--swiglu", "--ffn-hidden-size", "688", "--num-key-value-heads", "2",
                         "--use-rotary-position-embeddings", "--disable-bias-linear", "--hidden-dropout", "0",
                         "--fusions-on-cpu"],
    "fp32_residual": ["--fp32-residual-connection"],  # both norms read the fp32 stream
    # Qwen's QKV bias and per-head q/k norms (before RoPE, unfused), head dim 48 != 256 / 8
    "open_model": ["--swiglu", "--ffn-hidden-size", "688", "--num-key-value-heads", "2", "--kv-channels", "48",
                   "--use-rotary-position-embeddings", "--disable-bias-linear", "--hidden-dropout", "0",
                   "--add-qkv-bias", "--qk-layernorm", "--no-bias-swiglu-fusion"],
    # DeepSeek's multi-latent attention: the latents and their norms, q/k of 32 + 16 channels; v of 48 as well, so that
    # the CPU runs its flash kernel (it wants one head dim; a GPU's memory-efficient kernel takes narrower values)
    "mla": ["--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32",
            "--qk-pos-emb-head-dim", "16", "--v-head-dim", "48", "--position-embedding-type", "rope", "--swiglu",
            "--ffn-hidden-size", "688", "--disable-bias-linear", "--hidden-dropout", "0", "--no-bias-swiglu-fusion"],
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_activation_term_is_what_a_layer_saves(case):
    """The per-layer activation term against what autograd really keeps. Attention dropout 0 lets the
    CPU run its flash kernel, as a GPU does (which also keeps no [s, s] tensor with dropout on); the
    CPU's dropout masks are bf16, as the fused bias-dropout-add's are on a GPU. For GPT shapes the
    measurement is Korthikanti et al.'s 34*s*b*h (+2 for the masks' second byte) plus the logsumexp,
    not their 5*a*s/h scores."""
    s, b, h, a = 256, 2, 256, 8
    flags = _gpt_flags(2, h, a, s, b, 2) + ["--bf16", "--attention-dropout", "0"] + LAYER_CASES[case]
    cfg, layout = _layout(flags, 1)
    measured = _saved_by_one_layer(layout.model)
    estimated = activation_bytes_per_layer(layout, recompute=None)
    # left out by the estimate: the norms' fp32 mean/rstd (0.2%) and RoPE's cos/sin (~1% at this
    # small size; they do not grow with the micro batch)
    assert measured == pytest.approx(estimated, rel=0.015), (measured / (s * b * h), estimated / (s * b * h))
    if case == "gpt":
        # the paper's 34 counts 1-byte dropout masks; these two are 2 bytes (docs/memory.md)
        assert estimated == pytest.approx(s * b * h * (34 + 2 + 4 * a / h), rel=1e-9)
        assert estimated < s * b * h * (34 + 5 * a * s / h) / 2  # the unfused count would double it


def _saved_by_the_loss(dtype, tokens, vocab, hidden) -> int:
    """Bytes the output layer + language_model_loss keep for backward (saved-tensor hooks), the hidden
    states and the weight left out."""
    from megatron_ds.model.language_model import language_model_loss

    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    x = torch.randn(tokens, 1, hidden, dtype=dtype, requires_grad=True)
    labels, mask = torch.randint(0, vocab, (1, tokens)), torch.ones(1, tokens)
    outside = {weight.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in outside:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        language_model_loss((x @ weight.t()).transpose(0, 1), (labels, mask))
    return sum(saved.values())


def test_logits_term_is_what_the_loss_keeps():
    """bf16: the chunked cross entropy keeps the bf16 logits (and per-token scalars), and backward
    adds their bf16 gradient; fp32: the reference keeps the fp32 softmax, and its forward briefly
    holds the logits, a shifted copy and exp() at once -- the larger, which the estimate counts."""
    s, b, vocab, h = 512, 1, 4096, 64
    _, layout = _layout(_gpt_flags(2, h, 4, s, b, 1) + ["--bf16", "--vocab-size", str(vocab),
                                                         "--make-vocab-size-divisible-by", "1"], 1)
    elements = s * b * layout.padded_vocab_size
    kept = _saved_by_the_loss(torch.bfloat16, s * b, layout.padded_vocab_size, h)
    assert kept == pytest.approx(elements * 2, rel=0.01)  # per-token scalars: < 1%
    fixed = min(memory.CHUNK_BYTES, elements * 12)
    assert logits_bytes(layout) - fixed == pytest.approx(kept + elements * 2, rel=0.01)
    kept = _saved_by_the_loss(torch.float32, s * b, layout.padded_vocab_size, h)
    assert kept == pytest.approx(elements * 4, rel=0.01)  # the fp32 softmax
    _, layout = _layout(_gpt_flags(2, h, 4, s, b, 1) + ["--vocab-size", str(vocab), "--make-vocab-size-divisible-by", "1"], 1)
    # at least what is kept plus the fp32 gradient backward makes beside it
    assert logits_bytes(layout) >= kept + elements * 4


def test_logits_term_with_liger_where_it_runs(monkeypatch):
    """liger's fused linear + cross entropy (model/liger.py) makes no [tokens, vocab] tensor; it
    runs only at tensor parallel size 1, with --liger-kernel, when installed."""
    flags = _gpt_flags(24, 2048, 16, 2048, 8, 8) + ["--bf16", "--liger-kernel"]
    _, layout = _layout(flags, 1)
    monkeypatch.setattr(memory, "_liger_installed", lambda: False)
    unfused = logits_bytes(layout)
    assert unfused > 2048 * 8 * layout.padded_vocab_size * 4  # GPT 1.3B at micro batch 8: ~3.3 GB of bf16 logits + gradient
    monkeypatch.setattr(memory, "_liger_installed", lambda: True)
    fused = logits_bytes(layout)
    assert fused < unfused / 5
    # the weight's gradient (bf16, [vocab, h]) is the largest part, the rest scales with the tokens
    assert fused > layout.padded_vocab_size * 2048 * 2
    assert logits_bytes(_layout(flags[:-1] + ["--no-liger-kernel"], 1)[1]) == unfused
    tp2 = _layout(_gpt_flags(24, 2048, 16, 2048, 8, 16, tp=2) + ["--bf16", "--liger-kernel"], 2)[1]
    monkeypatch.setattr(memory, "_liger_installed", lambda: False)
    without = logits_bytes(tp2)
    monkeypatch.setattr(memory, "_liger_installed", lambda: True)
    assert logits_bytes(tp2) == without


def test_full_recompute_keeps_one_input_per_layer_and_one_layers_working_set():
    s, b, h, a, layers = 1024, 2, 1024, 16, 24
    cfg, layout = _layout(_gpt_flags(layers, h, a, s, b, 2) + ["--bf16"], 1)
    per_layer = activation_bytes_per_layer(layout, recompute=None)
    boundary = s * b * h * 2  # the stage's input/output hidden state
    assert dict(estimate_memory(layout).terms)["activations"] == pytest.approx(layers * per_layer + boundary)
    cfg, layout = _layout(_gpt_flags(layers, h, a, s, b, 2) + ["--bf16", "--checkpoint-activations"], 1)
    est = dict(estimate_memory(layout).terms)
    assert est["activations"] == pytest.approx(layers * s * b * h * 2 + per_layer + boundary, rel=1e-9)


def test_pipeline_first_stage_holds_the_most_micro_batches():
    # 1F1B: stage i keeps up to PP - i micro-batches in flight, at least 2 (DeepSpeed's
    # TrainSchedule.num_pipe_buffers), so with equal layers per stage stage 0 holds the most.
    cfg, layout = _layout(_gpt_flags(8, 512, 8, 256, 1, 64, pp=4) + ["--bf16"], 4)
    per_layer = activation_bytes_per_layer(layout, recompute=None)
    boundary = 256 * 512 * 2
    acts = [dict(e.terms)["activations"] for e in estimate_stages(layout)]
    assert acts == pytest.approx([k * (2 * per_layer + boundary) for k in (4, 3, 2, 2)], rel=1e-9)
    # only the last stage computes the logits: [s, b, V/t] with the fp32 cross-entropy copies
    logits = [dict(e.terms)["logits"] for e in estimate_stages(layout)]
    assert logits[:3] == [0, 0, 0] and logits[3] == logits_bytes(layout) > 0


def test_seven_billion_on_one_80gb_gpu_is_refused():
    # The failure this check exists for: GPT 6.7B on one 80 GB GPU passed --dry-run, then ran out of memory.
    # Mixed-precision Adam alone is 16 bytes/parameter = ~107 GB.
    cfg, layout = _layout(_gpt_flags(32, 4096, 32, 2048, 1, 8) + ["--bf16"], 1)
    est = estimate_memory(layout)
    assert est.total > 16 * layout.total_params
    with pytest.raises(Exception) as info:
        check_memory(layout, est, 80 * GB)
    message = str(info.value)
    assert "exceeds the GPU's 80 GB" in message and "optimizer states" in message
    assert "use more GPUs" in message  # one GPU: no TP/PP/ZeRO change can help


def test_over_budget_names_layouts_that_fit():
    cfg, layout = _layout(_gpt_flags(32, 4096, 32, 2048, 1, 64) + ["--bf16", "--zero-stage", "1"], 8)
    est = estimate_memory(layout)
    with pytest.raises(Exception) as info:
        check_memory(layout, est, 40 * GB)
    message = str(info.value)
    assert "would fit:" in message and "--tensor-model-parallel-size" in message
    # each suggestion really fits when applied
    for suggestion in message.split("would fit: ")[1].split("; "):
        flags = suggestion.split(" (~")[0].split()
        _, fixed = _layout(_gpt_flags(32, 4096, 32, 2048, 1, 64) + ["--bf16", "--zero-stage", "1"] + flags, 8)
        assert estimate_memory(fixed).total <= 40 * GB, suggestion


def test_design_reference_13b_on_v100_fits():
    # the layout of scripts/abci/abci2_v100_gpt_13b.sh: a 13B GPT fits V100 16 GB with micro batch 1,
    # TP 4, PP 8 and activation checkpointing
    flags = _gpt_flags(40, 5120, 40, 2048, 1, 512, tp=4, pp=8) + ["--fp16", "--checkpoint-activations",
                                                                  "--deepspeed_config", "ds_configs/zero1_fp16.json"]
    cfg, layout = _layout(flags, 32)
    est = estimate_memory(layout)
    assert est.total < gpu_memory_bytes("rt_F") == 16 * GB
    # without activation checkpointing it does not
    cfg, layout = _layout([f for f in flags if f != "--checkpoint-activations"], 32)
    assert estimate_memory(layout).total > 16 * GB


def test_gpu_memory_values():
    assert gpu_memory_bytes("rt_HF") == gpu_memory_bytes("h200") == 141 * GB
    assert gpu_memory_bytes("rt_AF") == 40 * GB and gpu_memory_bytes("24.5") == 24.5 * GB
    assert gpu_memory_bytes(None) is None
    with pytest.raises(Exception, match="give GB"):
        gpu_memory_bytes("rt_X")


def test_dry_run_prints_the_estimate_and_fails_over_budget(capsys):
    argv = ["--dry-run", "--world-size", "1", *_gpt_flags(32, 4096, 32, 2048, 1, 8), "--bf16"]
    assert pretrain_main(argv + ["--gpu-memory-gb", "rt_HF"]) == 1
    out, err = capsys.readouterr()
    assert "memory per GPU (stage 0, GB): weights" in out and "DOES NOT FIT" in out
    assert err.startswith("error: estimated") and "biggest term: optimizer states" in err
    assert pretrain_main(["--dry-run", "--world-size", "8", *_gpt_flags(24, 2048, 16, 2048, 4, 512),
                          "--bf16", "--gpu-memory-gb", "rt_HF"]) == 0
    assert "fits" in capsys.readouterr().out


# --------------------------------------------------------------------------- measured on CPU

def _live_tensor_bytes() -> int:
    """Bytes of every live tensor storage in this process, each storage once."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):  # tensors without storage (e.g. sparse, freed)
            continue
    return sum(seen.values())


def _measure_engines(rank, world_size, argvs):
    """Build each case's engine in turn, take one step, and count what it added."""
    import contextlib
    import functools
    import io

    from megatron_ds.model.language_model import language_model_loss
    from megatron_ds.parallel.groups import ParallelState
    from megatron_ds.training.data import BatchCollator, build_datasets, build_loader, describe_source
    from megatron_ds.training.engine import build_engine
    from megatron_ds.training.initialize import discover_world, init_distributed
    from megatron_ds.training.loop import train_step

    results = []
    for argv in argvs:
        cfg, _ = parse_args(argv)
        env = discover_world(use_mpi=False, local_rank=None)
        device = torch.device("cpu")
        run = resolve(cfg, world_size=env.world_size, vocab_size=cfg.data.vocab_size, device_type="cpu", family=GPT)
        layout = run.layout
        init_distributed(run.distributed, device)
        ps = ParallelState(layout.tp, layout.pp, layout.dp)
        dataset = build_datasets(cfg.data, num_samples=(layout.global_batch_size * 2, 0, 0), seed=1,
                                 seq_length=layout.model.seq_length, vocab_size=cfg.data.vocab_size,
                                 log=lambda *a: None)[0]
        collator = BatchCollator(cfg.data, cfg.data.vocab_size - 1, cfg.data.vocab_size, describe_source(cfg.data))
        batches = list(build_loader(dataset, cfg.data, collator, consumed_samples=0, dp_rank=ps.dp_rank,
                                    micro_batch_size=layout.micro_batch_size, dp_size=ps.dp_size))
        before = _live_tensor_bytes()
        with contextlib.redirect_stdout(io.StringIO()):
            rt = build_engine(run, ps, device, cfg.data.vocab_size - 1, family=GPT)
            train_step(rt.engine, iter(batches), layout, functools.partial(language_model_loss, tp_group=ps.tp_group),
                       ps.dp_group)
        after = _live_tensor_bytes()
        est = estimate_memory(layout)
        results.append((after - before, est.persistent, est.optimizer_path, type(rt.engine.optimizer).__name__))
        del rt, batches, dataset
        torch.distributed.barrier()
    return results


# (precision flag, template, extra flags, the DeepSpeed wrapper DeepSpeed 0.19 picks for it)
ENGINE_CASES = [
    ("--bf16", "zero1_bf16.json", [], "BF16_Optimizer"),  # fp32 grad accumulation, pipeline engine
    ("--bf16", "zero0_bf16.json", [], "BF16_Optimizer"),  # bf16 grad accumulation, pipeline engine
    ("--bf16", "zero2_bf16.json", ["--no-pipeline-parallel"], "DeepSpeedZeroOptimizer"),
    ("", "zero0_bf16.json", [], "GuardedOptimizer"),  # fp32: torch AdamW in the NaN guard
]


def test_parameter_state_matches_real_engines(tmp_path):
    argvs = []
    for i, (precision, template, extra, _) in enumerate(ENGINE_CASES):
        config = json.loads((REPO / "ds_configs" / template).read_text())
        if not precision:  # an fp32 run: the template's bf16 block would contradict the command line
            config.pop("bf16", None)
        for key in ("reduce_bucket_size", "allgather_bucket_size"):  # small buckets for a tiny model
            if key in config.get("zero_optimization", {}):
                config["zero_optimization"][key] = 50000
        path = tmp_path / f"ds{i}.json"
        path.write_text(json.dumps(config))
        argvs.append(TINY + ["--deepspeed_config", str(path), "--distributed-backend", "gloo"] + extra
                     + ([precision] if precision else []))
    # DP = 2: ZeRO's partitioned states are halved, replicated ones are not
    per_rank = run_distributed(_measure_engines, 2, argvs, timeout=900)
    for rank_results in per_rank:
        for (measured, estimated, path_name, optimizer_class), case in zip(rank_results, ENGINE_CASES):
            assert optimizer_class == case[3], (case, optimizer_class)
            expected_path = {"BF16_Optimizer": "DeepSpeed BF16_Optimizer", "GuardedOptimizer": "torch AdamW, fp32",
                             "DeepSpeedZeroOptimizer": "DeepSpeed ZeRO stage 2"}[optimizer_class]
            assert path_name == expected_path
            # 5%: measured exceeds the estimate by 0-2.3% here: the last micro-batch's pipeline
            # buffers, the loss, the LR scheduler's and loss scaler's scalars, small communication
            # tensors and the alignment padding of DeepSpeed's flat buffers, left out by the estimate.
            assert measured == pytest.approx(estimated, rel=0.05), (case, measured, estimated)


# Peaks of torch.cuda.max_memory_allocated measured on an H200 by `make gpu-report` (2026-11-26,
# bench/RESULTS.md: bf16, seq 2048, micro batch 4, one GPU, the pipeline engine at PP 1, GiB; the
# same with and without compiled layers), for the command lines of bench/gpu_mfu.py.
H200_PEAKS_GIB = {"gpt-1.3b": 34.1, "llama-1.3b": 35.7}


@pytest.mark.parametrize("model", list(H200_PEAKS_GIB))
def test_estimate_is_within_ten_percent_of_the_measured_gpu_peak(model, bench):
    """Never below the measured peak, at most 10% above it (without the runtime reserve, which is no
    tensor): the peak is backward's start, where the gradients made for the optimizer step do not
    exist yet, and the fused RoPE and SwiGLU keep less than their unfused paths."""
    SHAPES, our_argv = bench("gpu_mfu").SHAPES, bench("gpu_mfu").our_argv

    _, layout = _layout(our_argv(SHAPES[model], 2048, 4, 12, False, "bf16"), 1)
    est = estimate_memory(layout)
    tensors = (est.total - dict(est.terms)["runtime reserve"]) / 2 ** 30
    peak = H200_PEAKS_GIB[model]
    assert peak <= tensors <= 1.1 * peak, (tensors, peak, est.describe())
    assert est.peak_at == "backward" and est.not_at_once > 0


def test_the_peak_is_the_optimizer_step_where_activations_are_small():
    """A 1.3B GPT with 64-token sequences: its activations and logits are smaller than the gradients
    the step makes (bf16 .grad + their fp32 partitions), so those set the peak, without activations."""
    _, layout = _layout(_gpt_flags(24, 2048, 16, 64, 1, 1) + ["--bf16"], 1)
    est = estimate_memory(layout)
    terms = dict(est.terms)
    assert est.peak_at == "optimizer step"
    step_grads = terms["gradients"] - layout.total_params * 2  # the BF16 wrapper's accumulation buffer stays
    assert step_grads == pytest.approx(layout.total_params * (2 + 4))
    tensors = est.total - terms["runtime reserve"]
    assert tensors == pytest.approx(terms["weights"] + terms["optimizer states"] + terms["gradients"])
    assert "never exist at once" in est.describe()


# --------------------------------------------------------------------------- measured on GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_estimate_bounds_cuda_peak():
    """The full estimate (minus the runtime reserve, which is not tensors) against the peak of
    torch.cuda.max_memory_allocated over a few steps of a small model on one GPU."""
    argv = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --micro-batch-size 4 "
            "--global-batch-size 8 --train-iters 3 --lr 1e-4 --mock-data --vocab-size 8000 --num-workers 0 "
            "--bf16 --deepspeed_config ds_configs/zero1_bf16.json --log-interval 1 --eval-iters 0").split()
    results = run_distributed(_cuda_peak, 1, argv, timeout=600, env=cuda_env())
    peak, estimate = results[0]
    # The activation term is what the layers keep with fused attention (measured on the CPU by
    # test_activation_term_is_what_a_layer_saves); the logits term counts the cross entropy's fp32
    # copies, which outlive the backward's one-layer-at-a-time temporaries: an upper bound within 2x.
    assert estimate * 0.5 <= peak <= estimate, (peak, estimate)


def _cuda_peak(rank, world_size, argv):
    import contextlib
    import io

    from megatron_ds.families import pretrain

    cfg, ignored = parse_args(argv)
    # the rank's GPU made current (as pretrain does again) before its statistics are touched: a
    # child without a current device fails in reset_peak_memory_stats ("invalid argument")
    device = select_device(rank, world_size)
    assert device.type == "cuda", "this child sees no GPU: run_distributed needs env=cuda_env()"
    torch.cuda.reset_peak_memory_stats(device)
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(cfg, ignored)
    peak = torch.cuda.max_memory_allocated(device)
    _, layout = _layout(argv, 1)
    est = estimate_memory(layout)
    return peak, est.total - dict(est.terms)["runtime reserve"]


MOE_LAYER_CASES = {
    "gpt_top2": ["--num-experts", "8", "--topk", "2"],
    "residual_top1": ["--num-experts", "4", "--mlp-type", "residual"],
    "swiglu_top2": ["--num-experts", "8", "--topk", "2", "--swiglu", "--ffn-hidden-size", "688",
                    "--disable-bias-linear", "--hidden-dropout", "0", "--no-bias-swiglu-fusion"],  # the CPU's path
    "capacity_2": ["--num-experts", "16", "--moe-train-capacity-factor", "2"],  # twice the slots tokens need
}


@pytest.mark.parametrize("case", list(MOE_LAYER_CASES))
def test_moe_activation_term_is_what_an_moe_layer_saves(case):
    """An MoE layer (DeepSpeed's MoE around our expert MLP, one process) against the estimate, measured
    as the dense layer above: the experts' MLP activations over their capacity slots, the dispatched tokens, the
    gate's fp32 input, each token's k expert outputs, PR-MoE's residual MLP."""
    from megatron_ds.model.transformer import ParallelTransformerLayer
    from megatron_ds.parallel.random import set_parallel_seeds

    s, b, h, a = 256, 2, 256, 8
    flags = _gpt_flags(2, h, a, s, b, 2) + ["--bf16", "--attention-dropout", "0", "--expert-interval", "1",
                                            "--create-moe-param-group"] + MOE_LAYER_CASES[case]
    _, layout = _layout(flags, 1)
    m, experts = layout.model, layout.model.num_experts[0]
    set_parallel_seeds(1, 0)
    # cast as training does (engine.build_module): DeepSpeed's residual coefficient is built in fp32
    layer = ParallelTransformerLayer(m, 1, params_dtype=torch.bfloat16, device="cpu", num_experts=experts)
    layer = layer.to(torch.bfloat16)
    measured = saved_bytes(layer, torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True))
    estimated = activation_bytes_per_layer(layout, recompute=None, experts=experts)
    # left out: the routing's index and per-token scalars (int64 [tokens, k] and such), the norms' mean/rstd;
    # and a top-1 gate saves a little less than the formula's top-k terms: within 3%
    assert measured == pytest.approx(estimated, rel=0.03), (measured / (s * b * h), estimated / (s * b * h))
    assert estimated > 1.6 * activation_bytes_per_layer(layout, recompute=None)  # far more than a dense layer


MLM_MOE_LAYER_CASES = {
    "gelu_top2": ["--num-experts", "8", "--moe-router-topk", "2"],
    "swiglu_fine_shared": ["--num-experts", "16", "--moe-router-topk", "4", "--swiglu", "--moe-ffn-hidden-size", "256",
                           "--moe-shared-expert-intermediate-size", "512", "--disable-bias-linear",
                           "--hidden-dropout", "0", "--no-bias-swiglu-fusion"],
    "capacity_padded": ["--num-experts", "8", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.5",
                        "--moe-pad-expert-input-to-capacity"],
}


@pytest.mark.parametrize("case", list(MLM_MOE_LAYER_CASES))
def test_megatron_lm_moe_activation_term_is_what_its_layer_saves(case):
    """Megatron-LM's MoE layer (model/mlm_moe.py, one process) against the estimate, measured as above: per route
    the permuted input and the expert MLP's tensors, the router's fp32 logits, the shared expert's MLP."""
    from megatron_ds.model.transformer import ParallelTransformerLayer
    from megatron_ds.parallel.random import set_parallel_seeds

    s, b, h, a = 256, 2, 256, 8
    flags = _gpt_flags(2, h, a, s, b, 2) + ["--bf16", "--attention-dropout", "0"] + MLM_MOE_LAYER_CASES[case]
    _, layout = _layout(flags, 1)
    m, experts = layout.model, layout.model.num_experts[0]
    set_parallel_seeds(1, 0)
    layer = ParallelTransformerLayer(m, 1, params_dtype=torch.bfloat16, device="cpu", num_experts=experts)
    measured = saved_bytes(layer, torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True))
    estimated = activation_bytes_per_layer(layout, recompute=None, experts=experts)
    # left out: the routing's indices, probabilities and masks ([tokens, experts] and [routes] scalars)
    assert measured == pytest.approx(estimated, rel=0.05), (measured / (s * b * h), estimated / (s * b * h))
