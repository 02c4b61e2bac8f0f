"""The floors of docs/architecture.md hold: every import in megatron_ds/ (function-level ones
included) points to the importer's floor or below, no modules import each other in a circle, and
no private name crosses a module boundary. The floor list is read from the document itself. No
two modules share a file name either, so that a name says where a module is.

The scripts (tools/, bench/, pretrain_*.py) stand on top: each imports the installed package and
nothing else of the repository (a bench/ script may import another bench/ module: bench/ is first on
its path when it runs), never touches sys.path, and the package imports none of them, so no import
circle can run through them; none runs through tests/ either. Each tools/ script calls the
``megatron_ds.cli`` module of its own name (tasks/main.py: ``cli.tasks``).

Below ``megatron_ds/families/`` nothing switches on a model family's name, and no missing family
stands for one of them (``family is None``, a ``family=None`` parameter, ``family or GPT``): the
floors get the family object and read its fields."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_ds"
SCRIPT_DIRS = ("tools", "bench", "tasks")
# Calls that load a file as a module (or put a folder on the import path) around ``import``.
FILE_LOADERS = {"spec_from_file_location", "SourceFileLoader", "run_path", "addsitedir"}


def read_floors(doc: Path) -> dict[str, int]:
    """{top-level package or module of megatron_ds: floor} from the document's floors block; a
    dotted name (``pipeline.executor``) puts one module of a package on a floor of its own."""
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
    """The floor of the longest dotted name listed for ``module`` (``pipeline.executor`` before
    ``pipeline``)."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        name = ".".join(parts[1:end])
        if name in floors:
            return floors[name]
    return None


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


def script_files(repo: Path) -> list[Path]:
    """The repository's scripts: every .py under tools/ and bench/, and the pretrain_*.py entry points."""
    return sorted([p for d in SCRIPT_DIRS for p in (repo / d).rglob("*.py")] + list(repo.glob("pretrain_*.py")))


def local_names(repo: Path) -> set[str]:
    """Top-level names under which an import would reach the repository's own files instead of the
    installed package: the script folders and tests/, the top-level scripts, and every script by its
    bare name (as with its folder on sys.path)."""
    return {*SCRIPT_DIRS, "tests"} | {p.stem for p in repo.glob("*.py")} | {p.stem for p in script_files(repo)}


def absolute_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every absolute import at any depth (``from a import b``: ``a``), and of
    every ``importlib.import_module("a")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, node.lineno))
        elif (isinstance(node, ast.Call) and _called(node) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return out


def _called(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


def script_problems(path: Path, repo: Path, local: set[str]) -> list[str]:
    """What makes a script more than a caller of the installed package: sys.path used, a file loaded
    as a module, a relative import, an import of another script, of tools/, bench/ or tests/ (but a
    bench/ script's import of a bench/ module by its bare name: bench/ is on its path when it runs)."""
    tree = ast.parse(path.read_text(), str(path))
    name = path.relative_to(repo)
    siblings = {p.stem for p in (repo / "bench").glob("*.py")} if name.parts[0] == "bench" else set()
    problems = [f"{name}:{module_line}: imports {module}, which is not the installed package"
                for module, module_line in absolute_imports(tree)
                if module.split(".")[0] in local and module not in siblings]
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        sys_path = ((isinstance(node, ast.Attribute) and node.attr == "path"
                     and getattr(node.value, "id", None) == "sys")
                    or (isinstance(node, ast.ImportFrom) and node.module == "sys"
                        and any(a.name == "path" for a in node.names)))
        if sys_path:
            problems.append(f"{where}: uses sys.path (the package is installed: import it)")
        if isinstance(node, ast.ImportFrom) and node.level:
            problems.append(f"{where}: a relative import (a script is no package)")
        if isinstance(node, ast.Call) and _called(node) in FILE_LOADERS:
            problems.append(f"{where}: loads a file as a module ({_called(node)})")
    return problems


def repository_graph(repo: Path, package: str) -> dict[str, set[str]]:
    """Module -> the repository's modules it imports, over the package, tests/ (``tests.*``) and the
    scripts (named by their path; an import of a script's bare name is an edge to it)."""
    files = {**module_files(repo / package), **module_files(repo / "tests")}
    known = set(files) | _extension_modules(repo / package)
    scripts = {str(p.relative_to(repo)): p for p in script_files(repo)}
    by_stem = {Path(name).stem: name for name in scripts}
    graph = {}
    for name, path in {**files, **scripts}.items():
        importer = name if name in files else "__main__"
        graph[name] = {target for top in (package, "tests")
                       for target, _, _ in imports_of(importer, path, known, top) if target != name}
        graph[name] |= {by_stem[m] for m, _ in absolute_imports(ast.parse(path.read_text())) if m in by_stem}
    return graph


def test_imports_follow_the_floors():
    floors = read_floors(REPO / "docs" / "architecture.md")
    problems = check(REPO / PACKAGE, floors)
    assert not problems, "\n".join(problems)


def test_every_package_sits_on_one_floor():
    """No module of a package on a floor of its own (a dotted name in the floors block): a package that
    straddles two floors is two packages."""
    dotted = [name for name in read_floors(REPO / "docs" / "architecture.md") if "." in name]
    assert not dotted, f"modules on a floor apart from their package: {dotted}"


def cli_module_of(script: Path, repo: Path) -> str:
    """The ``megatron_ds.cli`` module a script must call: tools/X.py (tools/checkpoint/X.py) -> ``X``,
    tasks/main.py -> ``tasks``."""
    return "tasks" if script.relative_to(repo).parts[0] == "tasks" else script.stem


def test_each_tool_calls_the_cli_module_of_its_name():
    """tools/X.py runs ``megatron_ds.cli.X.main`` (a name says where the body is), and every cli module
    but the shared helpers has its script."""
    scripts = sorted([*(REPO / "tools").rglob("*.py"), *(REPO / "tasks").glob("*.py")])
    wrong = []
    for script in scripts:
        imported = {module for module, _ in absolute_imports(ast.parse(script.read_text()))}
        expected = f"{PACKAGE}.cli.{cli_module_of(script, REPO)}"
        if expected not in imported:
            wrong.append(f"{script.relative_to(REPO)} does not call {expected} (imports {sorted(imported)})")
    called = {cli_module_of(s, REPO) for s in scripts}
    # modules the tools' bodies share (their flags, their steps), not command lines of their own
    helpers = {"evaluate_masked"}
    orphans = sorted(p.stem for p in (REPO / PACKAGE / "cli").glob("*.py")
                     if p.stem != "__init__" and p.stem not in called | helpers)
    assert not wrong and not orphans, "\n".join(wrong + [f"megatron_ds/cli/{o}.py has no tools/ script"
                                                         for o in orphans])


def test_no_two_modules_share_a_file_name():
    seen = defaultdict(list)
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        if path.name != "__init__.py":
            seen[path.name].append(str(path.relative_to(REPO / PACKAGE)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, "modules sharing a file name: " + "; ".join(" ".join(p) for p in shared.values())


def test_scripts_only_call_the_installed_package():
    local = local_names(REPO)
    problems = [p for path in script_files(REPO) for p in script_problems(path, REPO, local)]
    assert not problems, "\n".join(problems)


def test_no_import_circle_in_the_repository():
    """The package, tests/ and the scripts together. The scripts import only the package; the
    package imports no script by its bare name either, so no circle runs through them."""
    local = local_names(REPO)
    problems = [f"{path.relative_to(REPO)}:{line}: imports {module}, a script or a folder of scripts"
                for path in module_files(REPO / PACKAGE).values()
                for module, line in absolute_imports(ast.parse(path.read_text())) if module.split(".")[0] in local]
    cycle = find_cycle(repository_graph(REPO, PACKAGE))
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
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
    # a module listed on a higher floor than its package: its package's other modules stay below it
    ({"low/__init__.py": "", "low/up.py": "", "low/m.py": "from pkg.low.up import q\n"},
     "pkg.low.m (floor 0) imports pkg.low.up (floor 1)"),
])
def test_the_check_finds_what_it_forbids(tmp_path, files, expected):
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    problems = check(root, {"a": 0, "b": 0, "low": 0, "high": 1, "low.up": 1})
    assert any(expected in p for p in problems), problems


def test_a_module_on_a_higher_floor_may_import_from_it(tmp_path):
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "low/__init__.py": "", "low/up.py": "from pkg.high import z\n",
                       "high/__init__.py": "z = 1\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert check(root, {"low": 0, "high": 1, "low.up": 1}) == []


@pytest.mark.parametrize("script,expected", [
    ("import sys\nsys.path.insert(0, 'tools')\n", "uses sys.path"),
    ("from sys import path\n", "uses sys.path"),
    ("def main():\n    from other import main\n", "imports other, which is not the installed package"),
    ("from tools.other import main\n", "imports tools.other"),
    ("import importlib\nimportlib.import_module('tests.e2e_data')\n", "imports tests.e2e_data"),
    ("import runpy\nrunpy.run_path('bench/other.py')\n", "loads a file as a module (run_path)"),
    ("from . import other\n", "a relative import"),
    ("import sys\n\nfrom pkg.cli.tool import main\n\nsys.exit(main())\n", None),
])
def test_the_script_check_finds_what_it_forbids(tmp_path, script, expected):
    for name, text in {"tools/tool.py": script, "bench/other.py": "", "tools/other.py": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    problems = script_problems(tmp_path / "tools" / "tool.py", tmp_path, local_names(tmp_path))
    assert any(expected in p for p in problems) if expected else not problems, problems


def test_the_repository_graph_sees_circles_through_tests_and_scripts(tmp_path):
    files = {"pkg/__init__.py": "", "tests/__init__.py": "", "tests/a.py": "from tests.b import x\n",
             "tests/b.py": "import tests.a\n", "tools/one.py": "import two\n", "tools/two.py": "import one\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = repository_graph(tmp_path, "pkg")
    assert graph["tests.a"] == {"tests.b"} and graph["tests.b"] == {"tests.a"}
    assert graph["tools/one.py"] == {"tools/two.py"} and graph["tools/two.py"] == {"tools/one.py"}
    assert find_cycle(graph)


# --- no switch on a model family's name below megatron_ds/families/ ---------------------------------------

FAMILY_NAMES = {"gpt", "bert", "t5", "moe"}
# identifiers (and string keys like "model_family") that name a family: a command line's --model and a
# Hugging Face config's model_type name one too
FAMILY_WORDS = ("family", "kind", "model")


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
    _check_below_families(family_switches, tmp_path, text, found, allowed='if family.name == "bert":\n    pass\n')


def _check_below_families(check, tmp_path: Path, text: str, found: bool, *, allowed: str) -> None:
    """``check`` of a scratch package with ``text`` in a module below its families/ (found or not, as
    ``found`` says) and ``allowed`` inside families/ (never found)."""
    root = tmp_path / "pkg"
    (root / "families").mkdir(parents=True)
    (root / "low.py").write_text(text)
    (root / "families" / "allowed.py").write_text(allowed)
    problems = check(root)
    assert bool(problems) == found, problems
    assert not any("allowed.py" in p for p in problems)


# --- no missing family standing for one below megatron_ds/families/ ---------------------------------------

def _family_ref(node: ast.AST) -> bool:
    """A name or attribute that is a model family itself: ``family``, ``layout.family``, ``self.family``
    (not a field of one: ``family.pipeline_choice`` may well be None)."""
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return word is not None and word.lower().endswith("family")


def _none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _optional_annotation(node: ast.AST | None) -> bool:
    """``X | None`` or ``Optional[X]``."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return "None" in node.value or "Optional" in node.value
    return any(_none(n) or (isinstance(n, ast.Name) and n.id == "Optional") for n in ast.walk(node))


def _optional_family_parameters(node: ast.AST) -> bool:
    """A function whose ``family`` parameter may be None (annotated so, or defaulting to it)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return False
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
    return any(arg.arg.lower().endswith("family") and ((default is not None and _none(default))
                                                        or _optional_annotation(arg.annotation))
               for arg, default in pairs)


def _missing_family(node: ast.AST) -> bool:
    """``family is None`` / ``is not None`` / ``== None``, ``family or X``, ``x if family else y``,
    ``if (not) family:``, a parameter ``family=None`` or ``family: ModelFamily | None``, a dataclass
    field ``family: ModelFamily | None``."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(_none(a) for a in sides) and any(_family_ref(a) for a in sides)
    if isinstance(node, ast.BoolOp):
        return isinstance(node.op, ast.Or) and _family_ref(node.values[0])
    if isinstance(node, (ast.IfExp, ast.If, ast.While)):
        test = node.test.operand if isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) \
            else node.test
        return _family_ref(test)
    if isinstance(node, ast.AnnAssign):
        return _family_ref(node.target) and _optional_annotation(node.annotation)
    return _optional_family_parameters(node)


def missing_family_uses(root: Path, exempt: str = "families") -> list[str]:
    """Every place in the package at ``root``, outside its ``exempt`` sub-package, where a missing model
    family (None) could stand for one of them."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _missing_family(node):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: a missing model family stands "
                                f"for one (pass the family object)")
    return problems


def test_no_floor_below_the_families_lets_a_missing_family_stand_for_one():
    """"``family is None`` means the GPT" is how a default family creeps back: below
    ``megatron_ds/families/`` a family is always given, as the object, and read by its fields."""
    problems = missing_family_uses(REPO / PACKAGE)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text,found", [
    ("x = 1 if family is None else 2\n", True),
    ("if layout.family is not None:\n    pass\n", True),
    ("x = family or GPT\n", True),
    ("x = (family.check if family else check_gpt)\n", True),
    ("if not self.family:\n    pass\n", True),
    ("def f(a, family=None):\n    pass\n", True),
    ("def f(a, *, family: ModelFamily | None = GPT):\n    pass\n", True),
    ("class C:\n    family: 'ModelFamily | None' = None\n", True),
    ("x = family.pipeline_choice or even\n", False),  # a field of the family may be missing
    ("x = family.decoder_seq_length is None\n", False),
    ("def f(a, *, family: ModelFamily):\n    pass\n", False),
])
def test_the_missing_family_check_finds_what_it_forbids(tmp_path, text, found):
    _check_below_families(missing_family_uses, tmp_path, text, found,
                          allowed="def main(argv=None, family=None):\n    pass\n")


# --- tests/ mirrors the package -------------------------------------------------------------------------

CROSS_CUTTING_TEST_DIRS = {"gpu"}  # tests/gpu: what only a GPU shows, across the package (marked `gpu`)


def test_the_tests_mirror_the_package():
    """tests/a/b/ is about megatron_ds/a/b/ (a package) or megatron_ds/a/b.py (a module), and every
    package of megatron_ds has its tests/ folder: a test is found where its code is."""
    tests, package = REPO / "tests", REPO / PACKAGE
    test_dirs = {p.relative_to(tests) for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"
                 and p.relative_to(tests).parts[0] not in CROSS_CUTTING_TEST_DIRS}
    stray = sorted(str(d) for d in test_dirs
                   if not (package / d).is_dir() and not (package / d).with_suffix(".py").is_file())
    packages = {p.parent.relative_to(package) for p in package.rglob("__init__.py") if p.parent != package}
    untested = sorted(str(d) for d in packages if d not in test_dirs)
    assert not stray and not untested, f"tests/ folders of no package: {stray}; packages without tests/: {untested}"
