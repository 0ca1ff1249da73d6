"""The instruction mix of the NEON path's bf16 products (csrc/simd/neon.c's
copies of simd/flash.inc with FLASH_DP and of simd/gemm_dp.inc, on the
BF16 extension's BFDOT), read from the disassembly of neon.c
cross-compiled for AArch64: qemu proves their results (tests/neon) but
says nothing of their speed, so the register tiles are checked here as
test_instruction_mix.py checks the x86 ones.

The forward's scores' tile and P.V tiles must be FLASH_DP_MR x FLASH_NV
(then fewer rows of V^T) register tiles of BFDOT, the backward's product
(simd/gemm_dp.inc) MR x 2 vectors: each step loads its vectors of pairs
and broadcasts a pair per row (ldr s + dup, or ld1r; the P.V tile and
the product take their rows' pairs by BFDOT's by-element form, no dup),
then runs rows x vectors BFDOTs into as many distinct accumulators,
nothing else on the vector registers and nothing to or from the stack.

Runs where the cross compiler and its objdump are installed
(gcc-aarch64-linux-gnu, which .ci/neon installs); skipped elsewhere.
"""

import re
import shutil
import subprocess

import pytest

import isa_loops as il

CC = "aarch64-linux-gnu-gcc"
OBJDUMP = "aarch64-linux-gnu-objdump"
pytestmark = pytest.mark.skipif(
    shutil.which(CC) is None or shutil.which(OBJDUMP) is None,
    reason=f"needs {CC} and {OBJDUMP} (gcc-aarch64-linux-gnu)")

NEON = il.ROOT / "csrc" / "simd" / "neon.c"
_FUNC = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
_TARGET = re.compile(r"(?:^|,\s*)([0-9a-f]+) <")
_BRANCH = re.compile(r"^(?:b(?:\.\w+)?|cbn?z|tbn?z)$")
_VREG = re.compile(r"\bv\d+\.")


def _define(name):
    text = NEON.read_text()
    return int(re.search(rf"^#define {name} (\d+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def funcs(tmp_path_factory):
    """{symbol: [(address, mnemonic, operands)]} of neon.c, built with
    setup.py's flags for AArch64."""
    obj = tmp_path_factory.mktemp("neon") / "neon.o"
    subprocess.run([CC, "-std=c11", "-O3", "-fno-strict-aliasing",
                    "-pthread", f"-I{il.ROOT / 'csrc'}", "-c", str(NEON),
                    "-o", str(obj)], check=True, capture_output=True)
    out = subprocess.run([OBJDUMP, "-d", "-w", "--no-show-raw-insn",
                          str(obj)], check=True, capture_output=True,
                         text=True).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
        elif (m := _INSN.match(line)) and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2),
                        m.group(3).split("//")[0].strip()))
    return funcs


def _innermost_loops(insns):
    """The spans from a backward branch's target to the branch that hold
    no other such span (AArch64's b, b.cond, cbz/cbnz, tbz/tbnz)."""
    spans = set()
    for addr, mnem, ops in insns:
        m = _TARGET.search(ops)
        if _BRANCH.match(mnem) and m:
            target = int(m.group(1), 16)
            if insns[0][0] <= target <= addr:
                spans.add((target, addr))
    inner = [s for s in spans
             if not any(o != s and s[0] <= o[0] and o[1] <= s[1]
                        for o in spans)]
    return [[i for i in insns if lo <= i[0] <= hi] for lo, hi in
            sorted(inner)]


def _bfdot_tiles(funcs, syms):
    """(symbol, BFDOTs, accumulators) of each innermost loop of syms with
    more than two BFDOTs, asserting each is a register tile: nothing else
    on the vector registers but loads and broadcasts, no stack access."""
    tiles = []
    for sym in syms:
        for loop in _innermost_loops(funcs[sym]):
            if sum(m == "bfdot" for _a, m, _o in loop) <= 2:
                continue
            accs, problems = set(), []
            for addr, m, o in loop:
                if "[sp" in o:
                    problems.append(f"stack {addr:x}: {m} {o}")
                elif m == "bfdot":
                    accs.add(o.split(",")[0].strip())
                elif _VREG.search(o) and m not in ("dup", "ld1r", "ldr",
                                                   "ldp", "ld1"):
                    problems.append(f"other {addr:x}: {m} {o}")
            listing = "\n".join(f"  {a:x}: {m} {o}" for a, m, o in loop)
            assert not problems, (f"{sym}:\n  " + "\n  ".join(problems)
                                  + "\n" + listing)
            tiles.append((sym, sum(m == "bfdot" for _a, m, _o in loop),
                          len(accs),
                          sum(m == "dup" for _a, m, _o in loop)))
    return tiles


def test_bfdot_tiles(funcs):
    """The forward (simd/flash.inc): the scores' tile and the first P.V
    tile, FLASH_DP_MR x FLASH_NV each."""
    base = "flash_forward_dp_f32_neon"
    assert base in funcs, f"no {base}: neon.c built without BF16"
    nv, mr = _define("FLASH_NV"), _define("FLASH_DP_MR")
    syms = [s for s in funcs if s.startswith("flash_") and "_dp_" in s]
    tiles = _bfdot_tiles(funcs, syms)
    assert all(n == accs and n % nv == 0 for _s, n, accs, _d in tiles), (
        tiles)
    rows = [accs // nv for _s, _n, accs, _d in tiles]
    # the scores' tile and the first P.V tile (flash_pv inlined or not)
    assert rows.count(mr) >= 2, f"not two {mr} x {nv} tiles: {rows}"
    # the P.V tile takes its rows' pairs by lane (DP_ROWS4): no dup
    assert any(accs == mr * nv and dups == 0
               for _s, _n, accs, dups in tiles), tiles


def test_gemm_tile(funcs):
    """The backward's products (simd/gemm_dp.inc): MR rows x 2 vectors,
    a pair of k a step, 2 MR BFDOTs into 2 MR accumulators."""
    syms = [s for s in funcs if s.startswith(("gemm_dp_f32_neon",
                                              "dp_rows_f32_neon",
                                              "dp_tile_f32_neon"))]
    assert syms, "no gemm_dp_f32_neon: neon.c built without BF16"
    mr = _define("MR")
    tiles = _bfdot_tiles(funcs, syms)
    # A's pairs by lane (DP_TILE_STEP): no dup
    assert tiles and all(n == accs == 2 * mr and dups == 0
                         for _s, n, accs, dups in tiles), tiles


def test_dot_loop_is_bfdot(funcs):
    """The bench's measure of the unit (dot_loop): BFDOT chains only."""
    loops = [lp for lp in _innermost_loops(funcs["dot_loop_f32_neon"])
             if any(m == "bfdot" for _a, m, _o in lp)]
    assert loops, "no BFDOT loop in dot_loop_f32_neon"
    accs = {o.split(",")[0] for _a, m, o in loops[0] if m == "bfdot"}
    assert len(accs) == 24, sorted(accs)
