"""Layers point down only, read from the package's own imports (function-level ones too)."""

import ast
from pathlib import Path

import pytest

EPD = Path(__file__).parents[1] / "epd"
# Top to bottom. A module may import its own package and the layers below it, never a layer
# above, nor another package of its own layer (those are peers: the three roles, say).
LAYERS = [
    {"epd.cli"},
    {"epd.serve", "epd.route", "epd.local", "epd.bench", "epd.plan"},
    {"epd.api"},
    {"epd.prefill", "epd.decode", "epd.encode"},
    {"epd.runtime"},
    {"epd.wire"},
    {"epd.generation", "epd.multimodal"},
    {"epd.checkpoint"},
    {"epd.model"},
    {"epd.kv"},
    {"epd.config"},
    {"epd.dtypes", "epd.memory"},
]
LAYER = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}


def package(module: str) -> str:
    """`epd.wire.codec` → `epd.wire`; `epd.cli` → `epd.cli`."""
    return ".".join(module.split(".")[:2])


def modules() -> dict[str, Path]:
    found = {}
    for path in EPD.rglob("*.py"):
        parts = path.relative_to(EPD.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module name imported; `from epd import x` counts as `epd.x`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import hides its layer"
            assert node.module is not None
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_every_package_has_a_layer():
    assert {package(m) for m in modules() if m != "epd"} <= set(LAYER)


@pytest.mark.parametrize("module", sorted(modules()), ids=str)
def test_imports_point_down(module):
    if module == "epd":
        return
    own = package(module)
    for name in imports(modules()[module]):
        assert not name.startswith("shapes"), f"{module} imports the demo task ({name})"
        if not name.startswith("epd.") or package(name) == own:
            continue
        assert package(name) in LAYER, f"{module} imports {name}, which is in no layer"
        assert LAYER[package(name)] > LAYER[own], f"{module} imports {name}: not a lower layer"
