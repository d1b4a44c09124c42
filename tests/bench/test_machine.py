"""The machine header's CPU identity: what tells two CPUs with the same bare model name apart."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from agentfold.bench.machine import VECTOR_FLAGS, cpu_identity, machine_info

# The first lines of /proc/cpuinfo on two VMs this project runs on, both named "AMD EPYC" (flags cut
# to the ones that matter and a few others).
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse sse2 fma f16c avx avx2 bmi2 vaes vpclmulqdq

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
flags\t\t: avx512f
"""
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu fma f16c avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 vaes
"""


def test_two_epycs_with_one_name_are_told_apart():
    zen3, zen4 = cpu_identity(ZEN3), cpu_identity(ZEN4)
    assert zen3 == {"vendor": "AuthenticAMD", "family": 25, "model": 1, "stepping": 1,
                    "vector_flags": ["avx2", "fma", "f16c"]}  # the first processor's block only
    assert (zen4["family"], zen4["model"]) == (25, 17)
    assert zen4["vector_flags"] == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                    "avx512_bf16"]


def test_text_without_numbers_gives_none_not_an_error():
    assert cpu_identity("vendor_id : Weird\ncpu family : ?\n") == {
        "vendor": "Weird", "family": None, "model": None, "stepping": None, "vector_flags": []}


@pytest.mark.skipif(platform.system() != "Linux" or not Path("/proc/cpuinfo").exists(), reason="Linux's /proc/cpuinfo")
def test_this_machine_is_in_the_header():
    cpu = machine_info()["cpu"]
    assert cpu["vendor"] and isinstance(cpu["family"], int) and set(cpu["vector_flags"]) <= set(VECTOR_FLAGS)
    if platform.machine() == "x86_64":
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
        assert ("avx2" in cpu["vector_flags"]) == ("avx2" in flags)
