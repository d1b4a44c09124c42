"""Imports only point down the rooms, and no module outgrows a reading.

face (`cli` -> `http`, `mcp`, `bench` -> `serve` -> `chat`) -> `sessions` -> `engine` -> `kernels`.
Read from the source (AST, function-level imports included), so nothing is imported to check it:
`sessions/` never imports MLX (a session home is SQLite plus safetensors files written from
numpy, whichever backend made the cache), `engine/` never imports `sessions`, `serve/` never
imports a transport.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"agentfold": "agentfold", "sessions": "agentfold.sessions", "engine": "agentfold.engine",
            "kernels": "agentfold.kernels", "integrations": "agentfold.integrations"}  # folder -> installed name
# room -> the rooms it may import (besides itself); a room is agentfold.<name>, or the folder above
MAY_IMPORT = {
    "kernels": set(),
    "engine": {"kernels"},
    "sessions": {"engine", "kernels"},
    "chat": {"sessions", "engine", "kernels"},
    "serve": {"chat", "sessions", "engine", "kernels"},
    "http": {"mcp", "serve", "chat", "sessions", "engine", "kernels", "root"},
    "mcp": {"serve", "chat", "sessions", "engine", "kernels", "root"},
    "bench": {"serve", "chat", "sessions", "engine", "kernels", "root"},
    "integrations": {"serve"},
    "cli": {"bench", "http", "mcp", "integrations", "serve", "chat", "sessions", "engine", "kernels", "root"},
    "root": {"kernels"},
}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def imports(folder: str) -> Iterator[tuple[str, int, str]]:
    """(file, line, absolute module) for every import in `folder`, relative ones resolved."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        package = [*PACKAGES[folder].split("."), *parts[:-1]]  # the package this file is in
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield where, node.lineno, alias.name
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                for name in names:
                    yield where, node.lineno, name
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
                yield where, node.lineno, node.args[0].value


def room(module: str) -> str | None:
    """The room an `agentfold...` module lives in; None outside the package."""
    parts = module.split(".")
    if parts[0] != "agentfold":
        return None
    return parts[1] if len(parts) > 1 else "root"


def under(module: str, *roots: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def test_the_walker_sees_relative_and_lazy_imports():
    found = {(where, module) for where, _, module in imports("sessions")}
    assert ("sessions/manager.py", "agentfold.engine.decode") in found  # `from ..engine.decode import ...`
    assert ("sessions/snapshots.py", "agentfold.sessions.index") in found  # `from .index import ...`
    assert ("sessions/index.py", "sqlite_utils") in found
    assert ("engine/torch/backend.py", "agentfold.engine.cache_layout") in {(w, m) for w, _, m in imports("engine")}


def test_sessions_never_import_mlx():
    bad = [f"{where}:{line} {module}" for where, line, module in imports("sessions") if under(module, "mlx", "mlx_lm")]
    assert not bad, bad


def test_engine_never_imports_sessions():
    bad = [f"{where}:{line} {module}" for where, line, module in imports("engine")
           if under(module, "sessions", "agentfold.sessions")]
    assert not bad, bad


@pytest.mark.parametrize("module", ["agentfold.sessions.index", "agentfold.sessions.snapshots"])
def test_session_storage_loads_without_mlx(module):
    """The session index and the snapshot files import no MLX, mlx-lm, transformers or torch."""
    script = (f"import sys, {module}\n"
              "bad = sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'transformers', 'torch'})\n"
              "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_import_for_its_side_effects():
    """The package's own `__init__` picks the BLAS before any submodule (and so before mlx) loads;
    nothing imports `agentfold` only for that side effect."""
    found = subprocess.run(["git", "grep", "-n", "import agentfold" + "  # noqa", "--", "*.py"], cwd=ROOT,
                           capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    assert not found.stdout.strip(), found.stdout


def test_imports_point_down_the_rooms():
    bad = []
    for folder, package in PACKAGES.items():
        for where, line, module in imports(folder):
            source = room(package + "." + Path(where).relative_to(folder).with_suffix("").as_posix().replace("/", "."))
            source = "root" if where == "agentfold/__init__.py" else source
            target = room(module)
            if target is not None and target != source and target not in MAY_IMPORT[source]:
                bad.append(f"{where}:{line} {source} -> {module}")
    assert not bad, bad


def test_importing_the_package_loads_nothing():
    """`import agentfold` names the version and nothing else: no BLAS, no MLX, no torch."""
    script = ("import sys, agentfold\n"
              "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'mlx', 'torch', 'numpy'}"
              " or m.startswith('agentfold.'))\n"
              "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _sources() -> Iterator[Path]:
    for folder in PACKAGES:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_module_outgrows_a_reading():
    """No file over ~500 lines and no function over ~80, outside the tests."""
    long_files = [f"{p.relative_to(ROOT)}: {n}" for p in _sources()
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length}")
    assert not long_files and not long_functions, (long_files, long_functions)
