#!/bin/bash
# Download TinyStories (short English stories; a small public corpus for trying out training) and
# turn it into Megatron's .bin/.idx format with the GPT-2 tokenizer:
#
#   bash dataset/prepare_tinystories.sh [OUT_DIR]       # default: $DATA_DIR/tinystories
#
# writes OUT_DIR/tinystories_<SPLIT>_text_document.{bin,idx}. SPLIT=train (default, ~2 GB of text,
# ~0.5e9 tokens) is the default DATA_PATH of scripts/abci/; SPLIT=valid (~20 MB) is a minutes-long
# try-out. Download on a login node (internet), e.g. with DOWNLOAD_ONLY=1, and tokenize the train
# split inside a compute job (qrsh / qsub -I) where WORKERS can use many cores: every step is
# skipped when its output already exists, so running the script again resumes where it stopped.
#
# Variables: SPLIT (train|valid), DATA_DIR (default ./data), VOCAB_FILE, MERGE_FILE (downloaded
# when missing), WORKERS (tokenizer processes; default: all cores), PYTHON, TINYSTORIES_BASE_URL,
# DOWNLOADER (curl|wget), PREPROCESS_TOOL (default: the repo's tools/preprocess_data.py).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
DATA_DIR=${DATA_DIR:-$PWD/data}
OUT_DIR=${1:-$DATA_DIR/tinystories}
SPLIT=${SPLIT:-train}
BASE_URL=${TINYSTORIES_BASE_URL:-https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main}
TINYSTORIES_URL=$BASE_URL/TinyStoriesV2-GPT4-$SPLIT.txt
VOCAB_FILE=${VOCAB_FILE:-$DATA_DIR/gpt2/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$DATA_DIR/gpt2/gpt2-merges.txt}
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 4)}
PYTHON=${PYTHON:-python3}
PREPROCESS_TOOL=${PREPROCESS_TOOL:-$REPO/tools/preprocess_data.py}
DOWNLOADER=${DOWNLOADER:-}

die() { echo "ERROR: $*" >&2; exit 1; }
case "$SPLIT" in valid|train) ;; *) die "SPLIT=$SPLIT: use train or valid" ;; esac

TEXT="$OUT_DIR/TinyStoriesV2-GPT4-$SPLIT.txt"
JSONL="$OUT_DIR/tinystories_$SPLIT.jsonl"
PREFIX="$OUT_DIR/tinystories_$SPLIT"
mkdir -p "$OUT_DIR"

# 1. Download (to .part first: an interrupted download is never taken for the corpus).
if [ ! -s "$TEXT" ]; then
  if [ -z "$DOWNLOADER" ]; then
    if command -v curl >/dev/null 2>&1; then DOWNLOADER=curl
    elif command -v wget >/dev/null 2>&1; then DOWNLOADER=wget
    else die "neither curl nor wget is installed"
    fi
  fi
  echo "downloading $TINYSTORIES_URL"
  case "$DOWNLOADER" in
    curl) curl -fL --retry 3 --connect-timeout 30 -o "$TEXT.part" "$TINYSTORIES_URL" ;;
    wget) wget --tries=3 --timeout=30 -O "$TEXT.part" "$TINYSTORIES_URL" ;;
    *) die "unknown DOWNLOADER=$DOWNLOADER (use curl or wget)" ;;
  esac || { rm -f "$TEXT.part"; die "download failed: $TINYSTORIES_URL"; }
  [ -s "$TEXT.part" ] || { rm -f "$TEXT.part"; die "downloaded file is empty: $TINYSTORIES_URL"; }
  mv -f "$TEXT.part" "$TEXT"
else
  echo "ok: $TEXT (already present)"
fi
if [ ! -f "$VOCAB_FILE" ] || [ ! -f "$MERGE_FILE" ]; then
  [ "$(dirname "$VOCAB_FILE")" = "$(dirname "$MERGE_FILE")" ] || die "VOCAB_FILE and MERGE_FILE" \
    "are missing and in different folders: download them with dataset/download_gpt2_vocab.sh"
  DOWNLOADER=$DOWNLOADER PYTHON=$PYTHON \
    bash "$HERE/download_gpt2_vocab.sh" "$(dirname "$VOCAB_FILE")"
fi
if [ "${DOWNLOAD_ONLY:-0}" = 1 ]; then
  echo "DOWNLOAD_ONLY=1: stopping before conversion"
  exit 0
fi

# 2. Text -> JSONL: TinyStories separates stories with <|endoftext|>.
if [ ! -s "$JSONL" ]; then
  "$PYTHON" "$HERE/text_to_jsonl.py" --input "$TEXT" --output "$JSONL" --separator '<|endoftext|>'
else
  echo "ok: $JSONL (already present)"
fi

# 3. JSONL -> .bin/.idx; --append-eod marks document ends so samples can span documents.
if [ -f "${PREFIX}_text_document.bin" ] && [ -f "${PREFIX}_text_document.idx" ]; then
  echo "ok: ${PREFIX}_text_document.{bin,idx} (already present)"
else
  [ -f "$PREPROCESS_TOOL" ] || die "preprocessing tool not found: $PREPROCESS_TOOL"
  "$PYTHON" "$PREPROCESS_TOOL" \
    --input "$JSONL" \
    --output-prefix "$PREFIX" \
    --json-keys text \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --append-eod \
    --workers "$WORKERS"
fi
echo "use: --data-path ${PREFIX}_text_document --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE"
