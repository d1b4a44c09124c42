"""Imports only point down the layers: `agentfold -> sessions -> engine -> kernels`.

Read from the source (AST, function-level imports included), so nothing is imported to check it:
`sessions/` never imports MLX (a session home is SQLite plus safetensors files written from
numpy, whichever backend made the cache), and `engine/` never imports `sessions`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"sessions": "agentfold.sessions", "engine": "agentfold.engine"}  # folder -> installed name


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
