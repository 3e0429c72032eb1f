"""Packages import only downward. From the bottom: `layers`, then `models` (uses `layers`),
`model_executor` (uses both), the `scheduler` loop (uses the executor), then the in-process
`engine` and the `server` on top. `tokenizer` (the output path) imports neither the model
code nor the loop. The request types at the package root (what the frontend process loads)
import no model code, nor torch. Imports under `if TYPE_CHECKING:` name types only and are
allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "rsgl"

# package -> the packages (or `engine`, a module) it must not import at run time.
FORBIDDEN = {
    "distributed": {"layers", "models", "model_executor", "scheduler", "server", "engine"},
    "layers": {"models", "model_executor"},
    "models": {"model_executor"},
    "model_executor": {"scheduler", "server", "engine"},
    "scheduler": {"server", "engine"},
    "tokenizer": {"layers", "models", "model_executor", "scheduler"},
    "server": {"engine"},
    # Constrained decoding: driven by the loop, read by the sampler; imports neither.
    "grammar": {"layers", "models", "model_executor", "scheduler", "server", "engine", "stack"},
    "stack": {"server", "engine"},
    # Speculative acceptance: called by the model runner, reads the sampler's state.
    "speculative": {"models", "model_executor", "scheduler", "server", "engine", "stack"},
    # Tool calling: read by the frontend process.
    "tool_calls": {"layers", "models", "model_executor", "scheduler", "server", "engine", "stack"},
}
TORCH_FREE = ["sampling_params", "args", "errors", "validation", "outputs", "cache_dir"]


def runtime_imports(path: Path) -> set[str]:
    """Modules `path` imports outside `if TYPE_CHECKING:` blocks (function bodies included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "rsgl":
            found.update(f"rsgl.{a.name}" for a in node.names)  # `from rsgl import engine`
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "rsgl" else None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downward(package: str):
    bad = []
    module = PACKAGE / f"{package}.py"
    paths = [module] if module.exists() else sorted((PACKAGE / package).rglob("*.py"))
    for path in paths:
        for module in runtime_imports(path):
            if subpackage(module) in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not bad, bad


@pytest.mark.parametrize("name", TORCH_FREE)
def test_request_types_import_no_model_code_and_no_torch(name: str):
    imports = runtime_imports(PACKAGE / f"{name}.py")
    heavy = {m for m in imports if m.split(".")[0] == "torch"}
    heavy |= {m for m in imports if subpackage(m) in {"layers", "models", "model_executor"}}
    assert not heavy, heavy


def test_the_checker_sees_a_violation(tmp_path: Path):
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n    from rsgl.models.config import X\n"
        "def g():\n    from rsgl.model_executor import y\n"
        "from rsgl import engine\n"
    )
    assert runtime_imports(f) == {"typing", "torch", "rsgl.model_executor", "rsgl.engine"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """rsgl module -> the rsgl modules it imports at run time (a name that is not a module,
    `from rsgl.x import f`, counts as its module). The package root is left out: it imports
    `Engine` only when asked for it (a module-level `__getattr__`)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported in runtime_imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported not in (name, "rsgl"):
                edges.add(imported)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_sees_the_old_engine_server_circle():
    graph = import_graph()
    graph["rsgl.server.scheduler_process"] = {"rsgl.engine"}
    graph["rsgl.engine"] = {"rsgl.server.threaded_frontend"}
    cycle = find_cycle(graph)
    assert cycle is not None and "rsgl.engine" in cycle and cycle[0] == cycle[-1]
