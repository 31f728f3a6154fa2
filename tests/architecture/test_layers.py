"""The package's layers, read from its own imports: every import points down (or inside its own subpackage),
and no module imports itself back through others. The docstring of each subpackage says what it may import;
this test is what keeps that true."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

# Bottom to top. A module may import from its own layer's unit or from any layer below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("gateway.paths",),  # the canonical-path rule, shared by the config's checks and routing
    ("gateway.config", "gateway.logs", "gateway.metrics"),
    ("gateway.protocol",),
    ("gateway.tokens",),
    ("gateway.admission",),
    ("gateway.tenants",),
    ("gateway.upstream",),
    ("gateway.server",),
    ("gateway.sim", "gateway.schema"),  # the simulator and the config schema tool: own entry points
    ("gateway.cli",),
    ("gateway.__main__",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> tuple[int, str]:
    """(layer, unit): the unit is the subpackage or top-level module the module belongs to."""
    for rank, units in enumerate(LAYERS):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                return rank, unit
    if module == "gateway":
        return -1, "gateway"
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def imports_of(path: Path) -> set[str]:
    """Every gateway module ``path`` imports, at any depth (function bodies and TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("gateway")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("gateway"):
            found.add(node.module)
            # ``from gateway.sim import cli`` imports the module gateway.sim.cli
            found |= {
                f"{node.module}.{a.name}"
                for a in node.names
                if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
            }
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}


def test_every_import_points_down() -> None:
    upward = []
    for module, targets in graph().items():
        rank, unit = unit_of(module)
        for target in targets:
            target_rank, target_unit = unit_of(target)
            if target_rank > rank or (target_rank == rank and target_unit != unit):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("rank", range(len(LAYERS) - 1))
def test_importing_a_layer_loads_nothing_above_it(rank: int) -> None:
    """The same rule at run time: ``python -c 'import <every module of a layer>'`` loads no module above it."""
    # __main__ modules run their program when imported: their imports are checked statically above
    modules = sorted(m for m in graph() if m != "gateway" and not m.endswith("__main__") and unit_of(m)[0] == rank)
    above = [u for units in LAYERS[rank + 1 :] for u in units]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"above = {above!r}\n"
        + "print('\\n'.join(sorted(m for m in sys.modules if any(m == u or m.startswith(u + '.') for u in above))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"importing layer {rank} {modules} loaded:\n{out}"
