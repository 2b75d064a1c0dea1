"""The package layout, read with `ast` (docs/design.md, "Layout rules"): no import circle between
modules or between packages (rooms), a room graph at most MAX_FLOORS floors tall, one package
per stage, and no module reaching for another module's private name. Module size is not a rule.

A room is a package directly under `sparrow_jax/` (`rollout`, `sparsity`, ...), a top-level
module (`cli`) or `pallas_kernels`. `from pkg import submodule` counts as an import of the
submodule, not of the package's `__init__` (which only hands names on). Imports by module name
count too: `importlib.import_module("sparrow_jax.x.y")` / `__import__(...)` with a literal or an
f-string built from literals, `__name__` and module-level tables (a package `__init__` that maps
names to its submodules lazily); and a module that imports a name it computes (a command table,
a list of modules to load) is taken to import every project module it names in a string.
"""

from __future__ import annotations

import ast
import collections
import itertools
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Floors of the room graph (bottom up): 1 runtime, pallas_kernels; 2 model, sparsity, rewards;
# 3 rollout, data; 4 rl, evaluation; 5 train; 6 experiment, dryrun, bench, tools; 7 cli.
MAX_FLOORS = 7
_IMPORT_BY_NAME = ("import_module", "__import__")


def _module_tables(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level names bound to a string or a literal table of them -> those strings (a
    dict's values, a tuple's or list's items)."""
    tables: dict[str, set[str]] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        value = node.value
        items = (value.values if isinstance(value, ast.Dict) else value.elts
                 if isinstance(value, (ast.Tuple, ast.List)) else [value])
        strings = {i.value for i in items
                   if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        if strings:
            tables[node.targets[0].id] = strings
    return tables


def _strings(node: ast.AST, module: str, tables: dict[str, set[str]]) -> set[str]:
    """Every string `node` can evaluate to when it is built from literals, `__name__` and
    module-level tables (`_NAMES[name]`: any of its values); empty when it is anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Name):
        return {module} if node.id == "__name__" else tables.get(node.id, set())
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return tables.get(node.value.id, set())
    if isinstance(node, ast.JoinedStr):
        parts = [_strings(p.value if isinstance(p, ast.FormattedValue) else p, module, tables)
                 for p in node.values]
        return {"".join(c) for c in itertools.product(*parts)} if all(parts) else set()
    return set()


def _imports_by_name(tree: ast.Module, module: str, files: dict[str, Path]) -> set[str]:
    """The project modules `tree` imports by name (see the module docstring)."""
    tables = _module_tables(tree)
    found, computed = set(), False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in _IMPORT_BY_NAME:
            continue
        names = _strings(node.args[0], module, tables)
        found |= names
        computed |= not names
    if computed:    # the name is computed: every module named in a string may be it
        found |= {n.value.split(":")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {f for f in found if f in files and f != module}


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module name -> the project modules it imports (anywhere in the file, lazy imports and
    imports by name too)."""
    files = {}
    for p in [*root.glob("sparrow_jax/**/*.py"), *root.glob("pallas_kernels/**/*.py")]:
        name = ".".join(p.relative_to(root).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        graph[name].update(_imports_by_name(tree, name, files))
        for node in ast.walk(tree):
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


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in graph.items():
        rooms[room(a)].update(room(b) for b in targets if room(b) != room(a))
        rooms.setdefault(room(a), set())
    return dict(rooms)


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """room -> its floor in a circle-free room graph: 1 for a room that imports no other, else
    one above the highest room it imports (the longest import chain down from it, in rooms)."""
    floor: dict[str, int] = {}

    def visit(r: str) -> int:
        if r not in floor:
            floor[r] = 0        # on the path: a circle would read as floor 0, never loop
            floor[r] = 1 + max((visit(t) for t in rooms.get(r, ())), default=0)
        return floor[r]

    for r in sorted(rooms):
        visit(r)
    return floor


def longest_chain(rooms: dict[str, set[str]]) -> list[str]:
    """The rooms of a longest import chain, top first."""
    floor = floors(rooms)
    chain = [max(sorted(floor), key=floor.get)]
    while floor[chain[-1]] > 1:
        chain.append(max(sorted(rooms[chain[-1]]), key=floor.get))
    return chain


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_import_circle():
    assert cycles(module_graph()) == []


def test_no_room_import_circle():
    assert cycles(room_graph(module_graph())) == [], "packages that import each other"


def test_floor_counter_on_a_planted_graph():
    rooms = {"cli": {"tools", "runtime"}, "tools": {"train"}, "train": {"rewards", "runtime"},
             "rewards": {"runtime"}, "runtime": set(), "kernels": set()}
    assert floors(rooms) == {"cli": 5, "tools": 4, "train": 3, "rewards": 2, "runtime": 1,
                             "kernels": 1}
    assert longest_chain(rooms) == ["cli", "tools", "train", "rewards", "runtime"]
    rooms["runtime"] = {"kernels"}      # one more floor under everything
    assert max(floors(rooms).values()) == 6


def test_rooms_stand_on_at_most_max_floors():
    """Dependencies point downward through few floors: a room on floor n imports only rooms on
    floors below n, and the tallest chain (cli -> ... -> runtime) has MAX_FLOORS rooms."""
    rooms = room_graph(module_graph())
    chain = longest_chain(rooms)
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors: {' -> '.join(chain)}"


def test_imports_by_name_are_seen(tmp_path):
    """A registry that loads its users by module name is a circle the import statements hide:
    the graph sees literal names, f-strings over `__name__` and a lazy `__init__` table, and
    every module named in a module that computes the name it imports."""
    files = {
        "sparrow_jax/__init__.py": "",
        "sparrow_jax/low/__init__.py": "",
        "sparrow_jax/low/registry.py": (
            "import importlib\n"
            "def load():\n    importlib.import_module('sparrow_jax.high.user')\n"),
        "sparrow_jax/high/__init__.py": (
            "import importlib\n_NAMES = {'User': 'user'}\n"
            "def __getattr__(name):\n"
            "    return getattr(importlib.import_module(f'{__name__}.{_NAMES[name]}'), name)\n"),
        "sparrow_jax/high/user.py": "from sparrow_jax.low import registry\n",
        "sparrow_jax/table.py": (
            "from importlib import import_module\n"
            "COMMANDS = {'x': ('sparrow_jax.high.user', 'f')}\n"
            "def run(name):\n    return import_module(COMMANDS[name][0])\n"),
        "sparrow_jax/dunder.py": "__import__('sparrow_jax.low.registry')\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    graph = module_graph(tmp_path)
    assert graph["sparrow_jax.low.registry"] == {"sparrow_jax.high.user"}
    assert graph["sparrow_jax.high"] == {"sparrow_jax.high.user"}
    assert graph["sparrow_jax.table"] == {"sparrow_jax.high.user"}
    assert graph["sparrow_jax.dunder"] == {"sparrow_jax.low.registry"}
    assert cycles(graph) == [["sparrow_jax.high.user", "sparrow_jax.low.registry"]]
    assert cycles(room_graph(graph)) == [["sparrow_jax.high", "sparrow_jax.low"]]


@pytest.mark.parametrize("engine_module", ["static", "continuous", "paged", "compress"])
def test_rollout_engines_do_not_import_each_other(engine_module):
    """Only rollout/api.py knows every engine; shared pieces live in rollout/state.py."""
    graph = module_graph()
    engines = {f"sparrow_jax.rollout.{m}" for m in ("static", "continuous", "compress")}
    mine = f"sparrow_jax.rollout.{engine_module}"
    allowed = {"sparrow_jax.rollout.paged"} if engine_module == "continuous" else set()
    assert not (graph[mine] & (engines - {mine} - allowed)), graph[mine]
    assert "sparrow_jax.rollout.api" not in graph[mine]


# The stages one RL step calls, bottom up; `runtime` (what every run stands on) is not a stage.
RL_STEP_MODULE = "sparrow_jax.train.step"
MAX_RL_STEP_PACKAGES = 5


def step_packages(graph: dict[str, set[str]], module: str = RL_STEP_MODULE) -> set[str]:
    """The packages an RL step's module crosses: its own and those it imports (not runtime)."""
    return {room(t) for t in graph[module] | {module}} - {"sparrow_jax.runtime"}


def test_the_rl_step_crosses_few_packages_and_no_evaluation():
    """train/step.py reads prompts, rolls out, scores, learns and controls the schedule through
    the stage packages only: never through evaluation/, at most 5 packages with its own."""
    crossed = step_packages(module_graph())
    assert "sparrow_jax.evaluation" not in crossed, crossed
    assert len(crossed) <= MAX_RL_STEP_PACKAGES, sorted(crossed)
    planted = {"sparrow_jax.train.step": {"sparrow_jax.evaluation.heldout",
                                          "sparrow_jax.runtime.faults"}}
    assert step_packages(planted) == {"sparrow_jax.train", "sparrow_jax.evaluation"}


def test_kernels_and_benches_point_down():
    graph = module_graph()
    for name, targets in graph.items():
        if name.startswith("pallas_kernels"):
            assert not any(t.startswith("sparrow_jax") for t in targets), (name, targets)
        # Only the command line (`sparrow bench ...`) dispatches to the benches.
        if not name.startswith("sparrow_jax.bench") and name != "sparrow_jax.cli":
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
# (`from pallas_kernels import pallas_tpu as _tpu`: nothing private is taken); privates of third-party
# modules (`gin.config._REGISTRY` is gin's business, not this rule's). (c) cannot tell two
# classes that both define `_x` apart: a file that defines `_x` itself may use any `obj._x`.

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
    found = [f"{path}:{line}: {how}" for path, line, _, how in private_reaches()]
    assert not found, ("private names taken from other modules (make the name public where it "
                       "belongs, or move the code to where it is used):\n" + "\n".join(found))


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
