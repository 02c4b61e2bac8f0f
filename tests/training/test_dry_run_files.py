"""--dry-run checks the files the run will use (pretrain_gpt.py's main, no processes): what start-up
would refuse after the queue is refused now in one line; doubtful inputs are warnings."""
import os
import shutil

import pytest

from megatron_ds.families import main
from tests.data.test_gpt_dataset import write_dataset

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 127 --eval-interval 5 "
        "--eval-iters 1 --dry-run --world-size 1").split()


@pytest.fixture
def corpus(tmp_path):
    """40 documents, and 2 (a --split 949,50,1 leaves them no validation or test documents)."""
    return (write_dataset(tmp_path / "big", [[1, 2, 3, 4]] * 40), write_dataset(tmp_path / "small", [[5, 6]] * 2))


def _run(capsys, *flags):
    rc = main(BASE + list(flags))
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def _refused(capsys, *flags) -> str:
    rc, _, err = _run(capsys, *flags)
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_half_a_dataset_names_the_missing_file(capsys, corpus, tmp_path):
    big, _ = corpus
    no_idx, no_bin = str(tmp_path / "no_idx"), str(tmp_path / "no_bin")
    shutil.copy(f"{big}.bin", f"{no_idx}.bin")
    shutil.copy(f"{big}.idx", f"{no_bin}.idx")
    assert _refused(capsys, "--data-path", no_idx) == \
        f"error: dataset {no_idx} is incomplete: {no_idx}.idx is missing ({no_idx}.bin exists)"
    # in a blend too, and for the separate train/valid/test paths
    assert _refused(capsys, "--data-path", "0.5", big, "0.5", no_bin) == \
        f"error: dataset {no_bin} is incomplete: {no_bin}.bin is missing ({no_bin}.idx exists)"
    assert _refused(capsys, "--train-data-path", big, "--valid-data-path", str(tmp_path / "gone")) == \
        f"error: no dataset at {tmp_path / 'gone'}: expected {tmp_path / 'gone'}.bin and {tmp_path / 'gone'}.idx"


def test_truncated_data_bad_weights_and_missing_tokenizer_files(capsys, corpus, tmp_path):
    big, _ = corpus
    cut = str(tmp_path / "cut")
    shutil.copy(f"{big}.idx", f"{cut}.idx")
    with open(f"{cut}.bin", "wb") as f:
        f.write(open(f"{big}.bin", "rb").read()[:100])
    assert "the data file is truncated" in _refused(capsys, "--data-path", cut)
    assert "is not a weight" in _refused(capsys, "--data-path", big, "0.5", big, "0.5")
    assert "a blend is pairs of WEIGHT PATH" in _refused(capsys, "--data-path", "0.5", big, big)
    assert "must be a finite number >= 0" in _refused(capsys, "--data-path", "-1", big, "2", big)
    missing = str(tmp_path / "vocab.json")
    assert _refused(capsys, "--data-path", big, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", missing,
                    "--merge-file", missing).startswith(f"error: --vocab-file {missing} does not exist")


def test_empty_evaluation_splits_and_absent_load_are_warnings(capsys, corpus, tmp_path):
    big, small = corpus
    rc, out, err = _run(capsys, "--data-path", small, "--split", "949,50,1", "--load", str(tmp_path / "ckpt"))
    assert rc == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert warnings == [
        f"WARNING: --split 949,50,1 leaves the valid split of {small} without documents (2 in total): no valid "
        f"dataset, its evaluation is skipped (as in Megatron-DeepSpeed)",
        f"WARNING: --split 949,50,1 leaves the test split of {small} without documents (2 in total): no test "
        f"dataset, its evaluation is skipped (as in Megatron-DeepSpeed)",
        f"WARNING: --load {tmp_path / 'ckpt'} does not exist: the run will start from scratch"]
    os.mkdir(tmp_path / "ckpt")
    rc, out, _ = _run(capsys, "--data-path", big, "--load", str(tmp_path / "ckpt"))
    assert rc == 0 and f"WARNING: --load {tmp_path / 'ckpt'} holds no checkpoint" in out
    # an empty train split is still refused
    assert "leaves the train split" in _refused(capsys, "--data-path", small, "--split", "1,1,1")


def test_save_must_be_writable_and_is_not_created(capsys, corpus, tmp_path):
    big, _ = corpus
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert _refused(capsys, "--data-path", big, "--save", str(blocker / "ckpt")) == (
        f"error: --save {blocker / 'ckpt'} is not writable (Not a directory: {blocker}); choose a directory this "
        f"job can write to")
    rc, _, err = _run(capsys, "--data-path", big, "--save", str(tmp_path / "new" / "ckpt"))
    assert rc == 0, err
    assert not (tmp_path / "new").exists()  # a dry run leaves no trace


def test_too_little_room_for_a_checkpoint_is_a_warning_in_a_dry_run(capsys, corpus, tmp_path, monkeypatch):
    import collections
    import shutil as sh

    big, _ = corpus
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    rc, out, err = _run(capsys, "--data-path", big, "--save", str(tmp_path / "ckpt"))
    assert rc == 0, err
    warning = next(line for line in out.splitlines() if line.startswith(f"WARNING: --save {tmp_path / 'ckpt'} has"))
    # in the unit that fits; no --keep-last: pruning runs after a save, it cannot make room for the first
    assert warning.startswith(f"WARNING: --save {tmp_path / 'ckpt'} has 1 KB free, but one checkpoint needs about ")
    assert warning.endswith(" KB (estimated from the parameter count); free space or choose another --save"), warning
