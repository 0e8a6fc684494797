"""mypy over the tree as installed, started in the background: tests/conftest.py starts it
once the session has collected test_lint.py's mypy test, niced, so that a cold run (about 48 s
of CPU) fills the cores that the other tests leave idle instead of adding its time to the suite's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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


class MypyRun:
    """One mypy process over the whole tree, its report going to a temporary file (a pipe
    would stall it once full, as nobody reads it before the test)."""

    def __init__(self, process: subprocess.Popen[bytes], output: tempfile._TemporaryFileWrapper[bytes]) -> None:
        self.process = process
        self.output = output

    @classmethod
    def start(cls, niceness: int = 0) -> MypyRun:
        build_mypy_tree()
        output = tempfile.NamedTemporaryFile(prefix="mypy-", suffix=".txt")
        # --num-workers 2: a cold run takes 48 s alone, 36 s with 2.
        process = subprocess.Popen(
            [sys.executable, "-m", "mypy", "--num-workers", str(min(2, os.cpu_count() or 1))], cwd=ROOT,
            stdout=output, stderr=subprocess.STDOUT, preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        return cls(process, output)

    def result(self, timeout: float) -> tuple[int, str]:
        """-> (mypy's exit status, its report with the source tree's paths)."""
        returncode = self.process.wait(timeout=timeout)
        self.output.seek(0)
        report = source_paths(self.output.read().decode())
        self.output.close()
        return returncode, report

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()


MYPY_RUN = pytest.StashKey[MypyRun]()
