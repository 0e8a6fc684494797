"""Compiled CPU extensions: built once per machine into tandem's cache, loaded without a lock.

torch's `cpp_extension.load` builds in one shared directory under a file lock: a second
process waits on the first one's build, and a process killed mid-build leaves the lock for
every later one to wait on forever. Here each build runs in a directory of its own and the
finished library is renamed into place (atomic on one file system), keyed by a hash of
everything it is built from; a load is a plain import of that file. Two processes that
build at once both finish (one rename wins, both libraries are the same), and a killed
build leaves only a stray temporary directory.

`make install` builds every extension (`python -m tandem.kernels.cpu_build`), so serving
never compiles; a process that finds its library missing builds it once, as an engine starts
(ModelRunner: `ops.prepare_cpu_kernels`, `quantization.pack_for_cpu_kernels`), never
while a request waits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_KERNEL_CACHE"
"""Where the built libraries live (default: `kernels` under TANDEM_CACHE_DIR, the cache of
converted models, itself ~/.cache/tandem by default)."""


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(os.environ.get(CACHE_ENV) or Path(root) / "kernels")


@dataclasses.dataclass(frozen=True)
class CpuExtension:
    """A pybind11 torch extension: its module name, sources, headers and flags."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    def key(self) -> str:
        """A hash of all the library depends on: file contents, flags, torch, Python, CPU type."""
        h = hashlib.sha256()
        for part in (self.name, torch.__version__, sys.version, platform.machine(), *self.cflags, "|",
                     *self.ldflags):
            h.update(part.encode() + b"\0")
        for path in (*self.sources, *self.headers):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()[:20]

    def library_path(self) -> Path:
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        return cache_dir() / f"{self.name}-{self.key()}" / f"{self.name}{suffix}"


_modules: dict[str, ModuleType] = {}  # loaded (or built) by this process
_failed: set[str] = set()  # could not be had in this process: not tried again
_lock = threading.Lock()


def is_built(ext: CpuExtension) -> bool:
    return ext.library_path().is_file()


def build(ext: CpuExtension) -> Path:
    """Compile `ext` unless already built -> its library's path. Raises on a failed build."""
    if not is_built(ext):
        _modules[ext.name] = _compile(ext)
    return ext.library_path()


def load(ext: CpuExtension, *, build_if_missing: bool = True) -> ModuleType:
    """The extension's module, built first if missing (and allowed). Raises if it cannot be had."""
    module = _modules.get(ext.name)
    if module is not None:
        return module
    path = ext.library_path()
    if path.is_file():
        spec = importlib.util.spec_from_file_location(ext.name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # torch's libraries are loaded already: `import torch` above
    elif build_if_missing:
        module = _compile(ext)
    else:
        raise FileNotFoundError(f"{ext.name} is not built: run `python -m tandem.kernels.cpu_build`")
    _modules[ext.name] = module
    return module


def load_or_none(ext: CpuExtension, what: str, fallback: str) -> ModuleType | None:
    """The extension's module (built first if missing), or None where it cannot be had here
    (no compiler, a compile error): logged once as "`what` unavailable ...; `fallback`", and
    not tried again in this process."""
    if ext.name in _modules or ext.name in _failed:  # every call after the first: no lock
        return _modules.get(ext.name)
    with _lock:
        if ext.name not in _modules and ext.name not in _failed:
            try:
                module = load(ext)
            except Exception as e:  # noqa: BLE001 - every failure means "run the torch path"
                # A compiler's complaint comes last in the message: keep its tail.
                logger.warning("%s unavailable (%s: %s); %s", what, type(e).__name__, str(e).strip()[-1500:],
                               fallback)
                _failed.add(ext.name)
            else:
                isa = module.isa() if hasattr(module, "isa") else "portable"  # the kernels that pick one say which
                logger.info("%s loaded (%s code)", what, isa)
        return _modules.get(ext.name)


def _compile(ext: CpuExtension) -> ModuleType:
    """Build `ext` in a directory of its own, rename the library into the cache -> the module."""
    _put_ninja_on_path()
    from torch.utils import cpp_extension

    target = ext.library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{ext.name}-build-", dir=cache_dir()))
    try:
        start = time.monotonic()
        logger.info("compiling %s (once per machine)", ext.name)
        module = cpp_extension.load(name=ext.name, sources=[str(p) for p in ext.sources],
                                    extra_cflags=list(ext.cflags), extra_ldflags=list(ext.ldflags),
                                    extra_include_paths=sorted({str(p.parent) for p in ext.headers}),
                                    build_directory=str(work), verbose=False)
        built = next(work.glob(f"{ext.name}*.so"))
        os.replace(built, target)  # NOTE: the only write a reader can see, and it is atomic
        logger.info("compiled %s in %.0f s: %s", ext.name, time.monotonic() - start, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return module


def _put_ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH: use the one installed with tandem."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def extensions() -> tuple[CpuExtension, ...]:
    """Every CPU extension tandem has."""
    from tandem.kernels import (
        decode_step_cpu,
        f32_gemv_cpu,
        int4_gemv_cpu,
        int8_gemv_cpu,
        layer_ops_cpu,
        paged_decode_attention_cpu,
    )
    return (paged_decode_attention_cpu.EXTENSION, int4_gemv_cpu.EXTENSION, int8_gemv_cpu.EXTENSION,
            f32_gemv_cpu.EXTENSION, layer_ops_cpu.EXTENSION, decode_step_cpu.EXTENSION)


def main() -> int:
    """Build every extension; a failure is reported, not fatal (the torch references run)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for ext in extensions():
        try:
            logger.info("%s: %s", ext.name, build(ext))
        except Exception as e:  # noqa: BLE001 - no compiler here: tandem runs without the kernel
            logger.warning("%s could not be built (%s: %s); the torch reference runs instead",
                           ext.name, type(e).__name__, str(e).strip()[-1500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
