"""Which of llama.cpp's CPU paths prefixpin takes (core.cpu, adapters.embedded.cpu_paths),
and the evidence for avoiding its AMX kernels, read from this machine's own compiler."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from prefixpin.adapters.embedded.cpu_paths import choose_cpu_paths, compiled_features
from prefixpin.adapters.embedded.supervisor import describe_exit
from prefixpin.core.cpu import (
    NO_AMX_CFLAGS,
    crash_advice,
    flags_digest,
    has_amx,
    library_has_amx,
    parse_flags,
)
from prefixpin.proxy.engine.engine_facts import parse_llama_args
from prefixpin.proxy.ops.doctor import Observations, cpu_paths_finding
from tests.rig.llama_build import CMAKE_FLAGS, build_key

# llama_print_system_info() of a -march=native build on a Sapphire Rapids Xeon
# (llama-cpp-python 0.3.36), and on this project's AMD machines.
AMX_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
            "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | "
            "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
AMD_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
            "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | "
            "OPENMP = 1 | REPACK = 1 | ")

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8
processor\t: 1
flags\t\t: fpu
"""


def test_the_first_processors_flags_are_read() -> None:
    flags = parse_flags(CPUINFO)
    assert {"avx512f", "amx_int8", "amx_tile"} <= flags
    assert has_amx(flags)
    assert not has_amx(parse_flags("flags\t: fpu avx2 avx512f\n"))
    assert parse_flags("no flags here") == frozenset()


def test_a_native_build_is_keyed_by_the_cpu() -> None:
    one, other = parse_flags(CPUINFO), parse_flags("flags: fpu avx2\n")
    assert flags_digest(one) != flags_digest(other)
    assert flags_digest(one) == flags_digest(frozenset(sorted(one)))
    assert build_key().endswith(f"-cpu{flags_digest()}")


def test_auto_turns_repacking_off_only_where_the_library_has_amx_kernels() -> None:
    assert library_has_amx(AMX_INFO)
    assert not library_has_amx(AMD_INFO)
    on_amx = choose_cpu_paths("auto", AMX_INFO)
    assert on_amx.repack is False
    assert "AMX" in on_amx.reason
    assert "AMX_INT8" in on_amx.features
    assert choose_cpu_paths("auto", AMD_INFO).repack is True
    assert choose_cpu_paths("on", AMX_INFO).repack is True
    assert choose_cpu_paths("off", AMD_INFO).repack is False
    line = choose_cpu_paths("auto", AMX_INFO).line()
    assert line.startswith("llama.cpp CPU paths: AVX2 AVX512 AVX512_VNNI AVX512_BF16 AMX_INT8")
    assert "repack off" in line


def test_compiled_features_reads_only_the_ones_set() -> None:
    assert compiled_features("CPU : AVX2 = 1 | AVX512 = 0 | REPACK = 1 |") == ("AVX2", "REPACK")


def test_a_workers_exit_is_named() -> None:
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "exited with status 2"


def test_crash_advice_names_the_fix() -> None:
    assert "--no-repack" in crash_advice()
    assert "general protection fault" in crash_advice()


def _gcc() -> str:
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed (the project's machines have it; so does the rig's build)"
    return compiler


def test_the_rigs_flags_keep_the_amx_kernels_out_of_a_native_build() -> None:
    """``-march=native`` on an AMX CPU defines __AMX_INT8__, which compiles llama.cpp's
    AMX kernels in; the rig's extra flags win over it, whichever comes first."""
    assert f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}" in CMAKE_FLAGS
    for order in ([*NO_AMX_CFLAGS.split(), "-march=sapphirerapids"],
                  ["-march=sapphirerapids", *NO_AMX_CFLAGS.split()]):
        macros = subprocess.run([_gcc(), *order, "-dM", "-E", "-x", "c++", "/dev/null"],
                                capture_output=True, text=True, check=True).stdout
        assert "__AMX_INT8__" not in macros
        assert "__AVX512VNNI__" in macros  # everything else -march gives stays
    plain = subprocess.run([_gcc(), "-march=sapphirerapids", "-dM", "-E", "-x", "c++",
                            "/dev/null"], capture_output=True, text=True, check=True).stdout
    assert "__AMX_INT8__" in plain


# ggml/src/ggml-cpu/amx/mmq.cpp (llama.cpp b1-0c1e570, MIT), the tile configuration.
TILE_CONFIG = r"""
#include <immintrin.h>
#include <cstdint>
struct tile_config_t {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
void ggml_tile_config_init(void) {
    static thread_local bool done = false;
    if (done) return;
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.start_row = 0;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;
    _tile_loadconfig(&tc);
    done = true;
}
"""


def test_this_compiler_drops_the_amx_tile_configuration(tmp_path: Path) -> None:
    """The root cause, read off the assembly: GCC's ``_tile_loadconfig`` says it reads 8
    bytes, so the stores of the tile rows and widths are dead to the optimizer and
    ``ldtilecfg`` loads palette 1 with no tile configured. If this fails, the toolchain
    no longer drops them: core.cpu's reasoning (and the AMX avoidance) needs a new look."""
    source = tmp_path / "tile.cpp"
    source.write_text(TILE_CONFIG)
    assembly = subprocess.run([_gcc(), "-O3", "-march=sapphirerapids", "-S", "-o", "-",
                               str(source)], capture_output=True, text=True, check=True).stdout
    body = assembly.split("ggml_tile_config_initv:", 1)[1].split("ret", 1)[0]
    assert "ldtilecfg" in body
    stores = [line.strip() for line in body.splitlines()
              if re.search(r"mov\S*\s+\S+,\s*-?\d*\(%[re]sp\)", line)]
    # What reaches the config: the whole struct zeroed, then the palette; no row or width.
    assert len(stores) == 2, stores
    assert stores[1].startswith("movb\t$1,"), stores


@pytest.mark.parametrize("line", [AMX_INFO, AMD_INFO])
def test_the_summary_says_what_was_chosen(line: str) -> None:
    paths = choose_cpu_paths("auto", line)
    assert paths.summary().startswith(f"repack {'on' if paths.repack else 'off'}: auto")


def _observed(argv: list[str], env: dict[str, str] | None = None) -> Observations:
    flags = parse_llama_args(["llama-server", *argv], env or {}, "command line of process 1")
    return Observations("http://127.0.0.1:8080", {}, 200, None, 200, 200, 400, "", None,
                        flags, None, "", None)


@pytest.mark.parametrize(("argv", "env", "status"), [
    ([], {}, "warning"),
    (["--no-repack"], {}, "ok"),
    (["-nr"], {}, "ok"),
    ([], {"LLAMA_ARG_REPACK": "0"}, "ok"),
    (["--repack"], {}, "warning"),
])
def test_doctor_tells_a_llama_server_on_an_amx_cpu_to_add_no_repack(
        argv: list[str], env: dict[str, str], status: str) -> None:
    finding = cpu_paths_finding(_observed(argv, env), amx=True)
    assert finding.status == status, finding
    if status == "warning":
        assert "--no-repack" in finding.fix
        assert "AMX" in finding.summary
    assert cpu_paths_finding(_observed(argv, env), amx=False).status == "ok"


def test_doctor_knows_nothing_of_the_cpu_of_a_server_it_cannot_see() -> None:
    observed = _observed([])
    observed.flags = None
    finding = cpu_paths_finding(observed, amx=False)
    assert finding.status == "unknown"
    assert "--no-repack" in finding.summary
