"""The tree stays clean under the linters pyproject.toml configures: ruff (pycodestyle, pyflakes,
import order) and mypy (types, with the bodies of unannotated functions checked too).

Both run from this environment, as `make test` installs them from requirements/test.lock. mypy keeps
its cache in .mypy_cache: a fresh clone pays for a cold run (most of it reading torch's types), which
starts with the session, niced, on the cores the other tests leave idle (mypy_run.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from mypy_run import MYPY_RUN, ROOT, MypyRun


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing():
    result = run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


def test_mypy_finds_nothing(request):
    mypy = request.config.stash.get(MYPY_RUN, None) or MypyRun.start()
    returncode, output = mypy.result(timeout=600)
    if returncode != 0:
        pytest.fail(output, pytrace=False)
