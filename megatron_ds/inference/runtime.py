"""What the inference CLIs share: process group and device, the weights (a checkpoint saved at any
TP / PP, or a Hugging Face export), the tokenizer, and the flags for all of these.

Under a launcher (torchrun, deepspeed, mpirun with ``--use-mpi``) every process is one tensor
parallel rank: the world size is the tensor parallel size. Only rank 0 prints and writes files.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.accelerator import on_cuda
from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from megatron_ds.data.tokenizer import build_tokenizer, tokenizer_options
from megatron_ds.errors import ConfigError
from megatron_ds.inference.model import InferenceModel, ModelWeights, build_inference_model
from megatron_ds.launch.env import apply_dist_env, discover_dist_env
from megatron_ds.parallel.utils import PRECISION_DTYPES


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="checkpoint directory written by pretrain_gpt.py --save (any TP / PP)")
    src.add_argument("--hf-model", help="directory of a Hugging Face export (tools/checkpoint/to_hf.py)")
    g.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    g.add_argument("--dtype", choices=tuple(PRECISION_DTYPES), default=None,
                   help="compute precision (default: bf16 on a GPU that supports it, else fp32)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: this rank's GPU if any)")
    g.add_argument("--use-mpi", action="store_true", help="take rank/world from Open MPI or PMI (mpirun)")
    g = p.add_argument_group("tokenizer (default: what the checkpoint was trained with)")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)


# Megatron's network-size flags (megatron/arguments.py, _add_network_size_args) that its
# tasks/main.py command lines repeat for a checkpoint (examples/evaluate_zeroshot_gpt.sh passes
# --num-layers --hidden-size --num-attention-heads --seq-length --max-position-embeddings with
# --load). Here the checkpoint records the model, so they are checks: a mismatch is an error.
SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "num_attention_heads": "--num-attention-heads", "num_key_value_heads": "--num-key-value-heads",
               "ffn_hidden_size": "--ffn-hidden-size", "max_position_embeddings": "--max-position-embeddings"}


def add_megatron_model_args(p: argparse.ArgumentParser) -> None:
    """The rest of a Megatron evaluation command line: model shape (checked against the checkpoint),
    the launch (--tensor-model-parallel-size: checked against the processes), precision, and flags
    with nothing to do at inference."""
    g = p.add_argument_group("Megatron model flags", "as Megatron's tasks/main.py takes them; the checkpoint "
                             "already says the model,\nso each is checked against it. --no-load-optim, --no-load-rng, "
                             "--log-interval and\n--checkpoint-activations are accepted and change nothing.")
    for dest, flag in SHAPE_FLAGS.items():
        g.add_argument(flag, dest=dest, type=int, default=None, metavar="N", help="checked against the checkpoint")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, metavar="N",
                   help="must equal the number of processes launched (each is one tensor parallel rank)")
    g.add_argument("--fp16", dest="dtype", action="store_const", const="fp16", help="as --dtype fp16")
    g.add_argument("--bf16", dest="dtype", action="store_const", const="bf16", help="as --dtype bf16")
    # Megatron's tasks/main.py passes these too; an evaluation loads no optimizer or RNG state, runs no
    # backward (so no activation checkpointing), and logs per task, not per interval.
    for flag in ("--no-load-optim", "--no-load-rng", "--checkpoint-activations"):
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--log-interval", type=int, default=None, help=argparse.SUPPRESS)


def model_flag_mismatch(args, model: ModelConfig, world_size: int) -> str | None:
    """One line naming every Megatron model flag that disagrees with the checkpoint (None if none)."""
    wrong = [f"{flag} {getattr(args, dest)} (the checkpoint has {getattr(model, dest)})"
             for dest, flag in SHAPE_FLAGS.items()
             if getattr(args, dest, None) is not None and getattr(args, dest) != getattr(model, dest)]
    tp = getattr(args, "tensor_model_parallel_size", None)
    if tp is not None and tp != world_size:
        wrong.append(f"--tensor-model-parallel-size {tp} ({world_size} process{'es' * (world_size != 1)} "
                     f"launched, one per tensor parallel rank)")
    return "the command line does not match the checkpoint: " + "; ".join(wrong) if wrong else None


@dataclass
class Session:
    model: InferenceModel
    tokenizer: object
    rank: int
    world_size: int
    device: torch.device
    weights: ModelWeights
    describe: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)


def init_distributed(use_mpi: bool):
    """(rank, world size, local rank, tensor parallel group or None)."""
    env = discover_dist_env(use_mpi=use_mpi)
    if env.world_size == 1:
        return 0, 1, 0, None
    apply_dist_env(env)
    if not dist.is_initialized():
        backend = "nccl" if on_cuda() else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size)
    return env.rank, env.world_size, env.local_rank, dist.new_group(list(range(env.world_size)))


def pick_device(arg: str | None, local_rank: int) -> torch.device:
    if arg:
        return torch.device(arg)
    if on_cuda():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_dtype(arg: str | None, device: torch.device) -> torch.dtype:
    if arg:
        return PRECISION_DTYPES[arg]
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def load_weights(args, family: ModelFamily, log) -> tuple[ModelWeights, dict]:
    """(weights, the data/tokenizer settings the model was trained with) of ``family``'s model."""
    if args.load:
        return _consolidated(args.load, args.iteration, family, log)
    return load_hf_export(args.hf_model, family, log)


def _consolidated(load_dir: str, iteration: int | None, family: ModelFamily, log) -> tuple[ModelWeights, dict]:
    from megatron_ds.checkpoint import load_consolidated  # noqa: PLC0415 - heavy (DeepSpeed)

    c = load_consolidated(load_dir, iteration, family=family, log=log)
    weights = ModelWeights(model=c.model, padded_vocab_size=c.padded_vocab_size, vocab_size=c.vocab_size,
                           state_dict=c.state_dict)
    return weights, dict(c.config.get("data", {}))


def load_hf_export(path: str, family: ModelFamily, log) -> tuple[ModelWeights, dict]:
    """A Hugging Face directory of ``family``'s (e.g. a GPT-2 / Llama one from ``tools/checkpoint/to_hf.py``):
    imported into a temporary checkpoint by the family's import (``ModelFamily.hf``) and consolidated
    from there."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--hf-model {path} is not a directory")
    with tempfile.TemporaryDirectory(prefix="hf_import_") as tmp:
        family.hf.import_dir(path, tmp, log=lambda *a: None)
        return _consolidated(tmp, None, family, log)


def tokenizer_from(args, trained: dict, log, model_vocab: int | None = None):
    """The tokenizer the flags name, else the one the checkpoint recorded. A NullTokenizer without a
    recorded size (e.g. an imported HF model) covers the model's vocabulary."""
    kind = args.tokenizer_type or trained.get("tokenizer_type") or "GPT2BPETokenizer"
    files = {k: getattr(args, k) or trained.get(k) for k in ("vocab_file", "merge_file", "tokenizer_model")}
    for name, path in files.items():
        if path and not os.path.exists(path):
            flag = "--" + name.replace("_", "-")
            raise FileNotFoundError(f"{path} (the {flag} the checkpoint was trained with) does not exist here; "
                                    f"pass {flag}")
    return build_tokenizer(kind, vocab_size=trained.get("vocab_size") or model_vocab, log=log, **files,
                           **tokenizer_options(trained))


def open_session(args, family: ModelFamily) -> Session:
    """Join the job, load the checkpoint (or export) of ``family``'s model (a ConfigError for one that
    is not a decoder-only language model: ``ModelFamily.generates``) and build the model. Megatron model
    flags the command line passes (``add_megatron_model_args``) are checked against the checkpoint first:
    a ValueError naming every one that disagrees."""
    if not family.generates:
        raise ConfigError(f"{args.load or args.hf_model} holds a {family.label} model, which generation and "
                          f"perplexity do not run" + (f": use {family.evaluation}" if family.evaluation else ""))
    rank, world, local_rank, tp_group = init_distributed(args.use_mpi)
    log = print if rank == 0 else (lambda *a, **k: None)
    device = pick_device(args.device, local_rank)
    dtype = pick_dtype(args.dtype, device)
    weights, trained = load_weights(args, family, log)
    weights = dataclasses.replace(weights, model=resolve_model_config(weights.model))
    mismatch = model_flag_mismatch(args, weights.model, world)
    if mismatch:
        raise ValueError(mismatch)
    tokenizer = tokenizer_from(args, trained, log, weights.vocab_size)
    weights = dataclasses.replace(weights, vocab_size=weights.vocab_size or tokenizer.vocab_size)
    model = build_inference_model(weights, family=family, tp_group=tp_group, device=device, dtype=dtype)
    m = weights.model
    describe = (f"{family.label} {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, vocab "
                f"{weights.vocab_size} (padded {weights.padded_vocab_size}); tensor parallel {world}, "
                f"{device}, {str(dtype).replace('torch.', '')}")
    log(f"> {describe}")
    return Session(model=model, tokenizer=tokenizer, rank=rank, world_size=world, device=device, weights=weights,
                   describe=describe)


def close_session() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
