"""Every flag of upstream Megatron-LM has an answer, and the Megatron-LM dialect's engine.

Each collected flag (tests/config/megatron_lm_flags.py: Megatron-LM's own parser, run) passed with a value a
launch script passes must be accepted with its meaning, accepted and reported as ignored with a reason, or
refused in one line naming the flag and what to use instead; none is unrecognized. ``python -m
tests.config.test_megatron_lm_flags`` prints the table by outcome (before these flags were answered: 590 of
the 807 unrecognized, 26 ignored, 54 refused).
"""
from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import pytest

from megatron_ds.config import parse_args, resolve
from megatron_ds.config.arguments import describe_ignored
from megatron_ds.config.dialect import MEGATRON_DEEPSPEED, MEGATRON_LM, dialect
from megatron_ds.config.megatron_lm_flags import VALUES as MEGATRON_LM_VALUES
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from tests.config.megatron_flags import FLAGS as MEGATRON_DEEPSPEED_FLAGS
from tests.config.megatron_lm_flags import COMMIT, FLAGS
from tests.config.test_megatron_flags import outcome

MEGATRON_DEEPSPEED_NAMES = {spelling for _, flags, _ in MEGATRON_DEEPSPEED_FLAGS for spelling in flags}


def test_collection_is_complete():
    # 807 arguments of add_megatron_arguments at tag core_v0.19.0 (800 add_argument calls and dataclass fields
    # in megatron/training/arguments.py and its configs)
    assert COMMIT == "5be9626709af2722333bf54797c954c09edeada3"
    assert len(FLAGS) == 807 and len({f[1][0] for f in FLAGS}) == 807


@functools.lru_cache(maxsize=None)
def _outcomes() -> tuple[tuple, ...]:
    """(spelling, values, outcome, its line) of every spelling (aliases behave alike), parsed once."""
    return tuple((spelling, values, *outcome([spelling, *values])) for _, flags, values in FLAGS for spelling in flags)


def test_no_flag_is_unrecognized():
    assert [(s, v, line) for s, v, got, line in _outcomes() if got == "unrecognized"] == []


def test_refusals_are_one_line_naming_the_flag_and_what_to_do():
    for spelling, values, got, line in _outcomes():
        if got != "refused":
            continue
        # argparse's own value errors (a value of another dialect) name the flag too
        assert line.startswith((f"pretrain_gpt.py: error: {spelling}", f"pretrain_gpt.py: error: argument {spelling}")), line
        assert len(line) > len(f"pretrain_gpt.py: error: {spelling}") + 25, line


def test_ignored_flags_say_why():
    for spelling, _, got, line in _outcomes():
        if got == "ignored":
            assert line.startswith(f"{spelling} (") and len(line) > len(spelling) + 25, line


def test_accepted_flags_change_the_config_unless_given_at_our_default():
    # "accepted, no change": the value passed is megatron_ds's default already (Megatron-LM's too)
    same = sorted(s for s, v, got, _ in _outcomes() if got == "accepted, no change")
    assert [s for s in same if s not in MEGATRON_DEEPSPEED_NAMES and s not in {
        "--expert-model-parallel-size", "--softmax-type", "--glu-linear-offset",
        "--mlp-chunks-for-training", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
        "--exp-avg-sq-dtype", "--error-injection-rate", "--recompute-modules",
        # fields of megatron_ds's own, passed at their default
        "--context-parallel-size",
        "--norm-epsilon", "--position-embedding-type", "--relative-attention-num-buckets",
        "--relative-attention-max-distance", "--rotary-base", "--rope-scaling-factor", "--profile-step-start", "--profile-step-end",
        "--straggler-ctrlr-port", "--straggler-minmax-count", "--tiktoken-num-special-tokens",
        "--lr-wsd-decay-style",
        # multi-latent attention's sizes and YaRN, at Megatron-LM's defaults (ours)
        "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor",
        "--mscale"}] == []


@pytest.mark.parametrize("argv,says", [
    (["--ckpt-format", "torch_dcp"], "the torch_dcp and fsdp_dtensor formats are not supported"),
    (["--recompute-modules", "core_attn", "mlp"], "use --recompute-granularity full"),
    (["--exit-signal", "SIGINT"], "only SIGTERM and SIGUSR1 save and exit here"),
    (["--main-grads-dtype", "bf16"], "DeepSpeed keeps fp32 master weights"),
])
def test_values_other_than_ours_are_refused_in_one_line(argv, says):
    got, line = outcome(argv)
    assert got == "refused" and says in line and line.startswith(f"pretrain_gpt.py: error: {argv[0]} "), line


def test_accepted_values_that_say_something_are_reported():
    cfg, ignored = parse_args(["--ckpt-format", "torch_dist", "--context-parallel-size", "1"])
    assert ignored == ["--ckpt-format"] and "writes and reads its own checkpoint format" in describe_ignored(ignored)


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3").split()


def make(*extra, world=1, template=None):
    cfg, _ = parse_args(BASE + list(extra))
    return resolve(cfg, world_size=world, vocab_size=1000, ds_template=template, device_type="cpu", family=GPT)


def test_grouped_query_attention_by_megatron_lm_flags():
    assert make("--group-query-attention", "--num-query-groups", "2").layout.model.num_key_value_heads == 2
    # megatron/training/arguments.py: without --group-query-attention the groups are not read (multi-head)
    assert make("--num-query-groups", "2").layout.model.num_key_value_heads == 8
    assert make("--num-key-value-heads", "4").layout.model.num_key_value_heads == 4
    with pytest.raises(ConfigError, match="--num-query-groups 2 contradicts --num-key-value-heads 4"):
        make("--group-query-attention", "--num-query-groups", "2", "--num-key-value-heads", "4")


def test_dialect_is_read_from_the_command_line():
    assert dialect(parse_args(BASE)[0])[0] == MEGATRON_LM
    assert dialect(parse_args(BASE + ["--deepspeed"])[0])[0] == MEGATRON_DEEPSPEED
    assert dialect(parse_args(BASE + ["--deepspeed_config", "ds.json"])[0])[0] == MEGATRON_DEEPSPEED


def test_distributed_optimizer_is_zero_1_on_a_megatron_lm_command_line():
    run = make("--use-distributed-optimizer")
    assert run.layout.zero_stage == 1 and run.layout.ds_config["zero_optimization"]["stage"] == 1
    assert any("ZeRO stage 1: --use-distributed-optimizer" in n for n in run.notes)
    assert make("--use-distributed-optimizer", "--zero-stage", "2", world=2).layout.zero_stage == 2
    with pytest.raises(ConfigError, match="shards as ZeRO stage 1, but --zero-stage / the DeepSpeed JSON says 0"):
        make("--use-distributed-optimizer", "--zero-stage", "0")
    # Megatron-DeepSpeed's DeepSpeed path never builds Megatron's distributed optimizer: the JSON decides
    run = make("--use-distributed-optimizer", "--deepspeed")
    assert run.layout.zero_stage == 0
    assert any("not read on a Megatron-DeepSpeed command line" in n for n in run.notes)


def test_overlap_and_bucket_flags_configure_deepspeed():
    zero = make("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--ddp-bucket-size", "40000000", world=2).layout.ds_config["zero_optimization"]
    assert zero == {**zero, "stage": 1, "overlap_comm": True, "reduce_bucket_size": 40000000}
    with pytest.raises(ConfigError, match='"zero_optimization.overlap_comm" is False'):
        make("--overlap-grad-reduce", world=2, template={"zero_optimization": {"overlap_comm": False}})
    # a Megatron-DeepSpeed command line: the JSON alone
    zero = make("--overlap-grad-reduce", "--deepspeed", world=2).layout.ds_config["zero_optimization"]
    assert "overlap_comm" not in zero


@pytest.mark.parametrize("strategy,stage", [(None, 3), ("optim_grads_params", 3), ("optim_grads", 2), ("optim", 1),
                                            ("no_shard", 0)])
def test_megatron_fsdp_is_the_zero_stage_of_its_sharding(strategy, stage):
    extra = ["--data-parallel-sharding-strategy", strategy] if strategy else []
    assert make("--use-megatron-fsdp", *extra, world=2).layout.zero_stage == stage


def test_sharding_strategy_alone_is_refused():
    with pytest.raises(ConfigError, match="is read only with --use-megatron-fsdp"):
        make("--data-parallel-sharding-strategy", "optim")


def table() -> dict[str, int]:
    return dict(sorted(collections.Counter(outcome([flags[0], *values])[0].replace(", no change", "")
                                           for _, flags, values in FLAGS).items()))




# --- docs/megatron-lm-flags.md: every collected flag, what it does here, which dialects declare it

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron-lm-flags.md"


@functools.lru_cache(maxsize=None)
def _parser():
    from megatron_ds.config.arguments import build_parser  # noqa: PLC0415

    return build_parser()


def _help(spelling: str) -> str:
    action = _parser()._option_string_actions[spelling]
    return " ".join((action.help or "").replace("|", "/").split())


def flags_page() -> str:
    """The page, from the collected flags and this tree's answers."""
    rows = []
    answers = {spelling: (got, line) for spelling, _, got, line in _outcomes()}
    for group, flags, values in FLAGS:
        spelling = flags[0]
        got, line = answers[spelling]
        if spelling in MEGATRON_LM_VALUES:
            _, accepted, note, refusal = MEGATRON_LM_VALUES[spelling]
            what = (f"accepted at {' or '.join(accepted)}" + (f" ({note})" if note else "")
                    + f"; other values refused: {refusal}")
        elif got == "refused":
            what = "refused: " + line.split(f"{spelling}", 1)[1].lstrip(": ").split(" (see ")[0]
        elif got == "ignored":
            what = "accepted, no effect: " + line[len(spelling) + 2:-1]
        else:
            what = _help(spelling) or "accepted"
        dialects = "both" if any(s in MEGATRON_DEEPSPEED_NAMES for s in flags) else "Megatron-LM"
        names = ", ".join(f"`{s}`" for s in flags)
        rows.append(f"| {names} | {group} | {dialects} | {what.replace('|', '/')} |")
    return "\n".join([
        "# Megatron-LM's flags, one by one",
        "",
        "Every flag of upstream Megatron-LM (NVIDIA/Megatron-LM, tag core_v0.19.0, "
        f"commit {COMMIT[:10]}; its parser's {len(FLAGS)} arguments) and what `pretrain_gpt.py` does with it: "
        "its meaning here (the flag's help), *accepted, no effect* with the reason (an implementation of the same "
        "math, a knob of a tool megatron_ds does not run), or *refused* with what to use instead. \"both\": "
        "Megatron-DeepSpeed declares the flag too. How the two dialects are told apart, and the engine a "
        "Megatron-LM command line gets: [migrating.md](migrating.md#from-upstream-megatron-lm). Generated by "
        "`python -m tests.config.test_megatron_lm_flags --write-docs`; `tests/config/test_megatron_lm_flags.py` "
        "checks it is current.",
        "",
        "| Flag | Upstream group | Declared by | Here |",
        "|---|---|---|---|",
        *rows, ""])


def test_flags_page_is_current():
    assert DOC.read_text() == flags_page(), "run: python -m tests.config.test_megatron_lm_flags --write-docs"


def by_samples(*extra, world=2):
    """make() of a --train-samples 100 run (BASE counts iterations)."""
    cfg, _ = parse_args([a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "100", *extra])
    return resolve(cfg, world_size=world, vocab_size=1000, ds_template=None, device_type="cpu", family=GPT)


@pytest.mark.parametrize("extra,match", [
    (["--global-batch-size", "8"], "--step-batch-size-schedule and --global-batch-size are both set"),
    (["--rampup-batch-size", "2", "2", "64"], "both set the batch size"),
])
def test_step_batch_size_schedule_refuses_what_upstream_refuses(extra, match):
    with pytest.raises(ConfigError, match=match):
        by_samples("--step-batch-size-schedule", "0:4 2K:8", *extra)


@pytest.mark.parametrize("schedule,match", [
    ("64:4 2K:8", "must start at 0"), ("0:4 0:8", "increase strictly"), ("0:4 2K", "is not THRESHOLD:BATCH_SIZE"),
    ("0:6", "not positive multiples of --micro-batch-size x DP = 4"),
])
def test_step_batch_size_schedule_checks(schedule, match):
    with pytest.raises(ConfigError, match=match):
        by_samples("--step-batch-size-schedule", schedule)


def test_step_batch_size_schedule_resolves_to_its_last_size():
    # 2K tokens at seq 32 = 62 samples: 16 steps of 4 (to 64 samples), then 8s while consumed < 100: 5 more
    run = by_samples("--step-batch-size-schedule", "0:4", "2K:8")
    assert run.layout.global_batch_size == 8 and run.layout.train_iters == 21
    assert "batch size by step: 4 from 0 tokens, 8 from 1,984 tokens" in run.describe()


def test_eval_iters_minus_one_is_no_validation():
    # megatron/training/training.py (core_v0.19.0): do_valid = full_validation or eval_iters > 0
    assert make("--eval-iters", "-1").training.eval_iters == 0
    with pytest.raises(ConfigError, match="--eval-iters -2 is out of range"):
        make("--eval-iters", "-2")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        DOC.write_text(flags_page())
    else:
        for name, count in table().items():
            print(f"{name:30s} {count}")

