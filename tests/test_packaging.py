"""The package configuration ships every folder Python could import, so set-up prints no warnings.

setuptools warns ("Package would be ignored") for each folder under a package that has an
identifier's name but is missing from `packages`; the clients' template folders in
`integrations/` made set-up print ~360 lines of them.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]


def _importable_folders(package: str, folder: Path) -> set[str]:
    found = set()
    for child in folder.iterdir():
        if child.is_dir() and child.name.isidentifier() and child.name != "__pycache__" and any(child.iterdir()):
            name = f"{package}.{child.name}"
            found |= {name} | _importable_folders(name, child)
    return found


def test_every_importable_folder_is_a_listed_package() -> None:
    config = tomlkit.parse((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].unwrap()
    listed = set(config["packages"])
    expected = set()
    for package, folder in config["package-dir"].items():
        expected |= _importable_folders(package, ROOT / folder)
    missing = expected - listed
    assert not missing, f"add to [tool.setuptools] packages: {sorted(missing)}"
    assert "agentfold.integrations.codex" in listed


def test_data_only_packages_ship_their_files() -> None:
    """A listed folder without Python files ships only what package-data names (kernels/csrc: the C source)."""
    config = tomlkit.parse((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].unwrap()
    roots = sorted(config["package-dir"].items(), key=lambda item: -len(item[0]))
    for package in config["packages"]:
        root, folder = next((name, path) for name, path in roots if package == name or package.startswith(name + "."))
        path = ROOT / folder / package.removeprefix(root).lstrip(".").replace(".", "/")
        files = [f for f in path.iterdir() if f.is_file()]
        if any(f.suffix == ".py" for f in files) or not files:
            continue
        parent = package.rpartition(".")[0]
        patterns = [*config["package-data"].get(package, []),
                    *(p.split("/", 1)[1] for p in config["package-data"].get(parent, []) if p.startswith("*/"))]
        unshipped = [f.name for f in files if not any(fnmatch.fnmatch(f.name, p) for p in patterns)]
        assert not unshipped, f"{package}: package-data does not ship {unshipped}"
