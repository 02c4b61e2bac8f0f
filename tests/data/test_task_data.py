"""The GLUE and RACE readers against hand-built expectations: which columns each file format feeds
into a sample, Megatron's ``[CLS] A [SEP] B [SEP]`` layout with its trimming and padding (token types
padded with the pad id, as tasks/data_utils.py does), RACE's question/option merge and labels."""
import json

import pytest

from megatron_ds.data.glue import ClassificationDataset, pair_ids, read_mnli, read_qqp
from megatron_ds.data.race import read_race
from megatron_ds.data.wordpiece import BertWordPieceTokenizer
from megatron_ds.errors import DataError
from tests.families.bert.task_data import MNLI_HEADER

TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d", "x", "y", "."]
ID = {t: i for i, t in enumerate(TOKENS)}


@pytest.fixture
def tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(TOKENS) + "\n")
    return BertWordPieceTokenizer(str(tmp_path / "vocab.txt"))


def ids(text):
    return [ID[t] for t in text.split()]


def test_pair_layout_trims_and_pads_as_megatron():
    # short: [CLS] a [SEP] b b [SEP] + padding (types padded with the pad id 0)
    assert pair_ids([5], [6, 6], 8, 2, 3, 0) == ([2, 5, 3, 6, 6, 3, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0],
                                                 [1, 1, 1, 1, 1, 1, 0, 0])
    # too long: cut to max - 1, then [SEP] with B's type
    assert pair_ids([5, 5], [6, 6, 6, 6], 6, 2, 3, 0) == ([2, 5, 5, 3, 6, 3], [0, 0, 0, 0, 1, 1], [1] * 6)
    # one sentence, not trimmed: no closing [SEP]
    assert pair_ids([5], None, 4, 2, 3, 0) == ([2, 5, 3, 0], [0, 0, 0, 0], [1, 1, 1, 0])


def test_mnli_and_qqp_files(tmp_path, tokenizer):
    mnli = tmp_path / "dev_matched.tsv"
    row = ["7", "1", "1", "fiction", "()", "()", "()", "()", "a  b .", "c\td", "neutral"]
    row[9] = "c d"
    mnli.write_text(MNLI_HEADER + "\n" + "\t".join(row[:10] + ["x", "neutral"]) + "\n")
    (sample,) = read_mnli(str(mnli))
    assert sample == {"text_a": "a b .", "text_b": "c d", "label": 2, "uid": 7}
    item = ClassificationDataset("MNLI", [sample], tokenizer, 10)[0]
    assert item["text"].tolist() == [2, *ids("a b ."), 3, *ids("c d"), 3, 0, 0]
    assert item["types"].tolist() == [0] * 5 + [1] * 3 + [0] * 2 and item["label"] == 2
    test_file = tmp_path / "test_matched.tsv"  # 10 columns: no label, Megatron's "contradiction"
    test_file.write_text("\t".join(f"h{i}" for i in range(10)) + "\n" + "\t".join(row[:10]) + "\n")
    assert read_mnli(str(test_file))[0]["label"] == 0
    qqp = tmp_path / "train.tsv"
    qqp.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n3\t1\t2\ta b\tc\t1\n"
                   "4\t1\t2\tbroken row\n5\t1\t2\t\tc\t0\n")  # a short row and an empty question are skipped
    assert read_qqp(str(qqp)) == [{"text_a": "a b", "text_b": "c", "label": 1, "uid": 3}]
    (tmp_path / "bad.tsv").write_text(MNLI_HEADER + "\n" + "\t".join(row[:10] + ["x", "maybe"]) + "\n")
    with pytest.raises(DataError, match="bad.tsv:2: label 'maybe'"):
        read_mnli(str(tmp_path / "bad.tsv"))


def test_race_folder(tmp_path, tokenizer):
    article = {"article": "x  y .", "questions": ["a _ b", "c"], "options": [["d", "x", "y", "a"]] * 2,
               "answers": ["C", "A"]}
    (tmp_path / "high").mkdir()
    (tmp_path / "high" / "1.txt").write_text(json.dumps(article) + "\n")
    (tmp_path / "high" / "notes.md").write_text("not an article")
    first, second = read_race(str(tmp_path / "high"), tokenizer, 9)
    # "_" replaced by the option; text B the article; one row per option
    assert first["text"][0].tolist() == [2, *ids("a d b"), 3, *ids("x y ."), 3]
    assert first["text"][3].tolist() == [2, *ids("a a b"), 3, *ids("x y ."), 3]
    assert first["label"] == 2 and second["label"] == 0 and first["text"].shape == (4, 9)
    # no "_": the option follows the question after a space
    assert second["text"][1].tolist() == [2, *ids("c x"), 3, *ids("x y ."), 3, 0]
    assert second["padding_mask"][1].tolist() == [1] * 8 + [0]
    with pytest.raises(DataError, match="no RACE article"):
        read_race(str(tmp_path / "empty"), tokenizer, 9)
