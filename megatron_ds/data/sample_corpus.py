"""A real-text JSONL corpus any machine can make offline: the Python standard library's docstrings
and comments. Used by the quickstart, the end-to-end tests and the preprocessing benchmark, so none
of them needs a download."""
from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from pathlib import Path

_COMMENT = re.compile(r"^\s*#(.*)$", re.M)


def module_text(path: Path) -> str | None:
    """A module's docstrings (module, classes, functions) and comment lines, in source order."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc)
    comments = [m.group(1).strip() for m in _COMMENT.finditer(source)]
    if comments:
        parts.append("\n".join(c for c in comments if c))
    text = "\n\n".join(parts)
    return text if text.strip() else None


def stdlib_documents() -> list[str]:
    """One document per standard-library module (sorted by path, so the list is deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.parts):
            continue
        text = module_text(path)
        if text:
            docs.append(text)
    return docs


def write_corpus(path, target_mb: float, seed: int = 1234, base: list[str] | None = None):
    """Write >= target_mb of JSONL ({"text": text} per line). Later copies of the base documents
    shuffle their paragraphs so documents are not verbatim repeats.
    Returns (documents written, UTF-8 bytes of their text)."""
    base = base if base is not None else stdlib_documents()
    rng = random.Random(seed)
    written, text_bytes, out_bytes, repeat = 0, 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while out_bytes < target_mb * 1e6:
            order = list(range(len(base)))
            rng.shuffle(order)
            for i in order:
                paragraphs = base[i].split("\n\n")
                if repeat:
                    rng.shuffle(paragraphs)
                text = "\n\n".join(paragraphs)
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                written += 1
                text_bytes += len(text.encode("utf-8"))
                out_bytes += len(line.encode("utf-8"))
                if out_bytes >= target_mb * 1e6:
                    break
            repeat += 1
    return written, text_bytes
