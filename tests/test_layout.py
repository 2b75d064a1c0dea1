"""The package layout, read with `ast` (docs/design.md, "Layout rules"): no import circle between
modules or between packages (rooms), one package per stage, and no module reaching for another
module's private name. Module size is not a rule.

A room is a package directly under `sparrow_jax/` (`rollout`, `sparsity`, ...), a top-level
module (`train`, `cli`, ...) or `pallas_kernels`. `from pkg import submodule` counts as an import
of the submodule, not of the package's `__init__` (which only hands names on).
"""

from __future__ import annotations

import ast
import collections
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module name -> the project modules it imports (anywhere in the file, lazy imports too)."""
    files = {}
    for p in [*root.glob("sparrow_jax/**/*.py"), *root.glob("pallas_kernels/**/*.py")]:
        name = ".".join(p.relative_to(root).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    for name in files:
        graph.setdefault(name, set())
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "sparrow_jax" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_import_circle():
    assert cycles(module_graph()) == []


def test_no_room_import_circle():
    rooms: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in module_graph().items():
        rooms[room(a)].update(room(b) for b in targets if room(b) != room(a))
        rooms.setdefault(room(a), set())
    assert cycles(rooms) == [], "packages that import each other"


@pytest.mark.parametrize("engine_module", ["engine", "scheduler", "paged", "compress"])
def test_rollout_engines_do_not_import_each_other(engine_module):
    """Only rollout/api.py knows every engine; shared pieces live in rollout/state.py."""
    graph = module_graph()
    engines = {f"sparrow_jax.rollout.{m}" for m in ("engine", "scheduler", "compress")}
    mine = f"sparrow_jax.rollout.{engine_module}"
    allowed = {"sparrow_jax.rollout.paged"} if engine_module == "scheduler" else set()
    assert not (graph[mine] & (engines - {mine} - allowed)), graph[mine]
    assert "sparrow_jax.rollout.api" not in graph[mine]


def test_kernels_and_benches_point_down():
    graph = module_graph()
    for name, targets in graph.items():
        if name.startswith("pallas_kernels"):
            assert not any(t.startswith("sparrow_jax") for t in targets), (name, targets)
        if not name.startswith("sparrow_jax.bench"):
            assert not any(t.startswith("sparrow_jax.bench") for t in targets), (name, targets)


# -- a tree a newcomer can read: one package per stage, no loose modules ---------------------------

# The only modules allowed directly under sparrow_jax/: the package face and the `sparrow` command.
TOP_LEVEL_MODULES = {"__init__.py", "cli.py"}


def loose_modules(root: Path = REPO) -> list[str]:
    return sorted(p.name for p in (root / "sparrow_jax").glob("*.py") if p.name not in TOP_LEVEL_MODULES)


def test_no_loose_top_level_modules():
    assert not loose_modules(), (f"modules directly under sparrow_jax/ {loose_modules()}: put each "
                                 "in the package of its stage (train/, evaluation/, tools/, ...)")


# -- a module's private names are its own ---------------------------------------------------------
#
# A leading underscore says "only this module uses it". Code that needs such a name from another
# module makes it public where it belongs, or moves to where it is used. Read with `ast` over
# sparrow_jax/, pallas_kernels/ and tests/ (tests/*.py import each other by file name: conftest
# puts tests/ on the path). A reach is any of:
#   (a) `from m import _x` where m is a project module;
#   (b) `m._x` where m names a project module in this file (`import m`, `from p import m`, any
#       alias) - also `setattr(m, "_x", ...)`, `monkeypatch.setattr(m, "_x", ...)`, getattr;
#   (c) `obj._x` for any other object (`self` included: a base class in another module) where
#       `_x` is not defined in this file but is defined in another project module: a private
#       attribute of another module's class or object.
# Not a reach: dunders (`__name__`); aliases that bind a private local name to a public thing
# (`from pallas_kernels import tpu as _tpu`: nothing private is taken); privates of third-party
# modules (`gin.config._REGISTRY` is gin's business, not this rule's). (c) cannot tell two
# classes that both define `_x` apart: a file that defines `_x` itself may use any `obj._x`.

# Reaches into files that other issue-54 work is rewriting now (rl/ learner privates, dryrun's
# programs, the eval command); each entry goes when that work lands (the test says which are
# gone).
PENDING_REACHES = {
    ("sparrow_jax/dryrun/programs.py", "_join"),    # batching._join: compile_plan counts it by name
    ("sparrow_jax/dryrun/programs.py", "_num_mini"),
    ("sparrow_jax/dryrun/programs.py", "_micro_batching"),
    ("sparrow_jax/evaluation/command.py", "_model_dir"),
    ("sparrow_jax/evaluation/command.py", "_operative_config"),
    ("sparrow_jax/rl/distill.py", "_empty_metric_sums"),
    ("sparrow_jax/rl/distill.py", "_micro_batching"),
    ("tests/rollout_sharded_check.py", "_micro_batching"),
    ("tests/test_distill.py", "_grads"),
    ("tests/test_minibatch.py", "_grads"),
    ("tests/test_precision.py", "_loss_terms"),
    ("tests/test_eval_command.py", "_step_checksums"),
    ("tests/test_eval_command.py", "_load_data"),
    ("tests/test_eval_command.py", "_sampling"),
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Import name -> file: dotted for the packages, the bare file name for tests/*.py."""
    files = {}
    for p in [*root.glob("sparrow_jax/**/*.py"), *root.glob("pallas_kernels/**/*.py")]:
        files[".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = p
    files.update({p.stem: p for p in root.glob("tests/*.py")})
    return files


def own_private_names(tree: ast.AST) -> set[str]:
    """The private names a file defines or binds itself: functions, classes, assignments,
    attributes it sets (`self._x = ...`), arguments, keyword arguments, import aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return {n for n in names if is_private(n)}


def private_reaches(root: Path = REPO) -> list[tuple[str, int, str, str]]:
    """(file, line, private name, how) for every reach into another module's private name
    (rules above)."""
    files = project_modules(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    own = {name: own_private_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        path = str(files[name].relative_to(root))
        elsewhere = set().union(*(v for k, v in own.items() if k != name))
        modules, foreign = {}, set()     # local names of project modules / of other modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.split(".")[0]
                    target = a.name if a.asname else local
                    if target in files or target in ("sparrow_jax", "pallas_kernels"):
                        modules[local] = target
                    else:
                        foreign.add(local)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name if files[name].name == "__init__.py" else name.rpartition(".")[0]
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in files:
                        modules[a.asname or a.name] = f"{base}.{a.name}"
                    elif base not in files:
                        foreign.add(a.asname or a.name)
                    elif is_private(a.name):
                        found.append((path, node.lineno, a.name, f"from {base} import {a.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner in modules:
                    found.append((path, node.lineno, node.attr,
                                  f"{owner}.{node.attr} ({modules[owner]})"))
                elif (owner not in foreign and node.attr not in own[name]
                      and node.attr in elsewhere):
                    found.append((path, node.lineno, node.attr,
                                  f"{ast.unparse(node)} (defined elsewhere)"))
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and is_private(node.args[1].value)):
                found.append((path, node.lineno, node.args[1].value,
                              f"{ast.unparse(node.func)}({node.args[0].id}, "
                              f"{node.args[1].value!r})"))
    return sorted(set(found))


def test_no_private_name_reached_across_modules():
    found = private_reaches()
    pending = {(path, name) for path, _, name, _ in found} & PENDING_REACHES
    new = [f"{path}:{line}: {how}" for path, line, name, how in found
           if (path, name) not in pending]
    assert not new, ("private names taken from other modules (make the name public where it "
                     "belongs, or move the code to where it is used):\n" + "\n".join(new))
    assert pending == PENDING_REACHES, (
        f"fixed: remove {sorted(PENDING_REACHES - pending)} from PENDING_REACHES")


def test_layout_rules_fail_on_a_planted_violation(tmp_path):
    (tmp_path / "sparrow_jax" / "stage").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "sparrow_jax" / "cli.py").write_text("")
    (tmp_path / "sparrow_jax" / "loose.py").write_text("")
    assert loose_modules(tmp_path) == ["loose.py"]
    (tmp_path / "sparrow_jax" / "stage" / "__init__.py").write_text("")
    (tmp_path / "sparrow_jax" / "stage" / "a.py").write_text(textwrap.dedent("""\
        _LIMIT = 3
        _REGISTRY = {}
        def _helper():
            return 1
        class Base:
            def __init__(self):
                self._state = 1
            def _step(self):
                return self._state
        """))
    (tmp_path / "sparrow_jax" / "stage" / "b.py").write_text(textwrap.dedent("""\
        import gin.config as gin_config
        import sparrow_jax.stage.a as mod
        from sparrow_jax.stage import a as _a
        from sparrow_jax.stage.a import Base, _helper
        x = mod._LIMIT
        y = _a._helper() + mod.__name__.count("a") + len(gin_config._REGISTRY)
        setattr(mod, "_LIMIT", 4)
        def state(thing):
            return thing._state
        class Own(Base):
            def __init__(self):
                self._mine = self._step()
            def same(self, other):
                return other._mine
        """))
    (tmp_path / "tests" / "helpers.py").write_text("def _port():\n    return 1\n")
    (tmp_path / "tests" / "test_c.py").write_text("from helpers import _port\n")
    assert [(path, line) for path, line, _, _ in private_reaches(tmp_path)] == [
        ("sparrow_jax/stage/b.py", 4), ("sparrow_jax/stage/b.py", 5),
        ("sparrow_jax/stage/b.py", 6), ("sparrow_jax/stage/b.py", 7),
        ("sparrow_jax/stage/b.py", 9), ("sparrow_jax/stage/b.py", 12),
        ("tests/test_c.py", 1)]
