"""The floors of docs/architecture.md hold: every import in megatron_ds/ (function-level ones
included) points to the importer's floor or below, no modules import each other in a circle, and
no private name crosses a module boundary. The floor list is read from the document itself."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_ds"


def read_floors(doc: Path) -> dict[str, int]:
    """{top-level package or module of megatron_ds: floor} from the document's floors block."""
    text = doc.read_text()
    block = re.search(r"```\nfloors[^\n]*\n(.*?)```", text, re.S)
    assert block, f"{doc} has no ```floors ...``` block"
    floors, current = {}, None
    for line in block.group(1).splitlines():
        names = line.split("|")[0].split()
        if names and names[0].isdigit():
            current, names = int(names[0]), names[1:]
        for name in names:
            assert name not in floors, f"{name} is on two floors of {doc}"
            floors[name] = current
    return floors


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _extension_modules(root: Path) -> set[str]:
    """Compiled modules (``data/_helpers*.so``) are modules too."""
    return {".".join(p.relative_to(root.parent).parts[:-1] + (p.name.split(".")[0],)) for p in root.rglob("*.so")}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name: str, path: Path, known: set[str], package: str) -> list[tuple[str, int, str | None]]:
    """(imported module, line, imported name) for every import in the file, at any depth. ``from a
    import b`` is module ``a.b`` when that is a module, else ``a``'s name ``b``. Importing ``a.b.c``
    also runs the ``__init__`` of ``a`` and ``a.b``: those count too, unless the importer is inside
    them (then they are already being initialised)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in known else (base, a.name)
                       for a in node.names]
        else:
            continue
        for target, imported in targets:
            if target != package and not target.startswith(package + "."):
                continue
            found.append((target, node.lineno, imported))
            mine = set(_ancestors(name)) | {name}
            found += [(a, node.lineno, None) for a in _ancestors(target) if a not in mine and a != package]
    return found


def floor_of(module: str, floors: dict[str, int], package: str) -> int | None:
    parts = module.split(".")
    return floors.get(parts[1]) if len(parts) > 1 else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a list of modules, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def check(root: Path, floors: dict[str, int]) -> list[str]:
    """Every violation in the package at ``root``, one line each."""
    package = root.name
    files = module_files(root)
    known = set(files) | _extension_modules(root)
    problems, graph = [], {}
    tops = {m.split(".")[1] for m in files if "." in m}
    problems += [f"{package}.{t} is on no floor of docs/architecture.md" for t in sorted(tops - set(floors))]
    for name, path in files.items():
        graph[name] = set()
        for target, line, imported in imports_of(name, path, known, package):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target != name:
                graph[name].add(target)
            low, high = floor_of(name, floors, package), floor_of(target, floors, package)
            if low is not None and high is not None and high > low:
                problems.append(f"{where}: {name} (floor {low}) imports {target} (floor {high})")
            if imported and imported.startswith("_") and not imported.startswith("__"):
                problems.append(f"{where}: {name} imports the private name {imported} from {target}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    return problems


def test_imports_follow_the_floors():
    floors = read_floors(REPO / "docs" / "architecture.md")
    problems = check(REPO / PACKAGE, floors)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("files,expected", [
    # a circle between two modules of one floor, one of the imports inside a function
    ({"a.py": "from pkg.b import x\n", "b.py": "def f():\n    from pkg.a import y\n"},
     "import circle: pkg.a -> pkg.b -> pkg.a"),
    # a lower floor reaching up (relative import), and a private name across modules
    ({"low/__init__.py": "", "low/m.py": "from ..high import z\n", "high/__init__.py": "from pkg.low.m import _q\n"},
     "pkg.low.m (floor 0) imports pkg.high (floor 1)"),
    ({"low/__init__.py": "", "low/m.py": "", "high/__init__.py": "from pkg.low.m import _q\n"},
     "imports the private name _q from pkg.low.m"),
    # a submodule importing its own package's __init__, which imports the submodule: a circle
    ({"low/__init__.py": "from pkg.low.m import q\n", "low/m.py": "from pkg.low import r\n"},
     "import circle: pkg.low -> pkg.low.m -> pkg.low"),
])
def test_the_check_finds_what_it_forbids(tmp_path, files, expected):
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    problems = check(root, {"a": 0, "b": 0, "low": 0, "high": 1})
    assert any(expected in p for p in problems), problems


# --- no switch on a model family's name below megatron_ds/families/ ---------------------------------------

FAMILY_NAMES = {"gpt", "bert", "t5", "moe"}
FAMILY_WORDS = ("family", "kind")  # identifiers (and string keys like "model_family") that name a family


def _literals(node: ast.AST) -> set[str]:
    """The string literals a comparison side is made of: ``"bert"``, or each of ``("bert", "t5")``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def _about_family(node: ast.AST) -> bool:
    """Whether an expression reads a family: a name or attribute containing "family" or "kind", any
    ``.name`` attribute, or a string key containing "family" (``sig.get("model_family", ...)``)."""
    for sub in ast.walk(node):
        word = (sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute)
                else sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else None)
        if word is None:
            continue
        if isinstance(sub, ast.Attribute) and word == "name":
            return True
        if any(w in word.lower() for w in FAMILY_WORDS):
            return True
    return False


def family_switches(root: Path, exempt: str = "families") -> list[str]:
    """Every comparison (``==``, ``!=``, ``in``, ``is``, a ``match`` case) of a literal family name
    against an expression about a family, in the package at ``root`` outside its ``exempt`` sub-package."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                hit = any(_literals(a) & FAMILY_NAMES and any(_about_family(b) for b in sides if b is not a)
                          for a in sides)
            elif isinstance(node, ast.Match):
                values = {c.pattern.value.value for c in node.cases if isinstance(c.pattern, ast.MatchValue)
                          and isinstance(c.pattern.value, ast.Constant)}
                hit = bool(values & FAMILY_NAMES) and _about_family(node.subject)
            else:
                continue
            if hit:
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: switches on a model family's name")
    return problems


def test_no_floor_below_the_families_switches_on_a_family_name():
    """A floor below ``megatron_ds/families/`` gets what differs between model families from the
    ``ModelFamily`` object (its fields and hooks), never by comparing its name: a comparison or
    ``match`` of a literal "gpt" / "bert" / "t5" / "moe" against an expression that reads a family --
    a name or attribute containing "family" or "kind", any ``.name`` attribute, a "model_family"
    key -- fails here. A string that only shares a value (``masking_style == "t5"``, a masking style
    read from no family) is not a family switch. Only ``families/`` may look families up by name."""
    problems = family_switches(REPO / PACKAGE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text,found", [
    ('if family.name == "bert":\n    pass\n', True),
    ('x = sig.get("model_family", "gpt") != "gpt"\n', True),
    ('x = ckpt.family in ("t5", "bert")\n', True),
    ('match kind:\n    case "t5":\n        pass\n', True),
    ('x = masking_style == "t5"\n', False),
    ('x = family.label == "BERT"\n', False),  # not a family name: labels are for messages
    ('x = family.decoder_seq_length is None\n', False),
])
def test_the_family_check_finds_what_it_forbids(tmp_path, text, found):
    root = tmp_path / "pkg"
    (root / "families").mkdir(parents=True)
    (root / "low.py").write_text(text)
    (root / "families" / "allowed.py").write_text('if family.name == "bert":\n    pass\n')
    problems = family_switches(root)
    assert bool(problems) == found, problems
    assert not any("allowed.py" in p for p in problems)
