"""The planner's command line: ``tools/plan.py`` and ``pretrain_*.py --dry-run --plan``.

The model, batch, sequence length and precision are the pretrain flags (any family's; the
layout flags among them, TP, PP, micro batch, recompute, are "your layout", compared with the
plan's best); the GPUs are an ABCI resource x nodes (``--resource rt_HF --nodes 4``, or the
``--gpu-memory-gb rt_F --world-size 32`` of an ABCI script's DRY_RUN) or a GPU type x count. The
planner's own options are below (``PLAN_OPTIONS``); everything else is parsed as pretrain flags, so
an unknown flag is the same one-line error.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from megatron_ds.config import Config, parse_args, resolve
from megatron_ds.config.arguments import build_parser as build_config_parser
from megatron_ds.config.deepspeed_json import load_ds_template
from megatron_ds.config.memory import GB
from megatron_ds.config.validation import missing_flags
from megatron_ds.data.tokenizer import GPT2_VOCAB_SIZE
from megatron_ds.errors import ConfigError
from megatron_ds.planner import search as planner
from megatron_ds.planner.one_layout import Evaluation, parse_layout
from megatron_ds.planner.time_model import GPUS, RESOURCES, expected_error, make_cluster, tie_groups

# --model-size: GPT-3's shapes (Brown et al. 2020, Table 2.1: layers, hidden size, heads) and
# Megatron-LM's 530B and 1T (its README's throughput table).
MODEL_SIZES = {"125M": (12, 768, 12), "350M": (24, 1024, 16), "760M": (24, 1536, 16), "1.3B": (24, 2048, 16),
               "2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40), "175B": (96, 12288, 96),
               "530B": (105, 20480, 128), "1T": (128, 25600, 160)}
# the vocabulary of a family's default tokenizer, where --vocab-size does not say: GPT-2's BPE
# (Megatron-DeepSpeed's default type), bert-large-uncased's and bert-large-cased's WordPiece
DEFAULT_VOCAB = {None: GPT2_VOCAB_SIZE, "GPT2BPETokenizer": GPT2_VOCAB_SIZE, "BertWordPieceLowerCase": 30522,
                 "BertWordPieceCase": 28996,
                 # Meta's released Llama 3.x file (128,000 ranks + 256 specials); TikTokenizer's default
                 "Llama3Tokenizer": 128256, "TikTokenizer": 131072}


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False)
    p.add_argument("--plan", action="store_true")
    p.add_argument("--resource", choices=sorted(RESOURCES), help="ABCI resource type of the nodes")
    p.add_argument("--nodes", type=int, help="nodes of --resource")
    p.add_argument("--gpu-type", choices=sorted(GPUS), help="GPU type (with --gpus)")
    p.add_argument("--gpus", type=int, help="GPUs of --gpu-type")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--network-gbs", type=float, help="a node's network bandwidth, GB/s")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), help="GPT shape by size")
    p.add_argument("--top", type=int, default=5, help="layouts to print")
    p.add_argument("--write-script", metavar="PATH", help="write the best layout as an ABCI job script")
    p.add_argument("--plan-micro-batch", type=_ints, help="micro batch sizes to try (comma-separated)")
    p.add_argument("--plan-recompute", type=_recomputes, help="recompute settings to try: none,selective,full")
    p.add_argument("--plan-zero", type=_ints, help="ZeRO stages to try (comma-separated)")
    p.add_argument("--plan-without", type=_features, default=frozenset(),
                   help=f"features not to enumerate: {','.join(planner.FEATURES)}")
    p.add_argument("--layout", metavar="tp=N,pp=N,...",
                   help="evaluate this one layout instead of searching: tp=N,pp=N,mb=N,zero=N,"
                        "recompute=none|selective|full[,sp][,v=N][,ulysses=N][,ep=N][,cp=N]; prints its per-term breakdown")
    p.add_argument("--unfused-attention", action="store_true",
                   help="time attention as unfused kernels (scores in memory), as runs before flash attention")
    return p


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _features(text: str) -> frozenset:
    names = frozenset(text.split(","))
    unknown = names - set(planner.FEATURES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown feature(s) {', '.join(sorted(unknown))}; "
                                         f"known: {', '.join(planner.FEATURES)}")
    return names


def _recomputes(text: str) -> tuple[str | None, ...]:
    return tuple(None if x == "none" else x for x in text.split(","))


def _with_defaults(argv: list[str], opts) -> list[str]:
    """The pretrain flags the plan does not depend on, where missing, and --model-size's shape."""
    given = {a.split("=", 1)[0] for a in argv}
    out = list(argv)
    if opts.model_size:
        shape = zip(("--num-layers", "--hidden-size", "--num-attention-heads"), MODEL_SIZES[opts.model_size])
        for flag, value in shape:
            if flag not in given:
                out += [flag, str(value)]
    for flag, value in (("--micro-batch-size", "1"), ("--lr", "1e-4")):
        if flag not in given:
            out += [flag, value]
    if not given & {"--train-iters", "--train-samples"}:  # (--train-tokens only caps them)
        out += ["--train-iters", "1"]
    return out


def request_of(argv: list[str], family, prog: str) -> tuple[planner.Request, Config, argparse.Namespace]:
    opts, rest = build_parser(prog).parse_known_args(argv)
    flags, _ = parse_args(_with_defaults(rest, opts), prog)
    # the model's shape is needed; the tokenizer's files are not (--vocab-size, or the family's default)
    missing = [flag for flag in missing_flags(flags, with_data=False) if "(for " not in flag]
    if missing:
        build_config_parser(prog).error(f"missing required flags: {', '.join(missing)} (or --model-size)")
    resource = opts.resource
    if resource is None and flags.gpu_memory_gb in RESOURCES:
        resource = flags.gpu_memory_gb
    nodes, gpus = opts.nodes, opts.gpus
    if resource and nodes is None and flags.world_size:
        nodes = max(1, flags.world_size // RESOURCES[resource][1])
    if opts.gpu_type and gpus is None:
        gpus = flags.world_size
    cluster = make_cluster(gpu=opts.gpu_type, gpus=gpus, resource=resource, nodes=nodes,
                           gpus_per_node=opts.gpus_per_node, network_gbs=opts.network_gbs)
    kind = flags.data.tokenizer_type or family.default_tokenizer_type
    if not flags.data.vocab_size and kind not in DEFAULT_VOCAB:
        raise ConfigError(f"--tokenizer-type {kind}: give the vocabulary's size (--vocab-size)")
    # (the sentinel tokens --vocab-extra-ids adds, T5's)
    vocab = flags.data.vocab_size or DEFAULT_VOCAB[kind] + (flags.masked_lm.vocab_extra_ids or 0)
    request = planner.Request(flags, cluster, vocab, family, load_ds_template(flags.deepspeed.deepspeed_config),
                              stage_templates=None if flags.deepspeed.deepspeed_config else stage_templates(flags),
                              **{k: v for k, v in (("micro_batches", opts.plan_micro_batch),
                                                   ("recompute", opts.plan_recompute), ("zero", opts.plan_zero))
                                 if v}, flash=not opts.unfused_attention, without=opts.plan_without)
    return request, flags, opts


def stage_templates(flags: Config) -> dict | None:
    """{ZeRO stage: (path, JSON)} of the repository's ds_configs/zero<stage>_<precision>.json, the JSON
    the ABCI job scripts pass (common.sh's DS_CONFIG); None outside a checkout or for fp32."""
    precision = "bf16" if flags.training.bf16 else "fp16" if flags.training.fp16 else None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = {}
    for stage in range(4):
        path = os.path.join("ds_configs", f"zero{stage}_{precision}.json")
        if precision and os.path.isfile(os.path.join(root, path)):
            found[stage] = (path, load_ds_template(os.path.join(root, path)))
    return found or None


def tokens_to_train(flags: Config) -> float | None:
    t, seq = flags.training, flags.model.seq_length
    if t.train_tokens:
        return float(t.train_tokens)
    if t.train_samples:
        return float(t.train_samples * seq)
    return None


def your_layout(request: planner.Request, flags: Config) -> tuple[planner.Candidate | None, str]:
    """The command line's own layout, evaluated as the plan's are, or why it cannot run."""
    try:
        layout = resolve(flags, world_size=request.cluster.world_size, vocab_size=request.vocab_size,
                         ds_template=planner.template_of(request, planner.Knobs(
                             1, 1, zero=flags.deepspeed.zero_stage or 0))[1], family=request.family,
                         gpu_memory=request.cluster.gpu.memory_gb * GB).layout
        cand = planner.evaluate(request, planner.knobs_of(flags, layout))
    except ConfigError as exc:
        return None, f"your layout: refused: {exc}"
    budget = request.cluster.gpu.memory_gb * GB
    fits = "fits" if cand.memory.total <= budget else "DOES NOT FIT"
    return cand, (f"your layout: {cand.knobs.describe()}: {cand.memory.total / GB:.1f} of "
                  f"{request.cluster.gpu.memory_gb:.0f} GB, {fits}; {cand.time.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                  f"{cand.time.step_s:.3f} s per step")


def report(request: planner.Request, flags: Config, opts, argv: list[str]) -> tuple[list[str], planner.Plan]:
    c, m = request.cluster, flags.model
    result = planner.plan(request)
    where = f"{c.nodes} x {c.resource}" if c.resource else f"{c.nodes} node(s)"
    lines = [f"plan: {request.family.label} model of {m.num_layers} layers, hidden {m.hidden_size}, "
             f"{m.num_attention_heads} heads, seq {m.seq_length}, global batch {flags.training.global_batch_size}, "
             f"on {c.world_size} x {c.gpu.name} ({where}, {c.gpus_per_node} per node, {c.network_gbs:.0f} GB/s "
             f"network per node)",
             f"{result.enumerated} layouts enumerated, {result.checked} memory estimates, {len(result.ranked)} "
             f"(TP, PP) pairs fit; {result.seconds:.1f} s"]
    if not result.ranked:
        raise ConfigError("no layout fits: use more GPUs, GPUs with more memory or a smaller model")
    tokens = tokens_to_train(flags)
    if tokens is None and "--train-iters" in {a.split("=", 1)[0] for a in argv}:
        tokens = float(flags.training.train_iters * flags.training.global_batch_size * m.seq_length)
    lines += planner.table(result.ranked, top=opts.top, train_tokens=tokens,
                           tokens_per_step=flags.training.global_batch_size * m.seq_length, gpu=c.gpu)
    lines.append(ties_note(result.ranked, c.gpu))
    best = result.ranked[0]
    lines.append(f"best: {shlex.join(planner.flags_of(request, best.knobs))}")  # a partition may hold "|"
    yours, line = your_layout(request, flags)
    lines.append(line)
    if yours is not None and yours.knobs != best.knobs:
        tie = yours.memory.total <= request.cluster.gpu.memory_gb * GB and tie_groups([best, yours])[1] == 1
        lines.append(planner.explain(best, yours) + (" -- a tie: the two predictions overlap within their expected "
                                                     "error" if tie else ""))
    return lines, result


def ties_note(ranked, gpu) -> str:
    """What the ``#`` and ``err`` columns mean for this plan."""
    note = ("rows sharing a # are ties: their predictions overlap within the expected error (err: the largest error "
            "of the time model on published A100 runs of the regime, docs/planner.md)")
    if expected_error(ranked[0].layout, gpu) is None:
        note += (f"; on {gpu.name} the error is unknown until measured (no published multi-GPU run; ties judged "
                 "by the A100 errors)")
    return note


def print_layout(request: planner.Request, text: str) -> list[str]:
    """``--layout``: one layout's memory and predicted step, term by term (``planner.evaluate``)."""

    return Evaluation(planner.evaluate(request, parse_layout(text)), request.cluster.gpu).lines()


def main(argv=None, *, family, prog: str = "plan.py") -> int:
    """Print the plan (and write the job script); 1 with a one-line error, 2 for a refused command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(build_parser(prog).format_help().replace("usage:", "usage (with the pretrain flags of the model):", 1))
        print("docs/planner.md explains the output; the model, batch and precision are the pretrain flags "
              f"({prog} --help without --plan lists them).")
        return 0
    try:
        request, flags, opts = request_of(argv, family, prog)
        if opts.layout:
            if opts.write_script:
                raise ConfigError("--layout prints one layout's breakdown; --write-script writes the plan's best: "
                                  "give one of them")
            print("\n".join(print_layout(request, opts.layout)))
            return 0
        lines, result = report(request, flags, opts, argv)
        print("\n".join(lines))
        if opts.write_script:
            from megatron_ds.planner.job_script import write_job_script  # noqa: PLC0415

            print(write_job_script(opts.write_script, result.ranked[0], request, argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def evaluate_layout(argv: list[str], *, family, knobs: planner.Knobs | None = None, dp: int | None = None,
                    **layout) -> Evaluation:
    """One layout (``knobs``, or its fields as keywords: tp, pp, mb, zero, recompute, seq_par, v, sp, ep, cp) of the
    run ``argv`` describes (tools/plan.py's flags) for the model ``family`` (``families.get_family("gpt")``: the
    planner stands below the families), evaluated; ``dp``, where given, must be what the GPUs leave."""
    request, _, _ = request_of(list(argv), family, "plan.py")
    knobs = knobs or planner.Knobs(**{"tp": 1, "pp": 1, **layout})
    cand = planner.evaluate(request, knobs)
    if dp is not None and dp != cand.layout.dp:
        raise ConfigError(f"DP {dp} does not follow: {request.cluster.world_size} GPUs / (TP {knobs.tp} x PP "
                          f"{knobs.pp}) leave DP {cand.layout.dp}")
    return Evaluation(cand, request.cluster.gpu)
