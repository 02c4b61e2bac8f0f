"""tools/preprocess_data.py on an input without documents: an error, or a loud warning with
--allow-empty -- never a silent 0-token data set."""
import importlib
import os

preprocess_data = importlib.import_module("megatron_ds.cli.preprocess_data")


def _run(tmp_path, lines, *extra):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(lines))
    prefix = tmp_path / "out"
    rc = preprocess_data.main(["--input", str(inp), "--output-prefix", str(prefix), "--tokenizer-type",
                               "NullTokenizer", "--vocab-size", "100", *extra])
    return rc, str(prefix) + "_text_document"


def test_empty_input_is_an_error(tmp_path, capsys):
    rc, prefix = _run(tmp_path, [])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"error: no documents with text under key(s) text in {tmp_path / 'in.jsonl'}" in err
    assert "--allow-empty" in err
    assert not os.path.exists(prefix + ".idx") and not os.path.exists(prefix + ".bin")


def test_only_empty_documents_is_an_error(tmp_path, capsys):
    rc, _ = _run(tmp_path, ['{"text": ""}\n', "\n", '{"text": ""}\n'])
    assert rc == 1 and "no documents with text" in capsys.readouterr().err


def test_allow_empty_writes_with_a_warning(tmp_path, capsys):
    rc, prefix = _run(tmp_path, [], "--allow-empty")
    err = capsys.readouterr().err
    assert rc == 0
    assert "WARNING: no documents with text under key(s) text" in err and "EMPTY data set" in err
    assert os.path.getsize(prefix + ".bin") == 0 and os.path.exists(prefix + ".idx")
