"""Real Megatron-DeepSpeed GPT launch scripts, transcribed: their flags and the DeepSpeed JSON they
generate, with the shell variables resolved as each script resolves them. Only the vocabulary,
merges and data paths are replaced (test fixtures); the world size is what the script launches
(or, where the script counts GPUs at run time, a size its layout divides).

Sources (repository: path):
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/rebase/ds_pretrain_gpt_{125M,13B,1.3B_rope_slw,
      1.3B_megatron_checkpointing}.sh with rebase/ds_config_gpt_TEMPLATE.json / ds_config_gpt_slw_TEMPLATE.json
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/universal_checkpointing/megatron_gpt/run_{bf16,fp16}.sh,
      run_universal_bf16.sh
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/ds_pretrain_gpt_{350M,1.3B,6.7B}_dense.sh,
      ds_pretrain_gpt_1.3B_dense_cl.sh, ds_pretrain_gpt_125M_MoE64.sh, ds_pretrain_gpt_350M_PR-MoE32or64.sh
      (+ MoE/ds_config_gpt_TEMPLATE.json)
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/rebase/ds_pretrain_gpt_{125M_flashattn,1.3B_rope}.sh
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/zero_bubble_pp/zbh1_pretrain_gpt_1.3b.sh
  deepspeedai/Megatron-DeepSpeed: examples_deepspeed/offload_pp/ds_pretrain_gpt_350M.sh (+ its JSON template)
  deepspeedai/Megatron-DeepSpeed: examples/pretrain_gpt.sh, examples/pretrain_gpt_distributed_with_mp.sh,
      examples/pretrain_gpt3_175B.sh
  llm-jp/Megatron-DeepSpeed: scripts/abci/1.3B/dp2_tp2_pp2_zero1.sh (ABCI, mpirun, W&B flags)
  okoge-kaz/megatron-deepspeed-turing-techblog: scripts/abci/350m/dp2_tp2_pp2_zero1.sh (ABCI, mpirun)
  kojimano/Megatron-DeepSpeed-ABCI (a3fbb95): abci/shells/pretrain_gpt_{345m_64gpu_sp_identity_debug_abci,
      13b_544gpu_commonspace_start}.sh (ABCI Grand Challenge, Grid Engine + mpirun, no DeepSpeed JSON,
      --tokenizer-type JapaneseSentencePiece with the SentencePiece model as --vocab-file)

This module imports nothing from megatron_ds so a before/after count can run it against any tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Script:
    name: str
    source: str  # repository: path
    world: int
    argv: list[str]
    ds_json: dict | None = None
    refused: str | None = None  # expected one-line refusal (regex) where the feature is out of scope
    notes: list[str] = field(default_factory=list)  # warnings the run must print (substrings)


def _rebase_template(gbs, mbs, log, zero, prescale, *, cl=None, bf16=False) -> dict:
    """examples_deepspeed/rebase/ds_config_gpt_TEMPLATE.json after the scripts' sed (llm-jp's _bf16 variant)."""
    ds = {"train_batch_size": gbs, "train_micro_batch_size_per_gpu": mbs, "steps_per_print": log,
          "zero_optimization": {"stage": zero}, "gradient_clipping": 1.0, "prescale_gradients": prescale,
          "wall_clock_breakdown": False}
    if bf16:
        ds["zero_optimization"]["elastic_checkpoint"] = False
        ds.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    else:
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                      "min_loss_scale": 1, "initial_scale_power": 11}
    if cl is not None:  # ds_config_gpt_slw_TEMPLATE.json
        ds["curriculum_learning"] = {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": cl[0], "max_difficulty": cl[1],
            "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": cl[2], "difficulty_step": 8}}
    return ds


def _rebase(files, *, layers, hidden, heads, gbs, lr, min_lr, init_std, mp, pp, no_pp, zero, batch,
            seq=2048, precision="--fp16", checkpoint_activations=True, log_interval=10, save_interval=100,
            eval_iters=10, eval_interval=100, ds_extra=(), extra=(), tail=()) -> list[str]:
    """The megatron_options / data_options / deepspeed_options of the rebase script family."""
    train_tokens = 300 * 10 ** 9
    argv = ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", str(mp), "--init-method-std", str(init_std),
            "--lr-decay-tokens", str(train_tokens), "--lr-warmup-tokens", str(3000 * 10 ** 6),
            "--micro-batch-size", str(batch), "--exit-duration-in-mins", "30000000",
            "--global-batch-size", str(gbs), "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--train-tokens", str(train_tokens), "--train-samples", str(300 * 10 ** 9 * 2 // seq),
            "--lr", lr, "--min-lr", min_lr, "--lr-decay-style", "cosine", "--split", "949,50,1",
            "--log-interval", str(log_interval), "--eval-interval", str(eval_interval), "--eval-iters",
            str(eval_iters), "--save-interval", str(save_interval), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--hysteresis", "2", "--num-workers", "0", *extra, precision, "--seed", "1234",
            "--load", files["ckpt"], "--save", files["ckpt"], "--no-async-tensor-model-parallel-allreduce",
            *tail, "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
            "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", files["tb"]]
    if checkpoint_activations:
        argv.append("--checkpoint-activations")
    argv.append("--log-optimizer-states-to-tensorboard")
    argv += ["--vocab-file", files["vocab"], "--merge-file", files["merges"], "--data-path", files["data"],
             "--data-impl", "mmap"]
    argv += ["--deepspeed", "--deepspeed_config", files["json"], "--zero-stage", str(zero),
             "--pipeline-model-parallel-size", str(pp), *ds_extra]
    if no_pp:
        argv.append("--no-pipeline-parallel")
    if checkpoint_activations:
        argv.append("--deepspeed-activation-checkpointing")
    return argv


def _universal(files, dtype: str, *, resume: bool = False) -> list[str]:
    """universal_checkpointing/megatron_gpt/run_{bf16,fp16}.sh, DEBUG_MODE=1, TP=PP=DP=2, SP=1;
    ``resume``: run_universal_bf16.sh (DP=1, GLOBAL_BATCH=4, --universal-checkpoint)."""
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--ds-sequence-parallel-size", "1", "--num-layers", "4", "--hidden-size", "512",
            "--num-attention-heads", "32", "--seq-length", "512", "--loss-scale", "12",
            "--max-position-embeddings", "512", "--micro-batch-size", "2",
            "--global-batch-size", "4" if resume else "16",
            "--train-iters", "100000", "--lr", "6.0e-3", "--min-lr", "6.0e-4", "--lr-decay-style", "cosine",
            "--log-interval", "1", "--eval-iters", "40", "--eval-interval", "10", "--data-path", files["data"],
            "--vocab-file", files["vocab"], "--merge-file", files["merges"], "--save-interval", "100",
            "--split", "98,2,0", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
            "--adam-beta2", "0.95", "--init-method-std", "0.006", f"--{dtype}", "--checkpoint-activations",
            "--exit-interval", "200", "--save", files["ckpt"], "--load", files["ckpt"],
            "--make-vocab-size-divisible-by", "256", "--tensorboard-dir", files["tb"],
            "--deepspeed", f"--deepspeed_config={files['json']}", "--zero-stage=1",
            "--deepspeed-activation-checkpointing"] + (["--universal-checkpoint"] if resume else [])


def _universal_json(dtype: str, gbs: int = 16) -> dict:
    ds = {"train_batch_size": gbs, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
          "zero_optimization": {"stage": 1}, "wall_clock_breakdown": False}
    if dtype == "bf16":
        ds.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    else:
        ds.update(bf16={"enabled": False}, fp16={"enabled": True, "loss_scale": 0, "loss_scale_window": 50,
                                                 "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 12})
    return ds


def _megatron_example(files, *, distributed_mp: bool) -> list[str]:
    """examples/pretrain_gpt.sh and examples/pretrain_gpt_distributed_with_mp.sh."""
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"] \
        if distributed_mp else []
    argv += ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--micro-batch-size", "4",
             "--global-batch-size", "16" if distributed_mp else "8", "--lr", "0.00015", "--train-iters", "500000",
             "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5",
             "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0", "--fp16",
             "--data-path", files["data"], "--vocab-file", files["vocab"], "--merge-file", files["merges"],
             "--data-impl", "mmap", "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000",
             "--eval-interval", "1000", "--eval-iters", "10"]
    if distributed_mp:
        argv += ["--distributed-backend", "nccl"]
    return argv + ["--save", files["ckpt"], "--load", files["ckpt"]]


def _gpt3_175b(files) -> list[str]:
    """examples/pretrain_gpt3_175B.sh (three-way blend, batch-size ramp-up, old recompute flag)."""
    d = files["data"]
    return ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--num-layers", "96",
            "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536",
            "--rampup-batch-size", "16", "16", "5859375", "--train-samples", "146484375",
            "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105", "--lr", "6.0e-5",
            "--min-lr", "6.0e-6", "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-iters", "40",
            "--eval-interval", "1000", "--data-path", "0.2", d, "0.3", d, "0.5", d, "--vocab-file", files["vocab"],
            "--merge-file", files["merges"], "--save-interval", "1000", "--save", files["ckpt"],
            "--load", files["ckpt"], "--split", "98,2,0", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
            "--tensorboard-dir", files["tb"], "--fp16", "--activations-checkpoint-method", "uniform"]


def _moe_dense(files, *, layers, hidden, heads, gbs, lr, min_lr, batch, mp, init_std, rampup) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_{350M,1.3B,6.7B}_dense.sh (EP_SIZE=1, CL_ENABLED=false, 64 GPUs)."""
    return ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", str(mp), "--moe-expert-parallel-size", "1", "--num-experts", "1",
            "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0",
            "--moe-min-capacity", "4", "--init-method-std", str(init_std), "--lr-decay-tokens", "260000000000",
            "--lr-warmup-tokens", "375000000", "--micro-batch-size", str(batch), "--exit-duration-in-mins", "30000000",
            *(["--rampup-batch-size", *rampup] if rampup else []), "--global-batch-size", str(gbs),
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--train-tokens", "300000000000",
            "--train-samples", "439453125", "--lr", lr, "--min-lr", min_lr, "--lr-decay-style", "cosine",
            "--split", "98,2,0",
            "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "10", "--save-interval", "1000",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16",
            "--load", files["ckpt"], "--save", files["ckpt"], "--tensorboard-queue-size", "1",
            "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
            "--tensorboard-dir", files["tb"], "--checkpoint-activations",  # MOE_DROP_TOKEN=true: no token flag
            "--vocab-file", files["vocab"], "--merge-file", files["merges"], "--data-path", files["data"],
            "--data-impl", "mmap", "--deepspeed", "--deepspeed_config", files["json"],
            "--pipeline-model-parallel-size", "1", "--deepspeed-activation-checkpointing"]


def _moe_125m_moe64(files) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh as written: EP_SIZE=64 experts,
    EP_PARALLEL_SIZE = min(EP_SIZE, NUM_GPUS) = 64 on 64 GPUs, MLC 0.01, capacity factors 1.0, min capacity 4,
    MOE_DROP_TOKEN=true (no --disable-moe-token-dropping), ACTIVATION_CHECKPOINT=true, MP 1, PP 1 with
    --no-pipeline-parallel ("Currently MoE is not compatible with pipeline parallel"), ZeRO 0, fp16;
    TRAIN_ITERS = 300e9 x 3 / 256 / 2048 in bash integers."""
    return ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", "1", "--moe-expert-parallel-size", "64", "--num-experts", "64",
            "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0",
            "--moe-min-capacity", "4", "--init-method-std", "0.014", "--lr-decay-tokens", "300000000000",
            "--lr-warmup-tokens", "375000000", "--micro-batch-size", "4", "--exit-duration-in-mins", "30000000",
            "--global-batch-size", "256", "--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--train-tokens", "300000000000",
            "--train-iters", "1716613", "--lr", "4.5e-4", "--min-lr", "4.5e-06", "--lr-decay-style", "cosine",
            "--split", "98,2,0", "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "10",
            "--save-interval", "10000", "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2",
            "--num-workers", "0", "--fp16", "--load", files["ckpt"], "--save", files["ckpt"],
            "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
            "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", files["tb"], "--checkpoint-activations",
            "--create-moe-param-group",
            "--vocab-file", files["vocab"], "--merge-file", files["merges"], "--data-path", files["data"],
            "--data-impl", "mmap", "--deepspeed", "--deepspeed_config", files["json"],
            "--pipeline-model-parallel-size", "1", "--no-pipeline-parallel", "--deepspeed-activation-checkpointing"]


def _pr_moe_350m(files) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_350M_PR-MoE32or64.sh: PR-MoE (--mlp-type residual) with
    EP_SIZE="32 32 32 32 32 32 32 32 32 32 64 64" (one count per MoE layer: 24 layers, interval 2) and
    EP_PARALLEL_SIZE=NUM_GPUS=64, fp16, ZeRO 0, --no-pipeline-parallel."""
    return ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", "1", "--moe-expert-parallel-size", "64",
            "--num-experts", *["32"] * 10, "64", "64", "--moe-loss-coeff", "0.01", "--mlp-type", "residual",
            "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0", "--moe-min-capacity", "4",
            "--init-method-std", "0.014", "--lr-decay-tokens", "300000000000", "--lr-warmup-tokens", "375000000",
            "--micro-batch-size", "4", "--exit-duration-in-mins", "30000000", "--global-batch-size", "256",
            "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--train-tokens", "300000000000", "--train-iters", "1716613",
            "--lr", "3.0e-4", "--min-lr", "1.0e-06", "--lr-decay-style", "cosine", "--split", "98,2,0",
            "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "10", "--save-interval", "10000",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16",
            "--load", files["ckpt"], "--save", files["ckpt"], "--tensorboard-queue-size", "1",
            "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
            "--tensorboard-dir", files["tb"], "--checkpoint-activations", "--create-moe-param-group",
            "--vocab-file", files["vocab"], "--merge-file", files["merges"], "--data-path", files["data"],
            "--data-impl", "mmap", "--deepspeed", "--deepspeed_config", files["json"],
            "--pipeline-model-parallel-size", "1", "--no-pipeline-parallel", "--deepspeed-activation-checkpointing"]


def _moe_json(gbs, mbs, *, cl_enabled=False, cl_step=110916) -> dict:
    return {"train_batch_size": gbs, "train_micro_batch_size_per_gpu": mbs, "steps_per_print": 10,
            "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "prescale_gradients": True,
            "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                     "min_loss_scale": 1, "initial_scale_power": 11},
            "bf16": {"enabled": False},
            "curriculum_learning": {"enabled": cl_enabled, "curriculum_type": "seqlen", "min_difficulty": 80,
                                    "max_difficulty": 2048, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": cl_step, "difficulty_step": 8}},
            "wall_clock_breakdown": False}


def _moe_dense_cl(files) -> list[str]:
    """examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_dense_cl.sh: 128 GPUs, MP 2, NO_PP, ZeRO 0, micro 16,
    global 4096 ("CL enables stable large-batch training"), CL_ENABLED=true; no MoE flags at all."""
    return ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", "2", "--init-method-std", "0.013", "--lr-decay-tokens", "260000000000",
            "--lr-warmup-tokens", "375000000", "--micro-batch-size", "16", "--exit-duration-in-mins", "30000000",
            "--global-batch-size", "4096", "--num-layers", "24", "--hidden-size", "2048",
            "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--train-tokens", "300000000000", "--train-samples", "439453125", "--lr", "8.0e-4",
            "--min-lr", "2.0e-5", "--lr-decay-style", "cosine", "--split", "98,2,0", "--log-interval", "10",
            "--eval-interval", "100", "--eval-iters", "10", "--save-interval", "1000", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16", "--load", files["ckpt"],
            "--save", files["ckpt"], "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard",
            "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", files["tb"],
            "--checkpoint-activations", "--log-optimizer-states-to-tensorboard",
            "--vocab-file", files["vocab"], "--merge-file", files["merges"], "--data-path", files["data"],
            "--data-impl", "mmap", "--deepspeed", "--deepspeed_config", files["json"], "--zero-stage", "0",
            "--pipeline-model-parallel-size", "1", "--no-pipeline-parallel", "--deepspeed-activation-checkpointing"]


# the 15-way blend of both kojimano/Megatron-DeepSpeed-ABCI scripts (aozora, wikipedia en/ja, cc, github)
_ABCI_GC_WEIGHTS = ["1", "5", "5"] + ["12.125"] * 4 + ["9.125"] * 4 + ["1"] * 4


def _abci_grand_challenge(files, *, layers, hidden, heads, tp, pp, micro, gbs, train_samples, lr, min_lr,
                          rampup, init_std, attention_dropout, save_interval, eval_interval, seed) -> list[str]:
    """kojimano/Megatron-DeepSpeed-ABCI abci/shells/*.sh: mpirun ... python pretrain_gpt.py, as written (the 13B
    script, with a seed, names --train-samples before --save, the 345M one after --wandb-name)."""
    blend = [x for w in _ABCI_GC_WEIGHTS for x in (w, files["data"])]
    samples = ["--train-samples", str(train_samples)]
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--micro-batch-size", str(micro), "--global-batch-size", str(gbs), "--seq-length", "2048",
            "--max-position-embeddings", "2048", *(samples if seed is not None else []),
            "--save", files["ckpt"], "--load", files["ckpt"], "--tensorboard-dir", files["tb"],
            "--wandb-name", "gc-job", *(samples if seed is None else []),
            "--data-path", *blend, "--tokenizer-type", "JapaneseSentencePiece", "--vocab-file", files["spm"],
            "--data-impl", "mmap", "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", lr,
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--min-lr", min_lr,
            "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction", ".01",
            "--rampup-batch-size", *rampup, "--init-method-std", init_std, "--hidden-dropout", "0",
            "--attention-dropout", attention_dropout, "--weight-decay", "0.1", "--log-interval", "1",
            "--save-interval", str(save_interval), "--eval-interval", str(eval_interval), "--eval-iters", "10",
            *(["--seed", str(seed)] if seed is not None else []), "--fp16", "--checkpoint-activations",
            "--distribute-checkpointed-activations", "--no-scatter-gather-tensors-in-pipeline", "--use-mpi",
            "--log-timers-to-tensorboard"]


def _offload_pp_350m(files) -> list[str]:
    """examples_deepspeed/offload_pp/ds_pretrain_gpt_350M.sh (16 GPUs, EP_SIZE=1, ZeRO-3 optimizer offload)."""
    return ["--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--tensor-model-parallel-size", "1", "--moe-expert-parallel-size", "1", "--num-experts", "1",
            "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0",
            "--moe-min-capacity", "4", "--init-method-std", "0.014", "--lr-decay-tokens", "260000000000",
            "--lr-warmup-tokens", "375000000", "--micro-batch-size", "2", "--exit-duration-in-mins", "30000000",
            "--rampup-batch-size", "32", "32", "1953125", "--global-batch-size", "256", "--num-layers", "24",
            "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--train-tokens", "300000000000", "--train-samples", "439453125",
            "--lr", "3.0e-4", "--min-lr", "3.0e-5", "--lr-decay-style", "cosine", "--split", "98,2,0",
            "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "10", "--save-interval", "1000",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16",
            "--load", files["ckpt"], "--save", files["ckpt"], "--tensorboard-queue-size", "1",
            "--log-timers-to-tensorboard", "--timing-log-level", "1", "--no-pipeline-parallel", "--cpu-optimizer",
            "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", files["tb"],
            "--checkpoint-activations", "--vocab-file", files["vocab"], "--merge-file", files["merges"],
            "--data-path", files["data"], "--data-impl", "mmap", "--deepspeed", "--deepspeed_config", files["json"],
            "--pipeline-model-parallel-size", "1", "--deepspeed-activation-checkpointing"]


def _offload_json() -> dict:
    """offload_pp/ds_config_gpt_TEMPLATE.json as the script fills it: bf16 on although it passes --fp16."""
    return {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                    "ratio": 0.3}},
            "gradient_clipping": 1.0, "prescale_gradients": False,
            "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                     "min_loss_scale": 1, "initial_scale_power": 11},
            "bf16": {"enabled": True}, "wall_clock_breakdown": False}


def scripts(files: dict) -> list[Script]:
    """files: vocab, merges, data (prefix), ckpt, tb, json (where the case's DeepSpeed JSON is written),
    spm (a SentencePiece model trained with the ABCI fork's recipe, for JapaneseSentencePiece)."""
    f = files
    rb = "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/rebase/"
    return [
        Script("rebase_125M", rb + "ds_pretrain_gpt_125M.sh", 8, _rebase(
            f, layers=12, hidden=768, heads=12, gbs=256, lr="6.0e-4", min_lr="1.0e-6", init_std=0.02, mp=2, pp=2,
            no_pp=False, zero=1, batch=2), _rebase_template(256, 2, 10, 1, False)),
        Script("rebase_13B", rb + "ds_pretrain_gpt_13B.sh", 64, _rebase(
            f, layers=40, hidden=5120, heads=40, gbs=1024, lr="1.0e-4", min_lr="1.0e-6", init_std=0.008, mp=4,
            pp=8, no_pp=False, zero=1, batch=2), _rebase_template(1024, 2, 10, 1, False)),
        Script("rebase_1.3B_megatron_checkpointing", rb + "ds_pretrain_gpt_1.3B_megatron_checkpointing.sh", 8,
               _rebase(f, layers=24, hidden=2048, heads=16, gbs=512, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013,
                       mp=2, pp=1, no_pp=True, zero=0, batch=2), _rebase_template(512, 2, 10, 0, True)),
        Script("rebase_1.3B_rope_slw", rb + "ds_pretrain_gpt_1.3B_rope_slw.sh", 64, _rebase(
            f, layers=24, hidden=2048, heads=16, gbs=512, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013, mp=4, pp=8,
            no_pp=False, zero=1, batch=2, extra=["--use-rotary-position-embeddings", "--rotary-percent", "0.25"]),
            # cl_step = lr_warmup_tokens / 3 / global_batch_size / seq_len
            _rebase_template(512, 2, 10, 1, False, cl=(64, 2048, 3000 * 10 ** 6 // 3 // 512 // 2048)),
            notes=["sequence-length warm-up (fixed_linear): 64 -> 2048 over 953 steps in multiples of 8"]),
        Script("moe_family_1.3B_dense_cl", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_1.3B_dense_cl.sh", 128, _moe_dense_cl(f),
               # CL_STEP = CL_TOKENS 60e9 / (GLOBAL_BATCH_SIZE x CL_AVG_SEQLEN (80 + 2048) / 2), bash integers
               _moe_json(4096, 16, cl_enabled=True, cl_step=60 * 10 ** 9 // (4096 * ((80 + 2048) // 2))),
               notes=["sequence-length warm-up (fixed_linear): 80 -> 2048 over 13,767 steps in multiples of 8"]),
        Script("universal_ckpt_bf16", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/universal_checkpointing/"
               "megatron_gpt/run_bf16.sh", 8, _universal(f, "bf16"), _universal_json("bf16"),
               notes=["--loss-scale 12 has no effect without --fp16"]),
        Script("universal_ckpt_fp16", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/universal_checkpointing/"
               "megatron_gpt/run_fp16.sh", 8, _universal(f, "fp16"), _universal_json("fp16"),
               notes=['--loss-scale 12 has no effect with DeepSpeed', '"fp16.loss_scale" = 0']),
        Script("universal_ckpt_bf16_resume", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/"
               "universal_checkpointing/megatron_gpt/run_universal_bf16.sh", 4, _universal(f, "bf16", resume=True),
               _universal_json("bf16", 4), notes=["--loss-scale 12 has no effect without --fp16"]),
        Script("moe_family_1.3B_dense", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_1.3B_dense.sh", 64, _moe_dense(
                   f, layers=24, hidden=2048, heads=16, gbs=512, lr="2.0e-4", min_lr="2.0e-5", batch=2, mp=4,
                   init_std=0.014, rampup=("32", "32", "1953125")), _moe_json(512, 2),
               notes=['disabled legacy "curriculum_learning" block is dropped']),
        Script("moe_family_6.7B_dense", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_6.7B_dense.sh", 64, _moe_dense(
                   f, layers=32, hidden=4096, heads=32, gbs=1024, lr="1.2e-4", min_lr="1.2e-5", batch=4, mp=8,
                   init_std=0.01, rampup=("32", "32", "4882812")), _moe_json(1024, 4)),
        Script("moe_125M_MoE64", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_125M_MoE64.sh", 64, _moe_125m_moe64(f), _moe_json(256, 4),
               notes=['disabled legacy "curriculum_learning" block is dropped']),
        # 32 experts over EP 64: DeepSpeed before 0.7 lowered EP to a layer's expert count, its MoE asserts
        # divisibility since (deepspeed/moe/layer.py), so this script stops there on current DeepSpeed too
        Script("moe_350M_PR-MoE32or64", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_350M_PR-MoE32or64.sh", 64, _pr_moe_350m(f), _moe_json(256, 4),
               refused=r"--num-experts 32 is not divisible by --moe-expert-parallel-size 64.*before 0\.7"),
        Script("moe_family_350M_dense", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/MoE/"
               "ds_pretrain_gpt_350M_dense.sh", 64, _moe_dense(
                   f, layers=24, hidden=1024, heads=16, gbs=256, lr="3.0e-4", min_lr="3.0e-5", batch=4, mp=1,
                   init_std=0.014, rampup=None), _moe_json(256, 4)),
        Script("rebase_125M_flashattn", rb + "ds_pretrain_gpt_125M_flashattn.sh", 8, _rebase(
            f, layers=12, hidden=768, heads=12, gbs=256, lr="6.0e-4", min_lr="1.0e-6", init_std=0.02, mp=2, pp=2,
            no_pp=False, zero=1, batch=2, tail=["--use-flash-attn"]), _rebase_template(256, 2, 10, 1, False)),
        Script("rebase_1.3B_rope", rb + "ds_pretrain_gpt_1.3B_rope.sh", 64, _rebase(
            f, layers=24, hidden=2048, heads=16, gbs=512, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013, mp=4, pp=8,
            no_pp=False, zero=1, batch=2, extra=["--use-rotary-position-embeddings", "--rotary-percent", "0.25"]),
            _rebase_template(512, 2, 10, 1, False)),
        Script("megatron_pretrain_gpt", "deepspeedai/Megatron-DeepSpeed: examples/pretrain_gpt.sh", 1,
               _megatron_example(f, distributed_mp=False)),
        Script("megatron_pretrain_gpt_distributed_with_mp", "deepspeedai/Megatron-DeepSpeed: "
               "examples/pretrain_gpt_distributed_with_mp.sh", 8, _megatron_example(f, distributed_mp=True)),
        Script("megatron_gpt3_175B", "deepspeedai/Megatron-DeepSpeed: examples/pretrain_gpt3_175B.sh", 1024,
               _gpt3_175b(f)),
        Script("abci_llm_jp_1.3B_dp2_tp2_pp2", "llm-jp/Megatron-DeepSpeed: scripts/abci/1.3B/dp2_tp2_pp2_zero1.sh", 8,
               _rebase(f, layers=24, hidden=2048, heads=16, gbs=512, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013,
                       mp=2, pp=2, no_pp=False, zero=1, batch=1, precision="--bf16", checkpoint_activations=False,
                       log_interval=1, save_interval=50,
                       extra=["--distributed-backend", "nccl"],
                       tail=["--use-rotary-position-embeddings", "--rotary-percent", "0.25", "--use-flash-attn"],
                       ds_extra=[]) + ["--use-mpi", "--wandb-entity", "okoge", "--wandb-project",
                                       "megatron-deepspeed-loss-spike", "--wandb-name", "1.3B-job"],
               _rebase_template(512, 1, 1, 1, False, bf16=True)),
        Script("abci_okoge_350m_dp2_tp2_pp2", "okoge-kaz/megatron-deepspeed-turing-techblog: "
               "scripts/abci/350m/dp2_tp2_pp2_zero1.sh", 8,
               _rebase(f, layers=24, hidden=1024, heads=16, gbs=256, lr="3.0e-4", min_lr="1.0e-6", init_std=0.018,
                       mp=2, pp=2, no_pp=False, zero=1, batch=1, checkpoint_activations=False, log_interval=1,
                       extra=["--distributed-backend", "nccl"]) + ["--use-mpi", "--wandb-name", "mpirun-job"],
               _rebase_template(256, 1, 1, 1, False)),
        Script("sequence_parallel_1.3B_32k", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/sequence_parallel/"
               "ds_pretrain_gpt_1.3B_seq_parallel_32k.sh", 8,
               _rebase(f, layers=24, hidden=2048, heads=16, gbs=2, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013,
                       mp=1, pp=1, no_pp=True, zero=1, batch=1, seq=32768,
                       extra=["--ds-sequence-parallel-size", "4"], tail=["--use-flash-attn-triton"]),
               _rebase_template(2, 1, 10, 1, False)),
        Script("offload_pp_350M", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/offload_pp/"
               "ds_pretrain_gpt_350M.sh", 16, _offload_pp_350m(f), _offload_json(),
               notes=['--fp16 gives way to the DeepSpeed JSON\'s "bf16": {"enabled": true}']),
        Script("abci_gc_345m_64gpu_japanese_sp", "kojimano/Megatron-DeepSpeed-ABCI: "
               "abci/shells/pretrain_gpt_345m_64gpu_sp_identity_debug_abci.sh", 64, _abci_grand_challenge(
                   f, layers=24, hidden=1024, heads=16, tp=1, pp=1, micro=4, gbs=1280, train_samples=64000000,
                   lr="0.0001", min_lr="1.0e-5", rampup=("256", "256", "50000"), init_std="0.018",
                   attention_dropout="0", save_interval=500, eval_interval=100, seed=None)),
        Script("abci_gc_13b_544gpu_japanese_sp", "kojimano/Megatron-DeepSpeed-ABCI: "
               "abci/shells/pretrain_gpt_13b_544gpu_commonspace_start.sh", 544, _abci_grand_challenge(
                   f, layers=40, hidden=5120, heads=40, tp=4, pp=8, micro=2, gbs=1360, train_samples=68000000,
                   lr="6e-5", min_lr="6e-6", rampup=("68", "68", "3400000"), init_std="0.00884",
                   attention_dropout="0.1", save_interval=1000, eval_interval=250, seed=7)),
        Script("zero_bubble_zbh1_1.3b", "deepspeedai/Megatron-DeepSpeed: examples_deepspeed/zero_bubble_pp/"
               "zbh1_pretrain_gpt_1.3b.sh", 8,
               _rebase(f, layers=24, hidden=2048, heads=16, gbs=16, lr="2.0e-4", min_lr="1.0e-6", init_std=0.013,
                       mp=1, pp=8, no_pp=False, zero=0, batch=1, checkpoint_activations=False, log_interval=1,
                       eval_iters=10100, eval_interval=10100, save_interval=10100,
                       ds_extra=["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]),
               _rebase_template(16, 1, 1, 0, True)),
    ]
