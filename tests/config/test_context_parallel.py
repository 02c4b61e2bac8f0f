"""--context-parallel-size / --cp-comm-type: the layout they resolve to, --dry-run's report, the memory
estimate's share of the sequence, and every combination refused in one line (config/validation.py
``check_context_parallel``; Megatron-LM's own conditions: megatron/training/arguments.py validate_args)."""
import pytest

from megatron_ds.families import main
from megatron_ds.config import parse_args, resolve
from megatron_ds.config.memory import activation_bytes_per_layer, logits_bytes
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3").split()


def make(*extra, world=1):
    cfg, _ = parse_args(BASE + list(extra))
    return resolve(cfg, world_size=world, vocab_size=1000, ds_template=None, device_type="cpu", family=GPT)


def test_cp_splits_the_world_and_deepspeed_counts_dp_times_cp_ranks():
    layout = make("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--global-batch-size", "8",
                  world=8).layout
    assert (layout.tp, layout.cp, layout.dp, layout.grad_accum_steps) == (2, 2, 2, 2)
    # DeepSpeed's data parallel ranks are DP x CP = 4: it checks train_batch_size = micro 2 x 2 steps x 4
    assert layout.ds_config["train_batch_size"] == 16 and layout.global_batch_size == 8
    assert "TP 2 x PP 1 x CP 2 (context parallel, p2p) x DP 2" in layout.summary()
    assert make("--context-parallel-size", "2", "--cp-comm-type", "all_gather", world=2).layout.cp_comm_type == \
        "all_gather"
    flash = make("--context-parallel-size", "2", "--cp-block-kernel", "flash", world=2).layout
    assert flash.cp_block_kernel == "flash" and "CP 2 (context parallel, p2p, flash blocks)" in flash.summary()


def test_dry_run_prints_the_cp_layout(capsys):
    rc = main(BASE + ["--mock-data", "--vocab-size", "1000", "--dry-run", "--world-size", "8",
                      "--context-parallel-size", "4", "--global-batch-size", "4"])
    assert rc == 0
    assert "world size 8 = TP 1 x PP 1 x CP 4 (context parallel, p2p) x DP 2" in capsys.readouterr().out


def test_memory_estimate_counts_this_ranks_share_of_the_sequence():
    """Each CP rank keeps the activations of seq / CP tokens: the per-layer term and the logits at CP 4 are
    those of a CP 1 run at a quarter of the sequence (the same tokens per rank)."""
    cp4 = make("--context-parallel-size", "4", "--seq-length", "64", "--max-position-embeddings", "64",
               world=4).layout
    cp1 = make("--seq-length", "16", world=1).layout
    assert activation_bytes_per_layer(cp4, recompute=None) == activation_bytes_per_layer(cp1, recompute=None)
    assert logits_bytes(cp4) == logits_bytes(cp1)


@pytest.mark.parametrize("extra,says", [
    (["--seq-length", "30", "--max-position-embeddings", "32"], "--seq-length 30 is not a multiple of 2 x"),
    (["--cp-comm-type", "a2a"], "use --ds-sequence-parallel-size N instead"),
    (["--cp-comm-type", "a2a+p2p"], "hierarchical context parallelism is not built"),
    (["--hierarchical-context-parallel-sizes", "1", "2"], "hierarchical context parallelism is not built"),
    (["--cp-comm-type", "p2p", "all_gather"], "one kind runs in every layer"),
    (["--ds-sequence-parallel-size", "2", "--no-pipeline-parallel"], "DeepSpeed-Ulysses and context parallelism"),
    (["--num-experts", "2", "--topk", "2"], "DeepSpeed-MoE layers"),
])
def test_refused_in_one_line(extra, says):
    world = 4 if {"--pipeline-model-parallel-size", "--ds-sequence-parallel-size",
                  "--tensor-model-parallel-size"} & set(extra) else 2
    with pytest.raises(ConfigError, match="context") as err:
        make("--context-parallel-size", "2", *extra, world=world)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_megatron_lms_moe_with_sequence_parallel_resolves():
    """Megatron-LM's MoE at TP 2 x CP 2 with --sequence-parallel (Megatron-LM allows it: its router reduces over the
    tp_cp group) and whole experts over all four ranks (EP 4 x ETP 1 tiles TP x DP x CP; Megatron-LM's default ETP
    = TP would need 8 ranks)."""
    layout = make("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--num-experts", "4", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                  world=4).layout
    assert (layout.tp, layout.cp, layout.dp, layout.ep) == (2, 2, 1, 4)


def test_upstream_llama3_script_at_cp2_passes_dry_run(tmp_path):
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (tests/config/megatron_lm_scripts.py) with
    --context-parallel-size 2 instead of its 1 passes with the CP layout (8 GPUs: TP 1 x CP 2 x DP 4), its FP8
    flags included."""
    from tests.config.test_megatron_lm_scripts import _script
    from tests.config.test_megatron_scripts import _files, dry_run

    script = _script(tmp_path, "llama3_8b_h100_fp8")
    argv = list(script.argv)
    argv[argv.index("--context-parallel-size") + 1] = "2"
    rc, out, err = dry_run(type(script)(script.name, script.world, argv), _files(tmp_path, write_data=False))
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "TP 1 x PP 1 x CP 2 (context parallel, p2p) x DP 4" in out


def _saved_by_a_cp_layer(rank, world_size, flags):
    """(bytes one bf16 transformer layer keeps for backward on this CP rank, the estimate's per-layer term)."""
    import torch

    from megatron_ds.model.transformer import ParallelTransformerLayer
    from megatron_ds.parallel.context_parallel import ContextParallel
    from megatron_ds.parallel.random import set_parallel_seeds
    from tests.config.test_memory import _layout, saved_bytes

    _, layout = _layout(flags, world_size)
    set_parallel_seeds(1, 0)
    m = layout.model
    cp = ContextParallel(torch.distributed.group.WORLD, "p2p") if world_size > 1 else None
    layer = ParallelTransformerLayer(m, 1, params_dtype=torch.bfloat16, device="cpu", cp=cp)
    x = torch.randn(m.seq_length // world_size, layout.micro_batch_size, m.hidden_size, dtype=torch.bfloat16,
                    requires_grad=True)
    return saved_bytes(layer, x), activation_bytes_per_layer(layout, recompute=None)


@pytest.mark.parametrize("case,cp", [("gpt", 4), ("llama_like", 2)])
def test_a_cp_layer_keeps_its_share_of_the_activations(case, cp):
    """What autograd keeps of one bf16 layer (saved-tensor hooks, tests/config/test_memory.py's measurement)
    on each CP rank: 1/CP of the CP 1 layer's (the ring keeps only its own q, k, v, output and LSE), and what
    the estimate says, within test_memory.py's 1.5% (norm statistics and RoPE tables it leaves out)."""
    from tests.config.test_memory import LAYER_CASES, _gpt_flags
    from tests.distributed import run_distributed

    s, b, h, a = 256, 2, 256, 8
    got = {}
    for n in (1, cp):
        flags = _gpt_flags(2, h, a, s, b, 2 * n) + ["--bf16", "--attention-dropout", "0",
                                                    "--context-parallel-size", str(n)] + LAYER_CASES[case]
        got[n] = run_distributed(_saved_by_a_cp_layer, n, flags, timeout=120)
    (whole, _), = got[1]
    for measured, estimate in got[cp]:
        assert measured == pytest.approx(estimate, rel=0.015)
        assert measured == pytest.approx(whole / cp, rel=0.02)


@pytest.mark.slow
def test_at_32k_tokens_a_cp4_rank_keeps_a_quarter_of_the_activations():
    """Issue 46's long-sequence check: one bf16 layer of a tiny model (hidden 16, one head: the ring's math path
    on the CPU computes 8k x 8k blocks, the cost that sets the size) at sequence 32,768. What autograd keeps on
    each CP 4 rank is a quarter of the CP 1 layer's, measured (saved-tensor hooks) and estimated, within 10%;
    and the estimate equals the measurement within 1.5% (test_memory.py's bound) on every rank."""
    from tests.config.test_memory import _gpt_flags
    from tests.distributed import run_distributed

    s, b, h, a = 32768, 1, 16, 1
    got = {}
    for n in (1, 4):
        flags = _gpt_flags(2, h, a, s, b, n) + ["--bf16", "--attention-dropout", "0", "--max-position-embeddings",
                                                 str(s), "--context-parallel-size", str(n)]
        got[n] = run_distributed(_saved_by_a_cp_layer, n, flags, timeout=600)
    (whole, whole_estimate), = got[1]
    for measured, estimate in got[4]:
        assert measured == pytest.approx(whole / 4, rel=0.1) and estimate == pytest.approx(whole_estimate / 4, rel=0.1)
        assert measured == pytest.approx(estimate, rel=0.015)
    assert whole == pytest.approx(whole_estimate, rel=0.015)


def test_the_planner_evaluates_a_context_parallel_command_line():
    """The planner models CP layouts (issue 46, planner/time_model.py): a CP command line is planned as its own
    layout, CP included, not refused and not as if CP were 1."""
    from megatron_ds.families import get_family
    from megatron_ds.planner import plan_cli

    argv = BASE + ["--vocab-size", "1000", "--context-parallel-size", "2", "--gpu-type", "h100", "--gpus", "8"]
    request, flags, _ = plan_cli.request_of(argv, get_family("gpt"), "plan.py")
    yours, line = plan_cli.your_layout(request, flags)
    assert yours.knobs.cp == 2 and yours.layout.cp == 2 and " CP 2," in line


def test_mla_at_cp2_passes_dry_run(capsys):
    """DeepSeek's multi-latent attention with --context-parallel-size 2 (Megatron-LM runs it: megatron/core/transformer/
    multi_latent_attention.py refuses only hybrid CP): the layout, and the memory estimate's seq / CP tokens."""
    mla = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 12 --position-embedding-type rope --normalization rmsnorm").split()
    rc = main(BASE + mla + ["--mock-data", "--vocab-size", "1000", "--dry-run", "--world-size", "4",
                            "--context-parallel-size", "2", "--global-batch-size", "4"])
    assert rc == 0
    assert "world size 4 = TP 1 x PP 1 x CP 2 (context parallel, p2p) x DP 2" in capsys.readouterr().out
    cp2 = make(*mla, "--context-parallel-size", "2", "--seq-length", "64", "--max-position-embeddings", "64", world=2)
    cp1 = make(*mla, world=1)
    assert activation_bytes_per_layer(cp2.layout, recompute=None) == activation_bytes_per_layer(cp1.layout,
                                                                                                recompute=None)
