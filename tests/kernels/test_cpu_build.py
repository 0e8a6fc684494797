"""Building and loading the compiled CPU extensions: keyed by what they are built from,
loaded by another process from the cache without a build or a lock."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tandem.kernels import cpu_build
from tandem.kernels.paged_decode_attention_cpu import EXTENSION


def test_the_key_follows_sources_headers_and_flags(tmp_path):
    source, header = tmp_path / "a.cpp", tmp_path / "a.h"
    source.write_text("int f() { return 1; }\n")
    header.write_text("#pragma once\n")
    ext = cpu_build.CpuExtension("tandem_test_ext", (source,), (header,), ("-O3",), ())
    key = ext.key()
    assert ext.key() == key and len(key) == 20
    assert dataclasses.replace(ext, cflags=("-O2",)).key() != key
    header.write_text("#pragma once\n#define X 1\n")
    assert ext.key() != key, "a changed header is a changed library"
    key = ext.key()
    source.write_text("int f() { return 2; }\n")
    assert ext.key() != key


def test_a_missing_library_is_not_built_when_that_is_not_allowed(empty_kernel_cache):
    tmp_path = empty_kernel_cache
    assert not cpu_build.is_built(EXTENSION)
    with pytest.raises(FileNotFoundError, match="python -m tandem.kernels.cpu_build"):
        cpu_build.load(EXTENSION, build_if_missing=False)
    assert list(tmp_path.iterdir()) == []


def test_another_process_loads_the_built_library_from_the_cache():
    """`make install` built it; a fresh process imports that file, compiling nothing."""
    if not cpu_build.is_built(EXTENSION):
        cpu_build.build(EXTENSION)
    code = ("import sys; from tandem.kernels import cpu_build; "
            "from tandem.kernels.paged_decode_attention_cpu import EXTENSION; "
            "m = cpu_build.load(EXTENSION, build_if_missing=False); "
            "print(m.__file__); print('torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    path, imported_builder = out.stdout.split()
    assert path == str(EXTENSION.library_path())
    assert imported_builder == "False", "loading must not go through torch's builder (and its lock)"
