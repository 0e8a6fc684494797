"""The tree stays clean under the linters pyproject.toml configures: ruff (pycodestyle, pyflakes,
import order) and mypy (types, with the bodies of unannotated functions checked too).

Both run from this environment, as `make test` installs them from requirements/test.lock. mypy keeps
its cache in .mypy_cache: a fresh clone pays for a cold run (most of it reading torch's types).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Where mypy finds tandem as it is installed (the first of pyproject's [tool.mypy] files).
MYPY_TREE = ROOT / "build" / "mypy"


def package_dirs() -> dict[str, str]:
    """Installed package name -> the folder it comes from (pyproject's package-dir), e.g.
    tandem.router -> router."""
    return PYPROJECT["tool"]["setuptools"]["package-dir"]


def build_mypy_tree() -> None:
    """build/mypy/tandem: the tandem package in its installed shape, as relative symlinks to the
    source tree (tandem/'s own entries, then router/, proto/, ... as its subpackages), so that mypy
    checks the real files under the module names the code imports them by."""
    package = MYPY_TREE / "tandem"
    package.mkdir(parents=True, exist_ok=True)
    links: dict[Path, Path] = {}
    for name, folder in package_dirs().items():
        if name == "tandem":
            for entry in (ROOT / folder).iterdir():
                if entry.name != "__pycache__":
                    links[package / entry.name] = entry
        else:
            links[MYPY_TREE.joinpath(*name.split("."))] = ROOT / folder
    for stale in package.iterdir():
        if stale not in links:
            stale.unlink()
    for link, target in links.items():
        relative = Path(os.path.relpath(target, link.parent))
        if not (link.is_symlink() and link.readlink() == relative):
            link.unlink(missing_ok=True)
            link.symlink_to(relative, target_is_directory=target.is_dir())


def source_paths(output: str) -> str:
    """mypy's report with build/mypy's paths turned back into the source tree's."""
    tree = MYPY_TREE.relative_to(ROOT).as_posix()
    for name, folder in sorted(package_dirs().items(), key=lambda item: -len(item[0])):
        output = output.replace(f"{tree}/{name.replace('.', '/')}/", f"{folder}/")
    return output


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing():
    result = run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


def test_mypy_finds_nothing():
    build_mypy_tree()
    result = run("mypy", "--num-workers", str(min(2, os.cpu_count() or 1)))  # a cold run: 48 s alone, 36 s with 2
    if result.returncode != 0:
        pytest.fail(source_paths(result.stdout + result.stderr), pytrace=False)
