"""The walls between tandem's parts, checked on every import statement of the source tree
(function-level imports included) and, for the router, on what importing it loads.

A wall crossed here is a design change: move the shared piece below both sides instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders and the names they are installed under (pyproject's package-dir).
PACKAGE_DIRS = {"tandem": "tandem", "router": "tandem.router", "prefill_node": "tandem.prefill_node",
                "decode_node": "tandem.decode_node", "kvtransfer": "tandem.kvtransfer", "kernels": "tandem.kernels",
                "proto": "tandem.proto"}


@dataclass(frozen=True)
class Wall:
    """Files whose module name starts with ``inside`` (and not with any of ``except_in``)
    must not import a module under any of ``forbidden``."""

    name: str
    inside: str
    forbidden: tuple[str, ...]
    except_in: tuple[str, ...] = ()


WALLS = (
    Wall("the router imports no torch", "tandem.router", ("torch", "transformers", "triton")),
    Wall("the prefill pool does not import the decode pool", "tandem.prefill_node", ("tandem.decode_node",)),
    Wall("the decode pool does not import the prefill pool", "tandem.decode_node", ("tandem.prefill_node",)),
    Wall("kernels import nothing from the pools, the workers, the engine or the router", "tandem.kernels",
         ("tandem.prefill_node", "tandem.decode_node", "tandem.worker", "tandem.engine", "tandem.router",
          "tandem.llm", "tandem.kvtransfer", "tandem.model", "tandem.parallel")),
    Wall("kvtransfer knows blocks and bytes, not models", "tandem.kvtransfer",
         ("tandem.model", "tandem.engine", "tandem.decoding", "tandem.worker", "tandem.parallel", "tandem.llm",
          "tandem.prefill_node", "tandem.decode_node", "tandem.router", "transformers")),
    Wall("configuration is beneath everything else", "tandem.config",
         ("tandem.model", "tandem.engine", "tandem.kvcache", "tandem.decoding", "tandem.worker", "tandem.parallel",
          "tandem.kvtransfer", "tandem.router", "tandem.llm", "tandem.bench", "tandem.sim", "transformers")),
    Wall("the core never imports the router", "tandem",
         ("tandem.router",),
         except_in=("tandem.router", "tandem.bench", "tandem.sim", "tandem.cli", "tandem.__main__")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = (*PACKAGE_DIRS[parts[0]].split("."), *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names; ``from a import b`` counts as ``a`` and ``a.b``
    (b may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def crossings(module: str, imports: set[str]) -> list[str]:
    """``"<wall>: <module> imports <name>"`` for each wall this module's imports cross."""
    found = []
    for wall in WALLS:
        if not _under(module, wall.inside) or any(_under(module, e) for e in wall.except_in):
            continue
        found += [f"{wall.name}: {module} imports {name}" for name in sorted(imports)
                  if any(_under(name, f) for f in wall.forbidden)]
    return found


def source_files() -> list[Path]:
    return sorted(p for folder in PACKAGE_DIRS for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)


def test_no_wall_is_crossed_in_the_source_tree() -> None:
    files = source_files()
    assert len(files) > 100  # the walk found the tree, not an empty folder
    found = [c for p in files for c in crossings(module_name(p), imported_modules(p.read_text()))]
    assert found == []


def test_no_file_is_over_350_lines() -> None:
    """One idea per file: a module (tests included) that grows past 350 lines is split."""
    files = [*source_files(), *(ROOT / "tests").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long


def test_the_top_of_tandem_is_its_public_api() -> None:
    """The parts live in sub-packages; the top of tandem/ keeps the public API (LLM, the
    parameters and outputs, the command), at most 12 modules."""
    top = sorted(p.name for p in (ROOT / "tandem").glob("*.py"))
    assert "llm.py" in top and len(top) <= 12, top


@pytest.mark.parametrize(("module", "source", "wall"), [
    ("tandem.router.policy", "import torch", "the router imports no torch"),
    ("tandem.router.openai.generation", "def f():\n    from transformers import AutoTokenizer",
     "the router imports no torch"),
    ("tandem.prefill_node.worker", "from tandem.decode_node import worker",
     "the prefill pool does not import the decode pool"),
    ("tandem.decode_node.worker", "from tandem.prefill_node.worker import PrefillWorker",
     "the decode pool does not import the prefill pool"),
    ("tandem.kernels.ops", "from tandem.engine.engine import LLMEngine", "kernels import nothing"),
    ("tandem.kvtransfer.sender", "import tandem.model.llama", "kvtransfer knows blocks and bytes"),
    ("tandem.engine.engine", "from tandem import router", "the core never imports the router"),
    ("tandem.config.engine_config", "from tandem.kvcache.capacity import pool_capacity",
     "configuration is beneath everything else"),
    ("tandem.worker.base", "from tandem.router.tokenizer import RouterTokenizer", "the core never imports the router"),
])
def test_each_wall_catches_a_crossing(module: str, source: str, wall: str) -> None:
    found = crossings(module, imported_modules(source))
    assert found and all(f.startswith(wall) for f in found)


@pytest.mark.parametrize(("module", "source"), [
    ("tandem.bench.serve", "from tandem.router.client import generate"),  # benchmarks drive the router
    ("tandem.cli", "from tandem.router import serve_command"),
    ("tandem.router.ray_backend", "from tandem.worker.api import Role"),  # the contract is torch-free
    ("tandem.kvtransfer.receiver", "import torch"),  # bytes on the device are tensors
])
def test_allowed_imports_pass(module: str, source: str) -> None:
    assert crossings(module, imported_modules(source)) == []


def test_importing_every_router_module_loads_no_torch() -> None:
    """What the router's modules import, transitively (the static walk sees one file at a time)."""
    script = (
        "import importlib, pkgutil, sys\n"
        "import tandem.router as r\n"
        "names = [m.name for m in pkgutil.walk_packages(r.__path__, 'tandem.router.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)\n"
        "print(len(names), ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 10 and out[1:] == []
