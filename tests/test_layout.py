"""The package layout: no import circle between modules or between packages (rooms), read with `ast`.

A room is a package directly under `sparrow_jax/` (`rollout`, `sparsity`, ...), a top-level
module (`train`, `cli`, ...) or `pallas_kernels`. `from pkg import submodule` counts as an import
of the submodule, not of the package's `__init__` (which only hands names on).
"""

from __future__ import annotations

import ast
import collections
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


# -- a tree a newcomer can read: one package per stage, modules of readable size ----------------

# The only modules allowed directly under sparrow_jax/: the package face and the `sparrow` command.
TOP_LEVEL_MODULES = {"__init__.py", "cli.py"}
MAX_MODULE_LINES = 450


def loose_modules(root: Path = REPO) -> list[str]:
    return sorted(p.name for p in (root / "sparrow_jax").glob("*.py") if p.name not in TOP_LEVEL_MODULES)


def oversized_modules(root: Path = REPO) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines())
             for p in [*root.glob("sparrow_jax/**/*.py"), *root.glob("pallas_kernels/**/*.py")]}
    return {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_loose_top_level_modules():
    assert not loose_modules(), (f"modules directly under sparrow_jax/ {loose_modules()}: put each "
                                 "in the package of its stage (train/, evaluation/, tools/, ...)")


def test_no_module_over_the_size_limit():
    assert not oversized_modules(), (f"modules over {MAX_MODULE_LINES} lines (split them by "
                                     f"responsibility): {oversized_modules()}")


def test_layout_rules_fail_on_a_planted_violation(tmp_path):
    (tmp_path / "sparrow_jax" / "stage").mkdir(parents=True)
    (tmp_path / "sparrow_jax" / "cli.py").write_text("")
    (tmp_path / "sparrow_jax" / "loose.py").write_text("")
    (tmp_path / "sparrow_jax" / "stage" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert loose_modules(tmp_path) == ["loose.py"]
    assert oversized_modules(tmp_path) == {"sparrow_jax/stage/long.py": MAX_MODULE_LINES + 1}
