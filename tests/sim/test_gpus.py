"""The GPU table: lookup by name, the unit conversions, and a datasheet cited for every row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.sim import gpus
from tandem.sim.gpus import GPUS, gpu


def test_lookup_ignores_case_and_spaces():
    assert gpu("h100") is gpu("H100") is gpu(" H100 ")
    assert gpu("a100-80gb").name == "A100-80GB"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        gpu("V100")
    message = str(e.value)
    assert "'V100'" in message
    for name in ("A100-40GB", "A100-80GB", "H100", "H200", "L4"):
        assert name in message


@pytest.mark.parametrize("name, tflops, gb_s, mem, link", [
    # The datasheets' own figures (dense BF16 = half the "with sparsity" figure).
    ("A100-40GB", 312, 1555, 40, 600),
    ("A100-80GB", 312, 2039, 80, 600),
    ("H100", 1979 / 2, 3350, 80, 900),
    ("H200", 1979 / 2, 4800, 141, 900),
    ("L4", 242 / 2, 300, 24, 64),
])
def test_rows_hold_the_datasheet_figures(name, tflops, gb_s, mem, link):
    g = gpu(name)
    assert g.bf16_dense_tflops == pytest.approx(tflops, abs=0.6)
    assert (g.hbm_gb_s, g.memory_gib, g.interconnect_gb_s) == (gb_s, mem, link)


def test_units():
    h = gpu("H100")
    assert h.flops == 989e12
    assert h.hbm_bytes_per_s == 3.35e12
    assert h.link_bytes_per_s == 450e9  # one direction of NVLink 4's 900 GB/s
    assert h.memory_bytes == 80 * 1024**3


def test_every_row_cites_a_datasheet():
    source = Path(gpus.__file__).read_text()
    rows = re.findall(r"((?:\s*#[^\n]*\n)*)\s*GpuSpec\(\"([^\"]+)\"", source)
    assert {name.lower() for _, name in rows} == set(GPUS)
    for comment, name in rows:
        assert "datasheet" in comment.lower(), f"{name}: no datasheet cited above its row"
