"""The planner's chosen layout as a ready ABCI job script (``tools/plan.py --write-script PATH``).

The script is one of scripts/abci/'s own, for the resource's system (ABCI 3.0's PBS scripts for
rt_HF / rt_HG, ABCI 2.0's Grid Engine ones for rt_F / rt_AF) and the model's family, with its
resource request, its variables' defaults (TP, PP, shape, batch, ZeRO stage) and its precision set
to the plan's, and the layout's other flags and the command line's model flags appended to its
ARGS: it runs through common.sh, checks itself with ``DRY_RUN=1`` and is submitted as any of them.
"""
from __future__ import annotations

import os
import re
import shlex

from megatron_ds.errors import ConfigError
from megatron_ds.planner.search import Candidate, Request, strip_knobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABCI_DIR = os.path.join(ROOT, "scripts", "abci")
# the script the plan's is written from, by ABCI system: the first (by name) of that system's job
# scripts that runs the family's entry point (MEGATRON_DS_ENTRY; pretrain_gpt.py where a script sets
# none) and, for a SwiGLU model, the one whose ARGS have --swiglu (the Llama script's variables give
# the ffn size and key/value heads)
ENTRY = re.compile(r"^MEGATRON_DS_ENTRY=\$\{MEGATRON_DS_ENTRY:-\$MEGATRON_DS_ROOT/(\S+?)\}", re.M)
# flags the script's variables or common.sh set, or that only the plan's command line has
NOT_PASSED_WITH_VALUE = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                         "--global-batch-size", "--world-size", "--gpu-memory-gb", "--data-path", "--vocab-file",
                         "--merge-file", "--tokenizer-type", "--tokenizer-model", "--save", "--load",
                         "--deepspeed_config", "--deepspeed-config", "--max-position-embeddings", "--train-iters",
                         "--lr", "--min-lr", "--lr-decay-iters", "--split", "--resource", "--nodes", "--gpu-type",
                         "--gpus",
                         "--gpus-per-node", "--network-gbs", "--model-size", "--top", "--write-script",
                         "--plan-micro-batch", "--plan-recompute", "--plan-zero")
NOT_PASSED_SWITCHES = ("--dry-run", "--mock-data", "--deepspeed", "--fp16", "--bf16", "--plan", "--unfused-attention")


def _set_default(text: str, name: str, value) -> str:
    """``NAME=${NAME:-old}`` -> the new default (left alone where the script has no such variable)."""
    return re.sub(rf"^{name}=\$\{{{name}:-[^}}]*\}}", f"{name}=${{{name}:-{value}}}", text, flags=re.M)


def template_for(entry: str, system: int, *, swiglu: bool, resource: str) -> str | None:
    """The job script to start from (``ENTRY``'s comment), one for ``resource`` where there is one."""
    found = []
    for script in sorted(os.listdir(ABCI_DIR)):
        if not (script.startswith(f"abci{system}_") and script.endswith(".sh")):
            continue
        text = open(os.path.join(ABCI_DIR, script)).read()
        named = ENTRY.search(text)
        if (named.group(1) if named else "pretrain_gpt.py") == entry and ("--swiglu" in text) == swiglu:
            found.append((f"RESOURCE_TYPE=${{RESOURCE_TYPE:-{resource}}}" not in text, script))
    return min(found)[1] if found else None


def job_script(cand: Candidate, request: Request, argv: list[str]) -> str:
    """The text of the job script for ``cand`` (module docstring)."""
    cluster, m, lay = request.cluster, request.flags.model, cand.layout
    if cluster.resource is None:
        raise ConfigError("--write-script writes an ABCI job script: plan with --resource rt_HF/rt_HG/rt_F/rt_AF")
    system = 3 if cluster.resource in ("rt_HF", "rt_HG") else 2
    template = template_for(f"pretrain_{request.family.name}.py", system, swiglu=bool(m.swiglu),
                            resource=cluster.resource)
    if template is None:
        raise ConfigError(f"no ABCI {system}.0 job script for {'SwiGLU ' if m.swiglu else ''}"
                          f"{request.family.label} models in scripts/abci to start from")
    text = open(os.path.join(ABCI_DIR, template)).read()
    name = os.path.splitext(template)[0].split("_")[2]  # abci3_h200_<model>_<size>.sh
    text = re.sub(r"^#\$ -l rt_[A-Za-z.]+=\d+$", f"#$ -l {cluster.resource}={cluster.nodes}", text, flags=re.M)
    text = re.sub(r"^#PBS -q rt_\w+$", f"#PBS -q {cluster.resource}", text, flags=re.M)
    text = re.sub(r"^#PBS -l select=\d+:mpiprocs=\d+$",
                  f"#PBS -l select={cluster.nodes}:mpiprocs={cluster.gpus_per_node}", text, flags=re.M)
    k = cand.knobs
    values = {"TP": k.tp, "PP": k.pp, "NUM_LAYERS": m.num_layers, "HIDDEN_SIZE": m.hidden_size,
              "NUM_HEADS": m.num_attention_heads, "SEQ_LENGTH": m.seq_length, "MICRO_BATCH": k.mb,
              "GLOBAL_BATCH": lay.global_batch_size, "RESOURCE_TYPE": cluster.resource,
              "GPUS_PER_NODE": cluster.gpus_per_node, "FFN_HIDDEN_SIZE": m.ffn_hidden_size,
              "NUM_KV_HEADS": m.num_key_value_heads, "RUN_NAME": f"{name}_plan"}
    if "--train-iters" in {a.split("=", 1)[0] for a in argv}:
        values["TRAIN_ITERS"] = lay.train_iters
    for var, value in values.items():
        text = _set_default(text, var, value)
    # the flags the Llama script's variables give
    shape_vars = tuple(f for f, var in (("--ffn-hidden-size", "FFN_HIDDEN_SIZE"),
                                        ("--num-key-value-heads", "NUM_KV_HEADS")) if f"{var}=" in text)
    precision = "fp16" if lay.precision == "fp16" else "bf16"
    text = re.sub(r"^set_job_defaults \w+$", f"ZERO_STAGE=${{ZERO_STAGE:-{k.zero}}}\nset_job_defaults {precision}",
                  text, count=1, flags=re.M)
    text = re.sub(r"^  --(fp16|bf16)( --checkpoint-activations)?$", f"  --{precision}", text, flags=re.M)
    passed = strip_knobs(strip_knobs(argv), NOT_PASSED_WITH_VALUE + shape_vars, NOT_PASSED_SWITCHES)
    extra = k.flags()[8:]  # after TP, PP, micro batch and ZeRO, which the variables give
    added = shlex.join(extra + passed)
    if added:
        text = text.replace('launch_training "${ARGS[@]}" "$@"', f"ARGS+=({added})  # the plan's\n"
                            'launch_training "${ARGS[@]}" "$@"')
    head = (f"# Written by tools/plan.py from {template}: {k.describe()} on {cluster.nodes} x "
            f"{cluster.resource}; predicted {cand.time.tflops_per_gpu:.0f} TFLOP/s per GPU, {cand.time.step_s:.2f} s "
            f"per step, {cand.memory.total / 1e9:.1f} GB per GPU.\n")
    first, rest = text.split("\n", 1)
    return f"{first}\n{rest}".replace("set -euo pipefail\n", head + "set -euo pipefail\n", 1)


def write_job_script(path: str, cand: Candidate, request: Request, argv: list[str]) -> str:
    text = job_script(cand, request, argv)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return f"job script written: {path} (check it: DRY_RUN=1 bash {path})"
