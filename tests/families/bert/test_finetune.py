"""tasks/main.py (``cli.tasks``) end to end on tiny task sets written here (tests/families/bert/task_data.py)
from a BERT checkpoint pretrain_bert.py saved: MNLI-format and RACE-format data are learned to well
above chance, accuracy is reported per epoch and a checkpoint saved per epoch; TP 2 and PP 2 give
the single process's losses and accuracies; flags are checked before anything starts.

Tolerance: rtol 2e-5 on the losses of the first 5 epochs (120 Adam steps), as
tests/families/bert/test_bert_parity.py: fp32 sums in another order (TP's split reductions, PP's stages)
move a loss by ~1e-7 relative; a wrong shard, a lost padding mask or a head that differs per rank moves
it by 1e-3 or more. Around iteration 150 the model snaps from 2/3 to all of the labels at lr 5e-3,
a phase that amplifies those 1e-7 to ~1e-2 (measured: 0.9% at most), so later losses are held to
rtol 1e-2; the per-epoch accuracies must be the same number of samples throughout.
"""
import contextlib
import io
import json
import os

import pytest

from tests.distributed import run_distributed
from tests.families.bert.task_data import write_mnli, write_race, write_vocab

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--num-workers 0 --seed 1234 --micro-batch-size 8 --global-batch-size 8").split()
TUNE = "--lr 5e-3 --lr-warmup-iters 10 --log-interval 1000 --hidden-dropout 0 --attention-dropout 0".split()
RTOL = 2e-5
STRICT = 120  # iterations compared at RTOL (see the module docstring)


def run_cli(rank, world_size, argv, body="finetune"):
    """tasks/main.py's body (or pretrain_bert.py's) in this process: (losses, per-epoch accuracies)."""
    from megatron_ds.cli.tasks import add_task_args, finetune
    from megatron_ds.config.arguments import parse_args_with
    from megatron_ds.families import main
    from megatron_ds.families.bert.bert_family import BERT

    with contextlib.redirect_stdout(io.StringIO()):
        if body == "pretrain":
            return main(argv, family=BERT)
        flags, ignored, task_args = parse_args_with(argv, "tasks/main.py", add_task_args)
        result = finetune(flags, ignored, task_args)
    return result.state.history, [(epoch, acc) for epoch, acc, _ in result.accuracies]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    vocab = write_vocab(d / "vocab.txt")
    write_mnli(d / "train.tsv", 192, seed=1)
    write_mnli(d / "dev_matched.tsv", 96, seed=2)
    write_race(d / "race" / "train" / "middle", 40, seed=1)
    write_race(d / "race" / "dev" / "middle", 16, seed=2)
    # a pretrain_bert.py checkpoint (2 steps on its synthetic data: the weights fine-tuning starts from)
    argv = [*MODEL, "--vocab-file", str(vocab), "--mock-data", "--train-iters", "2", "--lr", "1e-4",
            "--eval-iters", "0", "--save", str(d / "bert")]
    assert run_distributed(run_cli, 1, argv, body="pretrain", timeout=300) == [0]
    return d


def mnli_argv(d, save=None):
    return [*MODEL, *TUNE, "--vocab-file", str(d / "vocab.txt"), "--task", "MNLI", "--epochs", "10",
            "--train-data", str(d / "train.tsv"), "--valid-data", str(d / "dev_matched.tsv"),
            "--pretrained-checkpoint", str(d / "bert"), *(["--save", str(save)] if save else [])]


@pytest.fixture(scope="module")
def mnli(data):
    """One process, 10 epochs of 24 iterations, saving every epoch."""
    (result,) = run_distributed(run_cli, 1, mnli_argv(data, data / "mnli"), timeout=300)
    return result


def test_mnli_learns_with_accuracy_and_checkpoint_per_epoch(data, mnli):
    losses, accuracies = mnli
    assert [e for e, _ in accuracies] == list(range(10)) and len(losses) == 240
    assert accuracies[-1][1] >= 0.9  # chance: 1/3
    tracker = (data / "mnli" / "latest_checkpointed_iteration.txt").read_text().strip()
    steps = sorted(int(p.name[len("global_step"):]) for p in (data / "mnli").glob("global_step*"))
    assert tracker == "240" and steps == [24 * e for e in range(1, 11)]
    meta = json.loads((data / "mnli" / "global_step240" / "megatron_ds_config.json").read_text())
    assert meta["model_family"] == "bert_mnli"


def test_evaluate_only_reloads_the_saved_model(data, mnli):
    """--epochs 0 with --load: the saved fine-tuned model evaluated again gives the last epoch's accuracy."""
    argv = [*mnli_argv(data)[:-2], "--load", str(data / "mnli")]
    argv[argv.index("--epochs") + 1] = "0"
    (result,) = run_distributed(run_cli, 1, argv, timeout=300)
    assert result[1] == [(-1, mnli[1][-1][1])]


def test_race_learns(data):
    argv = [*MODEL, *TUNE, "--vocab-file", str(data / "vocab.txt"), "--task", "RACE", "--epochs", "2",
            "--train-data", str(data / "race" / "train" / "middle"),
            "--valid-data", str(data / "race" / "dev" / "middle"), "--pretrained-checkpoint", str(data / "bert")]
    (result,) = run_distributed(run_cli, 1, argv, timeout=300)
    assert result[1][-1][1] >= 0.9  # chance: 1/4


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_match_one_process(data, mnli, tp, pp):
    argv = [*mnli_argv(data), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    results = run_distributed(run_cli, 2, argv, timeout=600)
    losses, accuracies = results[-1]  # the last rank holds the last stage
    ours, reference = [loss for _, loss in losses], [loss for _, loss in mnli[0]]
    assert ours[:STRICT] == pytest.approx(reference[:STRICT], rel=RTOL)
    assert ours == pytest.approx(reference, rel=1e-2)
    assert accuracies == mnli[1]
    assert results[0][1] == results[-1][1]  # every rank reports the same accuracies


@pytest.fixture
def own_environ():
    """The GPT-checkpoint case below joins a one-process job in this process, which exports RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE ... (launch.env.apply_dist_env): keep them out of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_flags_are_checked_before_anything_starts(data, capsys, own_environ):
    from megatron_ds.cli.tasks import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--task", "MNLI", "--epoch", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --epoch 3 (did you mean --epochs?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*MODEL, "--task", "MNLI", "--valid-data", "dev.tsv", "--epochs", "1"])
    assert "--epochs 1 needs --train-data" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # Megatron's zero-shot tasks: tools/evaluate.py's command line
        main(["--task", "LAMBADA", "--load", "ckpt"])
    assert "--task LAMBADA needs exactly one --valid-data file" in capsys.readouterr().err
    # a GPT checkpoint: Megatron's tasks fine-tune BERT
    gpt = data / "gpt" / "global_step1"
    gpt.mkdir(parents=True)
    (data / "gpt" / "latest_checkpointed_iteration.txt").write_text("1")
    (gpt / "megatron_ds_config.json").write_text(json.dumps({"model_family": "gpt"}))
    argv = mnli_argv(data)
    argv[argv.index("--pretrained-checkpoint") + 1] = str(data / "gpt")
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: --pretrained-checkpoint {data / 'gpt'} holds a gpt model")


def test_dry_run_counts_the_task_model(data, capsys):
    """--dry-run at TP 2 x PP 2: each stage of the RACE model built on the meta device holds what the
    analytic count (BERT's layers to the final norm, then pooler and task linear) says."""
    from megatron_ds.cli.tasks import main

    argv = [*MODEL, "--vocab-file", str(data / "vocab.txt"), "--task", "RACE", "--epochs", "1", "--train-data", "x",
            "--valid-data", "y", "--lr", "1e-4", "--dry-run", "--world-size", "4",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert main(argv) == 0
    built = [line for line in capsys.readouterr().out.splitlines() if "parameters built" in line]
    assert len(built) == 2 and all("(+0.00%)" in line for line in built), built
