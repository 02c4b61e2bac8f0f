#!/bin/bash
# Download the GPT-2 BPE vocabulary (gpt2-vocab.json) and merges (gpt2-merges.txt), the files
# behind --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ....
#
#   bash dataset/download_gpt2_vocab.sh [OUT_DIR]      # default: $DATA_DIR/gpt2 = ./data/gpt2
#
# Needs internet (run it on a login node) and curl or wget. Each file is checked (50257 tokens,
# 50000 merges) before it replaces anything, and files already present and valid are kept, so
# running it again is cheap. Mirrors are tried in order; override with VOCAB_URLS / MERGES_URLS
# (space-separated) if your site has its own copy.
set -euo pipefail

OUT_DIR=${1:-${DATA_DIR:-$PWD/data}/gpt2}
VOCAB_URLS=${VOCAB_URLS:-"https://huggingface.co/openai-community/gpt2/resolve/main/vocab.json
  https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-vocab.json"}
MERGES_URLS=${MERGES_URLS:-"https://huggingface.co/openai-community/gpt2/resolve/main/merges.txt
  https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-merges.txt"}
PYTHON=${PYTHON:-python3}
DOWNLOADER=${DOWNLOADER:-}   # curl or wget; default: whichever is installed, curl first

die() { echo "ERROR: $*" >&2; exit 1; }

pick_downloader() {
  if [ -z "$DOWNLOADER" ]; then
    if command -v curl >/dev/null 2>&1; then DOWNLOADER=curl
    elif command -v wget >/dev/null 2>&1; then DOWNLOADER=wget
    else die "neither curl nor wget is installed"
    fi
  fi
  command -v "$DOWNLOADER" >/dev/null 2>&1 || die "DOWNLOADER=$DOWNLOADER is not installed"
}

fetch() {  # fetch URL FILE: non-zero on any HTTP or network error
  case "$DOWNLOADER" in
    curl) curl -fsSL --retry 3 --connect-timeout 30 -o "$2" "$1" ;;
    wget) wget -q --tries=3 --timeout=30 -O "$2" "$1" ;;
    *) die "unknown DOWNLOADER=$DOWNLOADER (use curl or wget)" ;;
  esac
}

# Checks a vocab/merges file by content, so an HTML error page or a truncated download is
# never mistaken for the real thing. Prints the reason and fails when the file is wrong.
check() {
  "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "vocab":
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
        if not isinstance(vocab, dict):
            ok, why = False, "not a JSON object"
        else:
            eod = vocab.get("<|endoftext|>")
            ok = len(vocab) == 50257 and eod == 50256
            why = f"{len(vocab)} entries, <|endoftext|> = {eod}"
    else:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        merges = [line for line in lines[1:] if line]
        ok = (lines[0].startswith("#version") and len(merges) == 50000
              and all(len(m.split(" ")) == 2 for m in merges))
        why = f"header {lines[0][:20]!r}, {len(merges)} merges"
except (OSError, ValueError) as exc:
    ok, why = False, str(exc)
if not ok:
    print(f"{path}: not a GPT-2 {kind} file ({why}; expected 50257 tokens / 50000 merges)",
          file=sys.stderr)
    sys.exit(1)
EOF
}

download() {  # download KIND NAME "URL..."
  local kind=$1 target="$OUT_DIR/$2" urls=$3 url
  if [ -f "$target" ] && check "$kind" "$target" 2>/dev/null; then
    echo "ok: $target (already present)"
    return 0
  fi
  for url in $urls; do
    echo "downloading $url"
    if fetch "$url" "$target.part" && check "$kind" "$target.part"; then
      mv -f "$target.part" "$target"  # only a verified file replaces the target
      echo "ok: $target"
      return 0
    fi
    echo "  failed: $url" >&2
  done
  rm -f "$target.part"
  die "could not download a valid $2 from: $(tr -s ' \n' ' ' <<< "$urls")"
}

pick_downloader
mkdir -p "$OUT_DIR"
download vocab gpt2-vocab.json "$VOCAB_URLS"
download merges gpt2-merges.txt "$MERGES_URLS"
echo "use: --tokenizer-type GPT2BPETokenizer --vocab-file $OUT_DIR/gpt2-vocab.json" \
  "--merge-file $OUT_DIR/gpt2-merges.txt"
