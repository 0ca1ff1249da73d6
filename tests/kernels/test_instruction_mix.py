"""The instruction mix of the built extension's micro-kernel, on every x86
SIMD path and dtype, read from its disassembly (objdump): so that a
regression on a CPU we don't have (AVX-512 on an AVX2 host) shows here.

The register-tiled micro-kernel (csrc/simd/tile.inc, TILE_ACCUMULATE) is
where the attention products spend their time.  Its k-loop must be
2 MR FMAs per k step on the path's full vectors (ymm: AVX2, zmm:
AVX-512), each FMA taking a broadcast of A (a vbroadcastss/sd load, or
an embedded {1toN} memory broadcast) and one of the two B vectors loaded
in the loop, into 2 MR distinct accumulator registers, with no other
vector instruction and no spill to the stack (docs/isa.md has the
llvm-mca argument for what that buys on each CPU).  The loops are found
by tests/kernels/isa_loops.py, which .ci/mca shares.

Runs where the build is an x86-64 ELF and objdump is installed (CI:
x86-64 with binutils); not on a sanitizer build, whose instrumented
loads are other instructions on purpose.
"""

import platform
import shutil
import sys

import pytest

from attention_c import _core

import isa_loops as il

X86_LINUX = (sys.platform.startswith("linux")
             and platform.machine().lower() in ("x86_64", "amd64"))
needs_objdump = pytest.mark.skipif(
    not X86_LINUX or shutil.which("objdump") is None,
    reason="needs an x86-64 Linux build and objdump (binutils)")
PATHS = [(isa, dtype) for isa in il.ISAS for dtype in il.DTYPES]


@pytest.fixture(scope="module")
def funcs():
    funcs = il.disassemble(_core.__file__)
    if any("__asan_" in name or "__ubsan_" in name for name in funcs):
        pytest.skip("a sanitizer build: its loads are instrumented")
    return funcs


@needs_objdump
@pytest.mark.parametrize("isa, dtype", PATHS)
def test_micro_kernel_loop(funcs, isa, dtype):
    loops = il.kernel_loops(funcs, isa, dtype)
    where = {sym.split(".")[0] for sym, _ in loops}
    # the two out-of-line kernels (called from simd/gemm.inc, fused.inc
    # and fused_backward.inc) and tile_rows / tile_packed, on their own
    # or inlined into gemm_macro: four loops at least
    for base in ("micro_kernel_rows", "micro_kernel_packed"):
        assert f"{base}_{dtype}_{isa}" in where, (
            f"no k-loop of {base}_{dtype}_{isa} in {_core.__file__}: "
            f"found {sorted(where)}")
    assert len(loops) >= 4, f"{len(loops)} k-loops in {sorted(where)}"
    # the short micro-panels' tile, where the path has one (gemm_macro)
    small = il.mr_of(isa, "MR_SMALL", 0)
    assert not small or any(il.loop_rows(isa, loop) == small
                            for _, loop in loops), (
        f"no {small}-row k-loop on {isa} {dtype}: found {sorted(where)}")
    # and the wide tile (GEMM_MR_WIDE rows x 4 vectors), where it has one
    wide = il.mr_of(isa, "GEMM_MR_WIDE", 0)
    assert not wide or any(il.loop_nv(isa, loop) == 4 for _, loop in loops), (
        f"no {wide} x 4 k-loop on {isa} {dtype}: found {sorted(where)}")
    for sym, loop in loops:
        problems = il.check_kernel_loop(loop, isa, dtype,
                                        il.loop_rows(isa, loop),
                                        il.stack_regs(funcs[sym]),
                                        il.loop_nv(isa, loop))
        listing = "\n".join(f"  {a:x}: {m} {o}" for a, m, o in loop)
        assert not problems, (f"{sym}, loop at {loop[0][0]:x}:\n  "
                              + "\n  ".join(problems) + "\n" + listing)


@needs_objdump
def test_amx_kernel(funcs):
    """The bf16 products' kernel (simd/flash_amx.inc), built whatever the
    CPU: its products on tiles (TDPBF16PS, not AVX512_BF16's vdpbf16ps,
    which ran at half the float32 FMA rate on the Xeon it was written
    on); its softmax loop over a panel's rows keeps its vectors in
    registers: the degree-3 exp2 (vrndscaleps, vscalefps), P rounded to
    bf16 in pairs of vectors, no spill."""
    syms = [s for s in funcs if s.startswith(("flash_amx_f32_avx512",
                                              "amx_"))]
    if "flash_amx_f32_avx512" not in syms:
        pytest.skip("built without AMX (compiler or OS)")
    insns = [i for s in syms for i in funcs[s]]
    mnems = [m for _a, m, _o in insns]
    for m in ("ldtilecfg", "tilerelease", "tdpbf16ps", "tileloadd",
              "tilestored", "vcvtne2ps2bf16", "vpermw"):
        assert m in mnems, f"no {m} in {syms}"
    assert "vdpbf16ps" not in mnems
    rows = [(sym, loop) for sym in syms
            for loop in il.innermost_loops(funcs[sym])
            if sum(m == "vscalefps" for _a, m, _o in loop) == 4]
    assert rows, "no softmax loop of 4 vectors of weights per row"
    for sym, loop in rows:
        stack = il.stack_regs(funcs[sym])
        ms = [m for _a, m, _o in loop]
        assert ms.count("vrndscaleps") == 4 and \
            ms.count("vcvtne2ps2bf16") == 2, (sym, ms)
        spills = [(m, o) for _a, m, o in loop
                  if "mm" in o and any(f"(%{r}" in o for r in stack)]
        assert not spills, f"spills in {sym}'s softmax loop: {spills}"


@needs_objdump
def test_amx_product_kernel(funcs):
    """The backward's products on AMX (simd/gemm_amx.inc), built whatever
    the CPU: the tiles configured, zeroed, stored and released around
    each product, no vdpbf16ps; its k-loop over chunks of 16 pairs (the
    full ones) loads two tiles of A and two of B and runs four TDPBF16PS
    into the 2 x 2 block (then, for a split A, two tiles of its rest and
    four more), with no other vector instruction."""
    syms = [s for s in funcs if s.startswith(("gemm_amx_f32_avx512",
                                              "gemm_packed_amx_f32_avx512",
                                              "amx_rows_f32_avx512",
                                              "amx_block_f32_avx512",
                                              "amx_configure_f32_avx512"))]
    if "gemm_amx_f32_avx512" not in funcs:
        pytest.skip("built without AMX (compiler or OS)")
    mnems = {m for s in syms for _a, m, _o in funcs[s]}
    assert {"ldtilecfg", "tilerelease", "tilezero", "tileloadd",
            "tdpbf16ps", "tilestored"} <= mnems, sorted(syms)
    assert "vdpbf16ps" not in mnems
    loops = []
    for loop in (x for s in syms for x in il.innermost_loops(funcs[s])):
        ms = [m for _a, m, _o in loop]
        products = ms.count("tdpbf16ps")
        if products in (4, 8) and ms.count("tileloadd") == 2 + products // 2:
            loops.append(loop)
    # (the loop through the short chunk's copy has its vector moves)
    clean = [loop for loop in loops
             if not any(any(r in o for r in ("%xmm", "%ymm", "%zmm", "%k"))
                        or m.startswith(("v", "k")) for _a, m, o in loop)]
    assert clean, (f"no k-loop of the tiles' loads and products alone in "
                   f"{syms}: {[[m for _a, m, _o in x] for x in loops]}")


@needs_objdump
def test_dot_product_kernel(funcs):
    """The bf16 products on AVX512_BF16's dot products (simd/flash.inc
    with FLASH_DP), built whatever the CPU: the scores' tile and the P.V
    tiles are register tiles of vdpbf16ps, FLASH_MR x FLASH_NV (then 4
    and 1 rows of V^T), each taking a pair broadcast from memory
    (vpbroadcastd) and a loaded vector of pairs, into distinct
    accumulators, nothing else and no spill; P is rounded to bf16 pairs
    by vcvtne2ps2bf16 and interleaved by vpermw; no AMX in it."""
    base = "flash_forward_dp_f32_avx512"
    syms = [s for s in funcs
            if s.endswith("_dp_f32_avx512") or ".isra" in s and "_dp_" in s]
    if base not in funcs:
        pytest.skip("built without AVX512_BF16 (compiler)")
    nv, mr = il.mr_of("avx512", "FLASH_NV"), il.mr_of("avx512", "FLASH_MR")
    mnems = {m for s in syms for _a, m, _o in funcs[s]}
    assert {"vdpbf16ps", "vcvtne2ps2bf16", "vpermw"} <= mnems, sorted(syms)
    assert not any(m.startswith(("tdp", "tile", "ldtilecfg"))
                   for m in mnems)
    rows = []
    for sym in syms:
        stack = il.stack_regs(funcs[sym])
        for loop in il.innermost_loops(funcs[sym]):
            if sum(m == "vdpbf16ps" for _a, m, _o in loop) <= 2:
                continue
            bcast, loaded, accs, problems = set(), set(), set(), []
            for addr, m, o in loop:
                ops = il.operands(o)
                vector = m.startswith("v") or "mm" in o
                if vector and any(f"(%{r}" in o for r in stack):
                    problems.append(f"spill {addr:x}: {m} {o}")
                elif m == "vpbroadcastd" and "(" in ops[0]:
                    bcast.add(ops[-1])
                elif m.startswith("vmovdqu") and "(" in ops[0]:
                    loaded.add(ops[-1])
                elif m == "vdpbf16ps":
                    srcs = ops[:2]
                    if not (any(x in bcast for x in srcs) and any(
                            x in loaded or "(" in x for x in srcs)):
                        problems.append(f"operands {addr:x}: {m} {o}")
                    if not ops[-1].startswith("%zmm"):
                        problems.append(f"not zmm {addr:x}: {m} {o}")
                    accs.add(ops[-1])
                elif vector:
                    problems.append(f"other {addr:x}: {m} {o}")
            r = len(accs) // nv
            rows.append(r)
            listing = "\n".join(f"  {a:x}: {m} {o}" for a, m, o in loop)
            assert not problems and len(accs) == r * nv, (
                f"{sym}:\n  " + "\n  ".join(problems) + "\n" + listing)
    # the scores' tile and the first P.V tile (flash_pv inlined or not)
    assert rows.count(mr) >= 2, f"not two {mr} x {nv} tiles: {rows}"


@needs_objdump
def test_gemm_dot_product_tiles(funcs):
    """The backward's products on AVX512_BF16 (simd/gemm_dp.inc's
    dp_tile): a k-loop of 2 MR vdpbf16ps into 2 MR distinct accumulators
    (the whole tile) and one of 2 MR_SMALL (a short micro-panel's rows),
    each on zmm, nothing on the stack."""
    sym = "dp_tile_f32_avx512"
    if sym not in funcs:
        pytest.skip("built without AVX512_BF16 (compiler)")
    stack = il.stack_regs(funcs[sym])
    rows = []
    for loop in il.innermost_loops(funcs[sym]):
        dots = [il.operands(o) for _a, m, o in loop if m == "vdpbf16ps"]
        if len(dots) <= 2:
            continue
        accs = {ops[-1] for ops in dots}
        listing = "\n".join(f"  {a:x}: {m} {o}" for a, m, o in loop)
        assert len(accs) == len(dots), listing
        assert all(a.startswith("%zmm") for a in accs), listing
        assert not any(f"(%{r}" in o for _a, _m, o in loop for r in stack), (
            "a spill:\n" + listing)
        rows.append(len(dots) // 2)
    mr, small = il.mr_of("avx512"), il.mr_of("avx512", "MR_SMALL")
    assert sorted(set(rows)) == sorted({mr, small}), rows


@needs_objdump
@pytest.mark.parametrize("isa, dtype", PATHS)
def test_flash_loops(funcs, isa, dtype):
    """The fused forward's products (simd/flash.inc): the scores' tile,
    FLASH_MR keys x FLASH_NV vectors, and the P.V tiles (FLASH_MR rows of
    V^T, then 4, then 1, each x FLASH_NV), are register tiles as the
    micro-kernel's are: broadcasts, loaded vectors, FMAs, no spill."""
    nv = il.mr_of(isa, "FLASH_NV", dtype=dtype)
    mr = il.mr_of(isa, "FLASH_MR", dtype=dtype)
    loops = il.flash_loops(funcs, isa, dtype)
    rows = []
    for sym, loop in loops:
        fmas = sum(il.is_fma(i[1]) for i in loop)
        accs = {il.operands(o)[-1] for _a, m, o in loop if il.is_fma(m)}
        r = len(accs) // nv              # this tile's rows
        rows.append(r)
        problems = il.check_kernel_loop(loop, isa, dtype, r,
                                        il.stack_regs(funcs[sym]), nv)
        listing = "\n".join(f"  {a:x}: {m} {o}" for a, m, o in loop)
        assert not problems and fmas % (nv * r) == 0, (
            f"{sym}, loop at {loop[0][0]:x}:\n  " + "\n  ".join(problems)
            + "\n" + listing)
    # the scores' tile and the first P.V tile (flash_pv inlined or not)
    assert rows.count(mr) >= 2, (
        f"not two {mr} x {nv} tiles in flash_forward_{dtype}_{isa} "
        f"(and flash_pv): rows {sorted(rows)}")


@needs_objdump
@pytest.mark.parametrize("isa, dtype", PATHS)
def test_row_loops_found(funcs, isa, dtype):
    """.ci/mca's other loops: exp_shift_row and max_row, vectorised."""
    loops = dict(il.row_loops(funcs, isa, dtype))
    for base, kind in il.ROW_FUNCS.items():
        sym = f"{base}_{dtype}_{isa}"
        assert sym in loops, f"no {kind} loop on {il.ISAS[isa]} in {sym}"


@needs_objdump
def test_philox_rounds_on_avx512(funcs):
    """Dropout's Philox4x32-10 on AVX-512 (simd/dropout.inc): per round
    and group, two 32 x 32 -> 64-bit multiplies a word pair (vpmuludq),
    the high and low words put in place by merge-masked vpshufd (no
    blend, no 64-bit shift left) and each three-way xor one vpternlogd:
    as many shuffles as multiplies, half as many ternary xors.  (The keep
    bytes do not depend on the dtype: the float64 table's keep_row is the
    same code, which the linker may fold into a jump here.)"""
    sym = "keep_row_f32_avx512"
    if sym not in funcs:
        pytest.skip(f"no {sym} in the build")
    count = {}
    for _a, m, _o in funcs[sym]:
        count[m] = count.get(m, 0) + 1
    muls = count.get("vpmuludq", 0)
    assert muls >= 40, count                     # 10 rounds x 4 (a group)
    assert count.get("vpshufd", 0) >= muls, count
    assert 2 * count.get("vpternlogd", 0) >= muls, count
    assert not count.get("vpblendmd") and not count.get("vpsllq"), count


# ---- the checker itself, on loops written here ---------------------------

def _loop(text):
    """[(address, mnemonic, operands)] of AT&T lines."""
    out = []
    for n, line in enumerate(text.strip().splitlines()):
        mnem, _, ops = line.strip().partition(" ")
        out.append((0x100 + 4 * n, mnem, ops.strip()))
    return out


def _tile(mr, spill=None, extra=None, embedded=False):
    src = il.tile_source(mr, 2, "zmm", "f32", embedded)
    lines = [ln.replace("\t", " ", 1).replace("\t", " ").strip()
             for ln in src.splitlines()[1:-1]]       # without 1: and jne
    if spill:
        lines.insert(len(lines) // 2, spill)
    if extra:
        lines.insert(3, extra)
    lines.append(f"jne {0x100:x} <k>")
    return _loop("\n".join(lines))


@pytest.mark.parametrize("embedded", [False, True])
def test_checker_accepts_a_register_tile(embedded):
    assert il.check_kernel_loop(_tile(12, embedded=embedded), "avx512",
                                "f32", 12) == []


@pytest.mark.parametrize("bad, what", [
    ("vmovups %zmm7,0x40(%rsp)", "vector spill"),
    ("vmovups 0x80(%rbp),%zmm7", "vector spill"),
    ("mov %rax,0x8(%rsp)", "store to the stack"),
    ("vaddps %zmm3,%zmm4,%zmm4", "other than FMA"),
])
def test_checker_rejects(bad, what):
    problems = il.check_kernel_loop(_tile(12, spill=bad), "avx512", "f32",
                                    12)
    assert any(what in p for p in problems), problems


def test_checker_rejects_wrong_counts():
    # a tile of 8 rows where 12 are expected; a ymm tile on the zmm path
    assert any("multiple of 2 MR" in p for p in il.check_kernel_loop(
        _tile(8), "avx512", "f32", 12))
    ymm = il.tile_source(6, 2, "ymm", "f32")
    lines = [ln.strip().replace("\t", " ") for ln in ymm.splitlines()[1:-1]]
    problems = il.check_kernel_loop(_loop("\n".join(lines)), "avx512",
                                    "f32", 6)
    assert any("not a zmm ps FMA" in p for p in problems), problems


def test_checker_stack_registers():
    """%rbp is the stack only in a function that makes it its frame
    pointer; otherwise GCC may hold a row pointer in it."""
    loop = _tile(12, spill="vbroadcastss (%rbp,%rax,4),%zmm31")
    assert any("vector spill" in p for p in il.check_kernel_loop(
        loop, "avx512", "f32", 12))
    assert not any("spill" in p for p in il.check_kernel_loop(
        loop, "avx512", "f32", 12, stack=("rsp",)))
    assert il.stack_regs(_loop("push %rbp\nmov %rsp,%rbp")) == ("rsp",
                                                                "rbp")
    assert il.stack_regs(_loop("push %rbp\nmov %rdi,%rbp")) == ("rsp",)


def test_checker_rejects_two_stack_loads():
    loop = _tile(12, spill="cmp %rax,-0x60(%rsp)")
    assert il.check_kernel_loop(loop, "avx512", "f32", 12) == []
    loop = _tile(12, spill="cmp %rax,-0x60(%rsp)",
                 extra="mov -0x58(%rsp),%r15")
    assert any("scalar stack" in p
               for p in il.check_kernel_loop(loop, "avx512", "f32", 12))


def test_loops_and_exits():
    """A backward jump to a shared exit is no loop; nested loops give the
    inner one."""
    insns = _loop("""
        add $0x1,%rax
        cmp %rax,%rdx
        jne 10c <f>
        ret
        vzeroupper
        jmp 110 <f>
    """)
    # 0x100 add, 0x104 cmp, 0x108 jne 10c (forward), 0x10c ret,
    # 0x110 vzeroupper, 0x114 jmp 110: a loop of itself
    assert il.innermost_loops(insns) == [insns[4:6]]
    exit_jump = _loop("""
        ret
        add $0x1,%rax
        jmp 100 <f>
    """)
    assert il.innermost_loops(exit_jump) == []
    nested = _loop("""
        add $0x1,%rax
        add $0x1,%rcx
        cmp %rcx,%rdx
        jne 104 <f>
        cmp %rax,%rsi
        jne 100 <f>
    """)
    assert il.innermost_loops(nested) == [nested[1:4]]


# ---- llvm-mca's report (.ci/mca) -----------------------------------------

# the parts of an llvm-mca 19 report on the 12 x 2 zmm tile that
# parse_mca reads (-mcpu=cascadelake, 200 iterations)
MCA_REPORT = """\
Iterations:        200
Instructions:      8400
Total Cycles:      2613
Total uOps:        11200

Dispatch Width:    6
uOps Per Cycle:    4.29
IPC:               3.21
Block RThroughput: 12.0

Resources:
[0]   - SKXDivider
[1]   - SKXFPDivider
[2]   - SKXPort0
[3]   - SKXPort1
[4]   - SKXPort2
[5]   - SKXPort3
[6]   - SKXPort4
[7]   - SKXPort5
[8]   - SKXPort6
[9]   - SKXPort7


Resource pressure per iteration:
[0]    [1]    [2]    [3]    [4]    [5]    [6]    [7]    [8]    [9]
 -      -     12.69  12.64  7.00   7.00    -     12.70  3.99    -
"""


def test_parse_mca():
    rep = il.parse_mca(MCA_REPORT)
    assert rep["iterations"] == 200 and rep["cycles"] == 2613
    assert rep["block_rthroughput"] == 12.0
    assert rep["pressure"]["SKXPort2"] == 7.0
    assert rep["pressure"]["SKXDivider"] == 0.0
    cpi, share, neck = il.mca_row(MCA_REPORT, 24)
    assert cpi == pytest.approx(13.065)
    assert share == pytest.approx(24 / (2 * 13.065))
    assert neck == "SKXPort5 12.70"
    with pytest.raises(ValueError):
        il.parse_mca("Iterations: 100\n")


LLVM_MCA = il.find_llvm_mca()


@pytest.mark.skipif(LLVM_MCA is None, reason="llvm-mca is not installed")
def test_mca_on_a_tile():
    """llvm-mca on the ymm 6 x 2 tile (the AVX2 path's), read by
    mca_row: FMA-bound under every model, so its cycles per iteration
    are its 12 FMAs over the model's own FMA peak (2 a cycle, or 1 where
    a model has a single ymm FMA pipe, as llvm-mca 14's znver3)."""
    src = il.tile_source(6, 2, "ymm", "f32")
    ran = 0
    for cpu in ("haswell", "skylake", "cascadelake", "znver3"):
        rep = il.run_mca(LLVM_MCA, cpu, src)
        if rep is None:
            continue
        cpi, share, neck = il.mca_row(rep, 12)
        peak = il.model_peak(LLVM_MCA, cpu, "ymm")
        assert cpi == pytest.approx(12 / peak, rel=0.05), (cpu, cpi, peak)
        assert share == pytest.approx(12 / (2 * cpi))
        assert float(neck.split()[-1]) == pytest.approx(12 / peak, rel=0.05)
        ran += 1
    assert ran, f"{LLVM_MCA} knows none of haswell, skylake, znver3"


WIDEN = {"bf16": ("vpmovzxwd", "vpslld"), "f16": ("vcvtph2ps",),
         "q8": ("vpmovsxbd", "vcvtdq2ps", "vmulps")}


@needs_objdump
@pytest.mark.parametrize("fmt", sorted(WIDEN))
@pytest.mark.parametrize("isa", il.ISAS)
def test_half_cache_widens_in_registers(funcs, isa, fmt):
    """Decoding's 16-bit and int8 primitives (simd/decode.inc per
    format) widen each vector of keys or values in registers (a zero
    extension and a shift for bfloat16, the conversion instruction for
    float16; for int8 a sign extension, a conversion and the product by
    the group's scale) and feed the path's FMAs, with no call out of the
    loop (core/half.h's scalar widening serves the columns past the last
    vector, inlined)."""
    reg = "zmm" if isa == "avx512" else "ymm"
    for base in ("dot_keys_multi", "sum_values_multi"):
        sym = f"{base}_{fmt}_f32_{isa}"
        assert sym in funcs, f"no {sym} in {_core.__file__}"
        insns = funcs[sym]
        mnems = [m for _a, m, _o in insns]
        for m in WIDEN[fmt]:
            assert m in mnems, f"no {m} in {sym}"
        assert any(m == "vfmadd231ps" and reg in o for _a, m, o in insns), \
            f"no {reg} FMA in {sym}"
        assert not [o for _a, m, o in insns if m == "call"], \
            f"{sym} calls out"


# the reduction tree of decoding's blocks of dot products (avx512.c's
# reduce4x4_ps, avx2.c's reduce4x2_ps): its whole-lane shuffles
TREE = {"avx512": "vshuff32x4", "avx2": "vperm2f128"}


@needs_objdump
@pytest.mark.parametrize("fmt", ["", "_bf16", "_f16", "_q8"])
@pytest.mark.parametrize("isa", il.ISAS)
def test_decode_scores_reduced_in_blocks(funcs, isa, fmt):
    """dot_keys_multi reduces its blocks of queries and keys in one tree
    (the test of tests/kernels/test_cache_attention.py proves its bits):
    the shuffles of 128-bit lanes that only the tree uses are there."""
    sym = f"dot_keys_multi{fmt}_f32_{isa}"
    assert sym in funcs, f"no {sym} in {_core.__file__}"
    mnems = {m for _a, m, _o in funcs[sym]}
    assert TREE[isa] in mnems, f"no {TREE[isa]} in {sym}"
