"""dataset/ scripts with the network stubbed: a fake curl/wget on PATH serves fixture files.

The vocabulary fixtures are synthetic files with GPT-2's shape (50257 tokens, 50000 merges);
the real GPT-2 files from ../shared are used where present.
"""
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.launch.helpers import PYTHON, REPO, clean_env, run_bounded

DATASET = REPO / "dataset"
SHARED_GPT2 = REPO / ".." / "shared" / "data" / "gpt2"


def load_text_to_jsonl():
    import importlib.util
    spec = importlib.util.spec_from_file_location("text_to_jsonl", DATASET / "text_to_jsonl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


t2j = load_text_to_jsonl()


# --------------------------------------------------------------------------- fixtures

def synthetic_vocab_and_merges(directory: Path):
    vocab = {f"tok{i}": i for i in range(50256)}
    vocab["<|endoftext|>"] = 50256
    (directory / "vocab.json").write_text(json.dumps(vocab))
    merges = ["#version: 0.2"] + [f"a{i} b{i}" for i in range(50000)]
    (directory / "merges.txt").write_text("\n".join(merges) + "\n")


class FakeNet:
    """A `curl`/`wget` stand-in: serves FIXTURES/<basename of URL>, logs every URL, 404s others."""

    def __init__(self, root: Path):
        self.fixtures = root / "fixtures"
        self.bin = root / "bin"
        self.log = root / "urls.log"
        self.fixtures.mkdir()
        self.bin.mkdir()
        script = f"""#!/bin/sh
out=""; url=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-O) out=$2; shift 2 ;;
    --retry|--connect-timeout) shift 2 ;;
    -*) shift ;;
    *) url=$1; shift ;;
  esac
done
echo "$(basename "$0") $url" >> "{self.log}"
src="{self.fixtures}/$(basename "$url")"
[ -f "$src" ] || exit 22
cp "$src" "$out"
"""
        for tool in ("curl", "wget"):
            (self.bin / tool).write_text(script)
            (self.bin / tool).chmod(0o755)

    def env(self, **overrides):
        return clean_env(PATH=f"{self.bin}:{os.environ['PATH']}", PYTHON=PYTHON, **overrides)

    def calls(self):
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def net(tmp_path):
    fake = FakeNet(tmp_path)
    synthetic_vocab_and_merges(fake.fixtures)
    return fake


@pytest.mark.parametrize("path", sorted(DATASET.glob("*.sh")), ids=lambda p: p.name)
def test_bash_syntax(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- download_gpt2_vocab.sh

def test_vocab_download_verify_and_skip(tmp_path, net):
    out = tmp_path / "gpt2"
    result = run_bounded(["bash", DATASET / "download_gpt2_vocab.sh", out], net.env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert (out / "gpt2-vocab.json").read_bytes() == (net.fixtures / "vocab.json").read_bytes()
    assert (out / "gpt2-merges.txt").read_bytes() == (net.fixtures / "merges.txt").read_bytes()
    assert net.calls() == [
        "curl https://huggingface.co/openai-community/gpt2/resolve/main/vocab.json",
        "curl https://huggingface.co/openai-community/gpt2/resolve/main/merges.txt"]
    assert not list(out.glob("*.part"))
    # Second run: valid files are kept, nothing is fetched.
    result = run_bounded(["bash", DATASET / "download_gpt2_vocab.sh", out], net.env(), timeout=60)
    assert result.returncode == 0 and len(net.calls()) == 2
    assert "already present" in result.stdout


def test_vocab_bad_mirror_falls_back(tmp_path, net):
    # The first mirror answers with an error page: it must not be kept as the vocabulary.
    (net.fixtures / "bad-vocab.json").write_text("<html>rate limited</html>")
    shutil.copy(net.fixtures / "vocab.json", net.fixtures / "gpt2-vocab.json")
    env = net.env(VOCAB_URLS="https://a.example/bad-vocab.json https://b.example/gpt2-vocab.json",
                  DOWNLOADER="wget")
    out = tmp_path / "gpt2"
    result = run_bounded(["bash", DATASET / "download_gpt2_vocab.sh", out], env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "gpt2-vocab.json").read_text())["<|endoftext|>"] == 50256
    assert [c.split()[0] for c in net.calls()] == ["wget"] * 3
    assert "not a GPT-2 vocab file" in result.stderr


def test_vocab_all_mirrors_fail(tmp_path, net):
    env = net.env(MERGES_URLS="https://a.example/missing.txt https://b.example/gone.txt")
    out = tmp_path / "gpt2"
    result = run_bounded(["bash", DATASET / "download_gpt2_vocab.sh", out], env, timeout=60)
    assert result.returncode != 0
    assert "could not download a valid gpt2-merges.txt" in result.stderr
    assert not (out / "gpt2-merges.txt").exists() and not list(out.glob("*.part"))


@pytest.mark.skipif(not (SHARED_GPT2 / "gpt2-vocab.json").exists() or not shutil.which("curl"),
                    reason="needs curl and the GPT-2 files in ../shared/data/gpt2")
def test_vocab_real_curl_real_files(tmp_path):
    # Real curl with its real flags, fetching file:// URLs: no network, real GPT-2 files.
    env = clean_env(PYTHON=PYTHON,
                    VOCAB_URLS=(SHARED_GPT2 / "gpt2-vocab.json").resolve().as_uri(),
                    MERGES_URLS=(SHARED_GPT2 / "gpt2-merges.txt").resolve().as_uri())
    result = run_bounded(["bash", DATASET / "download_gpt2_vocab.sh", tmp_path], env, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        assert (tmp_path / name).read_bytes() == (SHARED_GPT2 / name).read_bytes()


# --------------------------------------------------------------------------- prepare_tinystories.sh

STORIES = ["Once upon a time, a cat sat.\n",
           "  Tom saw a dog. 「こんにちは」 said the dog.  ",
           "\n",
           "The end! \U0001F600\n\nNew paragraph."]


def recording_preprocess_tool(directory: Path) -> Path:
    """Stands in for tools/preprocess_data.py: records its argv, writes the outputs it names."""
    tool = directory / "fake_preprocess.py"
    tool.write_text(
        "import json, sys\n"
        "argv = sys.argv[1:]\n"
        "prefix = argv[argv.index('--output-prefix') + 1]\n"
        "open(prefix + '.argv.json', 'w').write(json.dumps(argv))\n"
        "for ext in ('bin', 'idx'):\n"
        "    open(prefix + '_text_document.' + ext, 'w').close()\n")
    return tool


def test_prepare_tinystories_steps(tmp_path, net):
    (net.fixtures / "TinyStoriesV2-GPT4-valid.txt").write_text("<|endoftext|>".join(STORIES))
    tool = recording_preprocess_tool(tmp_path)
    data = tmp_path / "data"
    env = net.env(SPLIT="valid", DATA_DIR=data, PREPROCESS_TOOL=tool, WORKERS=3)
    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"], env, cwd=tmp_path,
                         timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr

    out = data / "tinystories"
    docs = [json.loads(line)["text"] for line in (out / "tinystories_valid.jsonl").open()]
    assert docs == [s.strip() for s in STORIES if s.strip()]  # the empty story is dropped
    argv = json.loads((out / "tinystories_valid.argv.json").read_text())
    assert argv == ["--input", str(out / "tinystories_valid.jsonl"),
                    "--output-prefix", str(out / "tinystories_valid"), "--json-keys", "text",
                    "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", str(data / "gpt2" / "gpt2-vocab.json"),
                    "--merge-file", str(data / "gpt2" / "gpt2-merges.txt"),
                    "--append-eod", "--workers", "3"]
    assert [c.rsplit("/", 1)[1] for c in net.calls()] == [
        "TinyStoriesV2-GPT4-valid.txt", "vocab.json", "merges.txt"]

    # Everything exists now: a second run fetches and tokenizes nothing.
    (out / "tinystories_valid.argv.json").unlink()
    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"], env, cwd=tmp_path,
                         timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(net.calls()) == 3 and not (out / "tinystories_valid.argv.json").exists()


def test_prepare_tinystories_download_only_and_errors(tmp_path, net):
    (net.fixtures / "TinyStoriesV2-GPT4-train.txt").write_text("a<|endoftext|>b")
    data = tmp_path / "data"
    env = net.env(DATA_DIR=data, DOWNLOAD_ONLY=1)
    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"], env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (data / "tinystories" / "TinyStoriesV2-GPT4-train.txt").read_text() == "a<|endoftext|>b"
    assert not (data / "tinystories" / "tinystories_train.jsonl").exists()

    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"],
                         net.env(DATA_DIR=data, SPLIT="test"), timeout=30)
    assert result.returncode != 0 and "SPLIT=test: use train or valid" in result.stderr

    env = net.env(DATA_DIR=tmp_path / "other", SPLIT="valid",
                  TINYSTORIES_BASE_URL="https://x.example/gone")
    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"], env, timeout=30)
    assert result.returncode != 0 and "download failed" in result.stderr
    assert not list((tmp_path / "other" / "tinystories").glob("*.part"))


def gpt2_reference(transformers):
    """HF's GPT-2 tokenizer from the shared files (the keyword names changed in transformers 5)."""
    vocab, merges = str(SHARED_GPT2 / "gpt2-vocab.json"), str(SHARED_GPT2 / "gpt2-merges.txt")
    for kwargs in ({"vocab": vocab, "merges": merges},
                   {"vocab_file": vocab, "merges_file": merges}):
        try:
            tokenizer = transformers.GPT2TokenizerFast(**kwargs)
        except TypeError:
            continue
        if len(tokenizer) == 50257:
            return tokenizer
    pytest.skip("this transformers version cannot build GPT2TokenizerFast from local files")


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "tools" / "preprocess_data.py").exists()
                    or not (SHARED_GPT2 / "gpt2-vocab.json").exists(),
                    reason="needs tools/preprocess_data.py and ../shared/data/gpt2")
def test_prepare_tinystories_end_to_end(tmp_path, net):
    """The real preprocessing tool: token ids checked against HF's GPT-2 tokenizer."""
    transformers = pytest.importorskip("transformers")
    indexed = pytest.importorskip("megatron_ds.data.indexed_dataset")
    for name, fixture in (("gpt2-vocab.json", "vocab.json"), ("gpt2-merges.txt", "merges.txt")):
        shutil.copy(SHARED_GPT2 / name, net.fixtures / fixture)
    (net.fixtures / "TinyStoriesV2-GPT4-valid.txt").write_text("<|endoftext|>".join(STORIES))
    data = tmp_path / "data"
    env = net.env(SPLIT="valid", DATA_DIR=data, WORKERS=1)
    result = run_bounded(["bash", DATASET / "prepare_tinystories.sh"], env, cwd=tmp_path,
                         timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

    reference = gpt2_reference(transformers)
    expected = [reference.encode(s.strip()) + [50256] for s in STORIES if s.strip()]
    dataset = indexed.MMapIndexedDataset(str(data / "tinystories" /
                                             "tinystories_valid_text_document"))
    assert [list(map(int, dataset[i])) for i in range(len(dataset))] == expected


# --------------------------------------------------------------------------- text_to_jsonl.py

@pytest.mark.parametrize("chunk_chars", [1, 2, 5, 13, 1000])
def test_split_documents_across_chunk_boundaries(chunk_chars):
    text = "<|endoftext|>".join(STORIES) + "<|endoftext|>"
    chunks = t2j.read_chunks(io.StringIO(text), chunk_chars)
    assert list(t2j.split_documents(chunks, "<|endoftext|>")) == text.split("<|endoftext|>")


def test_convert_drops_empty_and_counts():
    dst = io.StringIO()
    written, dropped = t2j.convert(io.StringIO("a\n\n\n \n\nb c\n\n"), dst, "\n\n", key="body",
                                   chunk_chars=3, log_every=0)
    assert (written, dropped) == (2, 2)  # pieces: 'a', newline+space, 'b c', ''
    assert [json.loads(line) for line in dst.getvalue().splitlines()] == [{"body": "a"},
                                                                         {"body": "b c"}]


def test_text_to_jsonl_cli(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("x\n\ny\n\n日本語", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert t2j.main(["--input", str(src), "--output", str(out), "--separator", "\\n\\n"]) == 0
    assert [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()] \
        == ["x", "y", "日本語"]
    assert "wrote 3 documents" in capsys.readouterr().out

    assert t2j.main(["--input", str(tmp_path / "nope.txt"), "--output", str(out)]) == 1
    assert "input file not found" in capsys.readouterr().err

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    bad_out = tmp_path / "bad.jsonl"
    assert t2j.main(["--input", str(bad), "--output", str(bad_out)]) == 1
    assert "is not UTF-8 text" in capsys.readouterr().err
    assert not bad_out.exists() and not (tmp_path / "bad.jsonl.part").exists()
