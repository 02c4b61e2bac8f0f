"""The generated parser: Megatron-DeepSpeed flag names, compat flags, errors; and --dry-run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.config import build_parser, parse_args
from megatron_ds.families import main

REPO = Path(__file__).resolve().parents[2]

# The flags of Megatron-DeepSpeed's GPT example launch script (examples_deepspeed), as users write them.
MEGATRON_DS_SCRIPT = """
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 --hidden-size 64
--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2
--global-batch-size 8 --train-iters 100 --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine
--lr-warmup-iters 10 --lr-decay-iters 90 --split 949,50,1 --log-interval 10 --eval-interval 50
--eval-iters 2 --save-interval 50 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234 --num-workers 0
--data-impl mmap --distributed-backend nccl --tokenizer-type GPT2BPETokenizer --vocab-file v.json
--merge-file m.txt --data-path 0.5 a_text_document 0.5 b_text_document --save ck --load ck
--tensorboard-dir tb --log-timers-to-tensorboard --log-batch-size-to-tensorboard
--log-validation-ppl-to-tensorboard --checkpoint-activations --deepspeed-activation-checkpointing
--deepspeed --deepspeed_config ds.json --zero-stage 1 --no-masked-softmax-fusion --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-gradient-accumulation-fusion --use-flash-attn-v2 --partition-activations
--exit-duration-in-mins 230 --local_rank 0
""".split()


def test_megatron_deepspeed_script_parses():
    cfg, ignored = parse_args(MEGATRON_DS_SCRIPT)
    assert cfg.model.num_layers == 2 and cfg.optimizer.lr == 6.0e-4 and cfg.optimizer.lr_decay_style == "cosine"
    assert cfg.data.data_path == ["0.5", "a_text_document", "0.5", "b_text_document"]
    assert cfg.deepspeed.deepspeed and cfg.deepspeed.deepspeed_config == "ds.json"
    assert cfg.training.checkpoint_activations and cfg.deepspeed.zero_stage == 1
    assert "--no-masked-softmax-fusion" in ignored and "--use-flash-attn-v2" in ignored
    assert cfg.parallel.local_rank == 0


@pytest.mark.parametrize("flag", ["--local_rank", "--local-rank"])
def test_both_local_rank_spellings(flag):
    cfg, _ = parse_args([f"{flag}=3"])
    assert cfg.parallel.local_rank == 3


# Misspellings seen in launch scripts -> the Megatron-DeepSpeed flag meant (megatron/arguments.py).
TYPOS = {"--num-layer": "--num-layers", "--hidden_size": "--hidden-size", "--num_layers": "--num-layers",
         "--lr_decay_style": "--lr-decay-style", "--global-batch": "--global-batch-size"}


@pytest.mark.parametrize("typo", TYPOS)
def test_a_misspelt_flag_is_refused_naming_the_flag_meant(capsys, typo):
    with pytest.raises(SystemExit) as exc:
        parse_args([typo, "2"])  # no abbreviation matching: --global-batch is not taken for --global-batch-size
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"pretrain_gpt.py: error: unrecognized arguments: {typo} 2 (did you mean {TYPOS[typo]}?)")


def test_several_misspelt_flags_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--num_layers=2", "--no-such-thing", "--global-batch", "8"])
    assert capsys.readouterr().err.splitlines()[0] == (
        "pretrain_gpt.py: error: unrecognized arguments: --num_layers=2 --no-such-thing --global-batch 8 "
        "(did you mean --num-layers for --num_layers, --global-batch-size for --global-batch?)")


def test_unsupported_flag_says_what_to_do(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--num-experts-switch", "8"])
    assert "--num-experts N --topk 1" in capsys.readouterr().err


def test_inverted_booleans_and_defaults():
    cfg, _ = parse_args(["--no-load-optim", "--disable-bias-linear"])
    assert cfg.checkpoint.load_optim is False and cfg.checkpoint.load_rng is True
    assert cfg.model.add_bias_linear is False
    cfg, _ = parse_args([])
    assert cfg.checkpoint.load_optim is True and cfg.model.add_bias_linear is True
    assert cfg.training.seed == 1234 and cfg.model.make_vocab_size_divisible_by == 128


def test_help_comes_from_field_docstrings():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    assert "Pad the vocabulary to a multiple of this times the tensor parallel size" in text
    assert "--deepspeed_config" in text and "--use-mpi" in text


TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 1000").split()


def test_dry_run_prints_layout(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    rc = main(TINY + ["--dry-run", "--world-size", "8", "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                      "--deepspeed_config", str(ds), "--sequence-parallel", "--save", str(tmp_path / "ckpt"),
                      "--eval-interval", "7"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "world size 8 = TP 2 x PP 2 x DP 2" in out
    assert "micro-batches per step per data parallel rank: 4" in out
    assert "stage 1: layers 2-3" in out
    # the resolved Run, section by section: what the run will read, not the flags as typed
    assert "sequence parallel: on; recompute: none" in out
    assert "training: seed 1234, eval_interval 7," in out
    assert f"checkpoint: save '{tmp_path / 'ckpt'}'," in out and "optimizer: optimizer 'adam'," in out
    ds_json = json.loads(out[out.index("DeepSpeed config:") + len("DeepSpeed config:"):])
    assert ds_json["train_batch_size"] == 16 and ds_json["zero_optimization"]["stage"] == 1


def test_dry_run_rejects_with_message_and_exit_code():
    # a real subprocess: the user-facing behaviour is one line on stderr and a non-zero exit, no traceback
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *TINY, "--dry-run", "--world-size", "6",
                           "--tensor-model-parallel-size", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "error: world size 6 is not divisible by TP x PP = 4 x 1 = 4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_missing_json_file(capsys):
    assert main(TINY + ["--dry-run", "--deepspeed_config", "/nonexistent/ds.json"]) == 1
    assert "--deepspeed_config /nonexistent/ds.json: no such file" in capsys.readouterr().err
