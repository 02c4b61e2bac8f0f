"""One exit-status rule for every CLI (pretrain_gpt.py and tools/): 2 when the command line is refused
as such (argparse's status: an unknown or missing flag, a value no run can use), 1 when it parsed but
the work failed (a missing file, a damaged input), each with one line on stderr and no traceback."""
import importlib

import pytest

# tools/X.py (tools/checkpoint/X.py) calls megatron_ds.cli.X.main (tests/test_architecture.py keeps it so)


def _main(tool):
    if tool == "pretrain_gpt":
        from megatron_ds.families import main
        return main
    return importlib.import_module(f"megatron_ds.cli.{tool}").main


def _status(capsys, tool, argv) -> tuple[int, str]:
    try:
        rc = _main(tool)(argv)
    except SystemExit as exc:  # argparse's refusals
        rc = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def _last_line(err: str) -> str:
    return [line for line in err.strip().splitlines() if not line.startswith("(see ")][-1]


TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 128").split()


def _failures(d):
    """tool -> (argv that fails at work, the start of its one error line)."""
    nowhere = str(d / "nowhere")
    return {
        "pretrain_gpt": ([a for a in TINY if a != "--mock-data"] + ["--tokenizer-type", "NullTokenizer", "--dry-run",
                                                                   "--data-path", nowhere],
                         f"error: no dataset at {nowhere}"),
        "preprocess_data": (["--input", nowhere, "--output-prefix", str(d / "out"), "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", "10"], "error: "),
        "merge_datasets": (["--input", nowhere, "--output-prefix", str(d / "m")], "error: "),
        "train_tokenizer": (["--input", nowhere, "--vocab-size", "300", "--output-dir", str(d / "t")], "error: "),
        "generate_samples_gpt": (["--load", nowhere, "--prompt", "x"], f"error: checkpoint directory {nowhere}"),
        "evaluate": (["--load", nowhere, "--lambada", nowhere + ".jsonl"],
                     f"error: --lambada {nowhere}.jsonl does not exist (a JSONL file with a 'text' per line)"),
        "eval_harness": (["--load", nowhere, "--tasks", "no_such_task", "--include-path", str(d),
                          "--no-builtin-tasks"], "error: unknown task(s) no_such_task"),
        "to_hf": (["--load", nowhere, "--out", str(d / "hf")], f"error: checkpoint directory {nowhere}"),
        "from_hf": (["--hf-dir", nowhere, "--save", str(d / "c")], "error: "),
        "to_universal": (["--load", nowhere], "error: "),
        "plan": (["--resource", "rt_HG", "--model-size", "175B", "--seq-length", "2048", "--global-batch-size", "8",
                  "--bf16", "--plan-zero", "0"], "error: no layout fits"),
    }


TOOLS = sorted(_failures(__import__("pathlib").Path("x")))


@pytest.mark.parametrize("tool", TOOLS)
def test_an_unknown_flag_is_a_usage_error(capsys, tool):
    rc, err = _status(capsys, tool, ["--no-such-flag"])
    assert rc == 2 and "error: " in err, err  # unknown, or required flags missing: both usage errors


@pytest.mark.parametrize("tool", TOOLS)
def test_a_failure_at_work_is_status_1_in_one_line(capsys, tmp_path, tool):
    argv, start = _failures(tmp_path)[tool]
    rc, err = _status(capsys, tool, argv)
    assert rc == 1, err
    assert _last_line(err).startswith(start) and err.count("error:") == 1, err


def test_pretrain_without_arguments_lists_every_missing_flag(capsys):
    rc, err = _status(capsys, "pretrain_gpt", [])
    assert rc == 2
    assert err.splitlines()[0] == (
        "pretrain_gpt.py: error: missing required flags: --num-layers, --hidden-size, --num-attention-heads, "
        "--seq-length, --micro-batch-size, --lr, --train-iters (or --train-samples), --vocab-file and --merge-file "
        "(for GPT2BPETokenizer, the default --tokenizer-type), --data-path (or --train-data-path, or --mock-data)")
    rc, err = _status(capsys, "pretrain_gpt", ["--tokenizer-type", "HFTokenizer", "--num-layers", "2", "--dry-run"])
    assert rc == 2 and err.splitlines()[0].endswith("--train-iters (or --train-samples), --tokenizer-model "
                                                    "(for HFTokenizer)")  # no data needed for a dry run


@pytest.mark.parametrize("temperature,expected", [("-0.5", 2), ("0", None)])
def test_temperature_is_greedy_at_zero_and_refused_below(capsys, tmp_path, temperature, expected):
    """--temperature 0 is greedy decoding; a negative one is refused (it was silently 1.0 before)."""
    generate = importlib.import_module("megatron_ds.cli.generate_samples_gpt")
    parser = generate.build_parser()
    args = parser.parse_args(["--load", "x", "--temperature", temperature])
    if expected is None:
        cfg = generate.sampling_config(args, parser)
        assert cfg.greedy
        return
    with pytest.raises(SystemExit) as exit_:
        generate.sampling_config(args, parser)
    assert exit_.value.code == 2
    assert "--temperature -0.5 is negative" in capsys.readouterr().err


def test_evaluate_with_nothing_to_do_is_a_usage_error(capsys):
    rc, err = _status(capsys, "evaluate", ["--load", "x"])
    assert rc == 2 and "nothing to evaluate: pass --ppl-data and/or --lambada" in err


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_other_entry_points_name_themselves_in_usage_errors(capsys, family):
    from megatron_ds.families import get_family, main

    try:
        rc = main(["--no-such-flag"], family=get_family(family))
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"pretrain_{family}.py: error: "), err
