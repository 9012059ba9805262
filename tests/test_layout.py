"""The package's shape: stages import only stages before them, nothing imports in a circle, and the
front end and the compiler never import torch.distributed.

The import graph is read from the source with `ast`, every import counted wherever it stands: at the
top of a module, inside a function (it runs when the function does) and under `if TYPE_CHECKING:`
(a type names what a module depends on as much as a call does). An edge goes to the module named:
`from .frontend import ir` is an edge to shardlang.frontend.ir, `from .api import load` one to
shardlang.api. The parent packages Python initialises on the way (shardlang/__init__.py for any
shardlang.x) are not counted: every module would depend on the package root otherwise.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGE = ROOT / "shardlang"

#: The stages in the order data flows; a module may import its own stage and those before it.
#: `_version` is a leaf anything may import; the package root and `__main__` come last.
STAGES = (
    "_version",
    "frontend",
    "compiler",
    "runtime",
    "emit",
    "checkpoints",
    "verification",
    "launch",
    "explain",
    "search",
    "api",
    "cli",
    "",  # shardlang/__init__.py: the library surface
    "__main__",
)

#: Stages that parse, resolve and lint: they run without a process group, so never import torch.distributed.
NO_DISTRIBUTED = ("frontend", "compiler")
#: The front end does not import torch at all (the compiler reads module trees, so it may use torch.nn).
NO_TORCH = ("frontend",)


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test here (each walks every module)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The module a `from X import ...` names, relative imports resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports (its own package's modules, and outside ones by their full name)."""
    package = _package(name, path)
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {name: {t for t in targets if t in graph} for name, targets in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or of one importing itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _show(cycle: list[str], graph: dict[str, set[str]]) -> str:
    """One path around a cycle, `a -> b -> ... -> a`."""
    members = set(cycle)
    path, seen = [cycle[0]], {cycle[0]}
    while True:
        nxt = next((t for t in sorted(graph[path[-1]]) if t in members), None)
        if nxt is None or nxt in seen:
            return " -> ".join(path + ([nxt] if nxt else []))
        path.append(nxt)
        seen.add(nxt)


#: verification/ is being rewritten on another branch, which also ends the cycle between its
#: __init__ (which imports every check module) and the check modules (which import Outcome from it).
VERIFICATION = "shardlang.verification"


def test_no_import_cycles():
    graph = _internal(_graph())
    cycles = [c for c in _cycles(graph) if not all(m.startswith(VERIFICATION) for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(_show(c, graph) for c in cycles)


def test_no_import_cycles_in_verification():
    graph = _internal(_graph())
    cycles = [c for c in _cycles(graph) if all(m.startswith(VERIFICATION) for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(_show(c, graph) for c in cycles)


def test_every_module_is_in_a_stage():
    assert {_stage(m) for m in _graph()} <= set(STAGES)


def test_no_stage_imports_a_later_one():
    graph = _internal(_graph())
    order = {stage: i for i, stage in enumerate(STAGES)}
    wrong = [
        f"{a} ({_stage(a) or 'shardlang'}) imports {b} ({_stage(b) or 'shardlang'})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if order[_stage(b)] > order[_stage(a)]
    ]
    assert not wrong, "imports of later stages:\n" + "\n".join(wrong)


@pytest.mark.parametrize("stage", sorted(set(NO_DISTRIBUTED) | set(NO_TORCH)))
def test_front_end_and_compiler_need_no_process_group(stage):
    forbidden = ("torch",) if stage in NO_TORCH else ("torch.distributed",)
    wrong = [
        f"{module} imports {target}"
        for module, targets in sorted(_graph().items())
        if _stage(module) == stage
        for target in sorted(targets)
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_package_and_module_says_its_job():
    """Each file opens with a docstring whose first line is one sentence."""
    missing = [name for name, path in _modules().items() if not ast.get_docstring(_tree(path))]
    assert not missing, missing


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.distributed
def test_importing_the_library_imports_no_torch():
    done = _run("import sys, shardlang; plan = shardlang.load('plans/llama_2d.sl'); assert 'torch' not in sys.modules")
    assert done.returncode == 0, done.stderr


@pytest.mark.distributed
def test_lint_does_not_import_apply_or_the_checks():
    """Without its simulated step (which applies the plan, so imports the runtime in its forked child's
    parent), lint stays in the front end and the compiler."""
    done = _run(
        "import sys\n"
        "from shardlang.cli import main\n"
        "assert main(['lint', 'plans/llama_2d.sl', 'examples/llama.py', '--world', '8', '--no-step']) == 0\n"
        "later = ('shardlang.runtime.apply', 'shardlang.runtime.steps', 'shardlang.verification', 'shardlang.launch')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(later))\n"
        "assert not loaded, loaded\n"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.distributed
def test_lint_without_a_model_does_not_import_torch():
    """`shardlang lint PLAN` is a front-end job: importing torch (1.5 s) would make it take three times its
    target of 1 s."""
    done = _run(
        "import sys\n"
        "from shardlang.cli import main\n"
        "assert main(['lint', 'plans/llama_2d.sl', '--world', '8']) == 0\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    assert done.returncode == 0, done.stderr


#: The most lines a module of shardlang/ may hold: past it, a module does more than one job.
LONGEST = 600


def test_no_module_is_longer_than_600_lines():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    assert not {name: n for name, n in lengths.items() if n > LONGEST}


def _private_uses(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Another shardlang module's private (`_x`) names that `name` imports or reads as `module._x`."""
    package = _package(name, path)
    found, aliases = [], {}
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            if not target.startswith("shardlang"):
                continue
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{target}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    used = {name: _private_uses(name, path, modules) for name, path in modules.items()}
    assert not {name: names for name, names in used.items() if names}


def test_every_import_of_the_package_names_a_module_that_exists():
    """Imports inside functions run only when the function does: a module moved or split leaves them
    naming one that is gone, and nothing fails until a user runs that command."""
    modules = _modules()
    missing = []
    for name, path in modules.items():
        package = _package(name, path)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("shardlang")):
                target = _from_target(node, package)
                if target not in modules:
                    missing.append(f"{name}:{node.lineno} imports {target}")
            elif isinstance(node, ast.Import):
                missing += [
                    f"{name}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("shardlang") and a.name not in modules
                ]
    assert not missing
