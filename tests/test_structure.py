"""The layering DESIGN.md draws, checked on the source: which module may import what.

Each rule reads every module's imports with :mod:`ast` (indented and ``TYPE_CHECKING``
imports included), so a violation fails here, naming the file and line, before it
becomes a habit:

- ``streams/`` knows neutral events, not wire formats: it imports neither ``dialects``
  nor ``sse`` (nor the layers above it, ``transports`` and ``gateway``);
- uvicorn's internals are touched in one adapter module only
  (``transports/http1/uvicorn_adapter.py``): no other module imports
  ``uvicorn.protocols``, a private uvicorn module or name, or names a private attribute
  the adapter relies on;
- every dialect is reached through ``dialects/registry.py``: outside ``dialects/`` no
  module imports a concrete dialect module (only the seam ``base``, the ``registry`` and
  the shared helpers: the failure table, tool parsing and the request bodies).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.transports.http1.uvicorn_adapter import RELIED_ON

SRC = Path(__file__).resolve().parent.parent / "src" / "sluice"
ADAPTER = SRC / "transports" / "http1" / "uvicorn_adapter.py"
# Modules of dialects/ that are no dialect: the seam, the registry and shared helpers.
DIALECT_HELPERS = frozenset({"__init__", "base", "registry", "common", "tools"})
# Known exceptions to the registry rule, each with its way out (file, imported name); none
# today (openapi.py reads request bodies through ``ApiDialect.request_model``).
REGISTRY_RULE_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def modules(under: Path = SRC) -> list[Path]:
    return sorted(under.rglob("*.py"))


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports (``from a.b import c`` yields ``a.b`` and ``a.b.c``)."""
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(SRC.parent)}:{line}"


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def concrete_dialects() -> frozenset[str]:
    names = {path.stem for path in (SRC / "dialects").glob("*.py")}
    request_bodies = {name for name in names if name.endswith(("requests", "_request"))}
    return frozenset(names - DIALECT_HELPERS - request_bodies)


def test_the_rules_see_the_modules_they_judge() -> None:
    """The rules below would pass vacuously on an empty tree or a moved adapter."""
    assert len(modules()) > 50
    assert ADAPTER.is_file()
    assert {"native", "openai_chat", "anthropic", "openai_responses", "vercel_ui"} <= (
        concrete_dialects()
    )
    assert any(is_under(m, "uvicorn.protocols") for _, m in imports(ADAPTER))


@pytest.mark.parametrize(
    "forbidden", ["sluice.dialects", "sluice.sse", "sluice.transports", "sluice.gateway"]
)
def test_streams_import_no_wire_format_and_no_layer_above(forbidden: str) -> None:
    found = [
        where(path, line)
        for path in modules(SRC / "streams")
        for line, module in imports(path)
        if is_under(module, forbidden)
    ]
    assert found == [], f"streams/ imports {forbidden}"


def test_only_the_adapter_imports_uvicorn_internals() -> None:
    found = []
    for path in modules():
        if path == ADAPTER:
            continue
        for line, module in imports(path):
            if not is_under(module, "uvicorn"):
                continue
            private = any(part.startswith("_") for part in module.split("."))
            if is_under(module, "uvicorn.protocols") or private:
                found.append(f"{where(path, line)} imports {module}")
    assert found == []


def test_no_module_but_the_adapter_names_the_private_uvicorn_attributes_it_relies_on() -> None:
    private = {name for names in RELIED_ON.values() for name in names if name.startswith("_")} - {
        "__init__"
    }
    assert private  # the adapter does rely on some: the rule has something to find
    found = []
    for path in modules():
        if path == ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{where(path, node.lineno)} uses .{node.attr}")
    assert found == []


def test_dialects_are_reached_through_the_registry_only() -> None:
    concrete = {f"sluice.dialects.{name}" for name in concrete_dialects()}
    found = []
    for path in modules():
        if path.parent == SRC / "dialects":
            continue
        name = path.relative_to(SRC).as_posix()
        for line, module in imports(path):
            if module in concrete and (name, module) not in REGISTRY_RULE_EXCEPTIONS:
                found.append(f"{where(path, line)} imports {module}")
    assert found == []


def test_each_known_exception_to_the_registry_rule_is_still_needed() -> None:
    """An exception whose import is gone is dropped from the list, not kept as a hole."""
    for name, module in REGISTRY_RULE_EXCEPTIONS:
        assert module in {m for _, m in imports(SRC / name)}, (name, module)


def test_only_the_protocol_module_imports_the_vllm_grpc_package() -> None:
    """vLLM's engine protocol comes from ``smg-grpc-proto`` through one module
    (``vllm_grpc/proto.py``), so a change of the package's layout is one edit."""
    proto = SRC / "vllm_grpc" / "proto.py"
    assert any(is_under(m, "smg_grpc_proto") for _, m in imports(proto))
    found = [
        where(path, line)
        for path in modules()
        if path != proto
        for line, module in imports(path)
        if is_under(module, "smg_grpc_proto")
    ]
    assert found == []


def test_the_engine_imports_no_protocol_and_no_backend() -> None:
    """``engine/`` imports nothing else of ours: the worker serves it from outside."""
    found = [
        f"{where(path, line)} imports {module}"
        for path in modules(SRC / "engine")
        for line, module in imports(path)
        if is_under(module, "sluice") and not is_under(module, "sluice.engine")
    ]
    assert found == []
