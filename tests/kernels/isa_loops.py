"""The inner loops of the built extension's x86 SIMD kernels, read from its
disassembly: what tests/kernels/test_instruction_mix.py checks and what
.ci/mca hands to llvm-mca.  Standard library only; x86-64 ELF, GNU
objdump (AT&T syntax).

As a script (from the repo root; SO: attention_c/_core*.so)::

    python tests/kernels/isa_loops.py list SO       # the loops, checked
    python tests/kernels/isa_loops.py asm SO kernel|row ISA DTYPE [NAME]
    python tests/kernels/isa_loops.py mca SO [--shapes]   # .ci/mca's report

The register-tiled micro-kernel (csrc/simd/tile.inc, TILE_ACCUMULATE) is
compiled into micro_kernel_rows / micro_kernel_packed (simd/tile.inc) and
tile_rows / tile_packed (simd/gemm.inc), FSFX-suffixed (name_f32_avx512,
...); where the path sets GEMM_MR_WIDE, a micro-panel against two B panels
also runs as tiles of GEMM_MR_WIDE rows x 4 vectors (tile_rows_wide,
tile_packed_wide).  GCC may inline the static ones into their caller
(gemm_tile, gemm_macro) or
clone them (.isra.0, .constprop.0), so a kernel loop is found as an
innermost loop (a backward branch with no other inside its span) holding
more than two FMAs in one of those symbols: the one-row kernel
(micro_kernel_row, inlined into gemm_macro) has two per k.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# path -> its vector register; dtype -> FMA suffix, broadcast, bytes;
# (path, dtype) -> lanes
ISAS = {"avx2": "ymm", "avx512": "zmm"}
DTYPES = {"f32": ("ps", "vbroadcastss", 4), "f64": ("pd", "vbroadcastsd", 8)}
LANES = {("avx2", "f32"): 8, ("avx2", "f64"): 4,
         ("avx512", "f32"): 16, ("avx512", "f64"): 8}
# the functions that hold the micro-kernel's k-loop, inlined or not
KERNEL_FUNCS = ("micro_kernel_rows", "micro_kernel_packed", "tile_rows",
                "tile_packed", "tile_rows_wide", "tile_packed_wide",
                "gemm_tile", "gemm_macro", "micro_kernel_small")
# the streamed forward's other hot loops (simd/ops.inc), each found as
# the loop with the most instructions of its kind on the path's vectors
# (exp's polynomial FMAs; the max), not the masking or the tail
ROW_FUNCS = {"exp_shift_row": "vfmadd", "max_row": "vmaxp"}

_FUNC = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
_TARGET = re.compile(r"^([0-9a-f]+) <")
_VREG = re.compile(r"%[xyz]mm\d+")
_MEM = re.compile(r"(?:[-\w]*)\((%\w+)?(?:,%\w+)?(?:,\d)?\)(\{1to\d+\})?")


def mr_of(isa, name="MR", default=None, dtype="f32"):
    """MR of the path's micro-tile, from its source (#define MR n); or
    another of its defines (FLASH_MR, FLASH_NV: the fused forward's
    tile, simd/flash.inc; MR_SMALL, the short micro-panels' tile): the
    first (float's), or for dtype "f64" the second where it has two;
    default when it has none."""
    text = (ROOT / "csrc" / "simd" / f"{isa}.c").read_text()
    found = re.findall(rf"^#define {name} (\d+)$", text, re.M)
    if not found and default is not None:
        return default
    return int(found[1 if dtype == "f64" and len(found) > 1 else 0])


def loop_nv(isa, loop):
    """The vectors of B a k-loop of the micro-kernel takes a step: 4 in
    the wide tile, where the path sets GEMM_MR_WIDE and the loop loads a
    vector for every GEMM_MR_WIDE FMAs; else 2."""
    wide = mr_of(isa, "GEMM_MR_WIDE", 0)
    fmas = sum(is_fma(i[1]) for i in loop)
    loads = sum(bool(re.fullmatch(r"vmov[au]p[sd]", m)) and "(" in o
                for _, m, o in loop)
    return 4 if wide and loads * wide == fmas else 2


def loop_rows(isa, loop):
    """The rows a k-loop of the micro-kernel is checked against: MR;
    MR_SMALL where the path has that tile (simd/gemm.inc) and the loop
    holds 2 MR_SMALL FMAs; GEMM_MR_WIDE in the wide tile (loop_nv)."""
    if loop_nv(isa, loop) == 4:
        return mr_of(isa, "GEMM_MR_WIDE")
    small = mr_of(isa, "MR_SMALL", 0)
    fmas = sum(is_fma(i[1]) for i in loop)
    return small if small and fmas == 2 * small else mr_of(isa)


def disassemble(so):
    """{symbol: [(address, mnemonic, operands), ...]} of the text of so."""
    out = subprocess.run(["objdump", "-d", "-w", "--no-show-raw-insn", so],
                         check=True, capture_output=True, text=True).stdout
    funcs, cur = {}, None
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            mnem, ops = m.group(2), m.group(3)
            if mnem in ("bnd", "notrack", "rep", "repz", "lock", "data16",
                        "cs", "ds") and ops:
                mnem, _, ops = ops.partition(" ")
            cur.append((int(m.group(1), 16), mnem, ops.split("#")[0]
                        .strip()))
    return funcs


def symbols(funcs, base, isa, dtype):
    """The symbols of base_dtype_isa, its clones (.isra.0 ...) included."""
    name = f"{base}_{dtype}_{isa}"
    return sorted(s for s in funcs if s == name or s.startswith(name + "."))


def _cycles(insns, lo, hi):
    """Whether control from lo reaches the branch at hi without leaving
    [lo, hi]: a loop, not a jump back to a shared exit."""
    body = [i for i in insns if lo <= i[0] <= hi]
    index = {addr: n for n, (addr, _m, _o) in enumerate(body)}
    seen, todo = set(), [0]
    while todo:
        n = todo.pop()
        if n in seen or n >= len(body):
            continue
        seen.add(n)
        addr, mnem, ops = body[n]
        if addr == hi:
            return True
        m = _TARGET.match(ops)
        if mnem.startswith("j") and m and int(m.group(1), 16) in index:
            todo.append(index[int(m.group(1), 16)])
        if not (mnem.startswith(("jmp", "ret", "ud2")) or mnem == "hlt"):
            todo.append(n + 1)
    return False


def innermost_loops(insns):
    """The innermost loops of a function: the instructions from a backward
    branch's target to the branch, for each backward branch whose span
    holds no other backward branch's span."""
    spans = []
    for addr, mnem, ops in insns:
        m = _TARGET.match(ops)
        if mnem.startswith("j") and m:
            target = int(m.group(1), 16)
            if (insns[0][0] <= target <= addr
                    and _cycles(insns, target, addr)):
                spans.append((target, addr))
    inner = [s for s in spans
             if not any(o != s and s[0] <= o[0] and o[1] <= s[1]
                        for o in spans)]
    return [[i for i in insns if lo <= i[0] <= hi]
            for lo, hi in sorted(set(inner))]


def is_fma(mnem):
    return re.fullmatch(r"vf(?:n?m)(?:add|sub)\d{3}[ps][sd]", mnem) is not None


def kernel_loops(funcs, isa, dtype):
    """[(symbol, loop)] of the micro-kernel's k-loops of a path and dtype:
    the innermost loops with more than two FMAs in KERNEL_FUNCS."""
    found = []
    for base in KERNEL_FUNCS:
        for sym in symbols(funcs, base, isa, dtype):
            for loop in innermost_loops(funcs[sym]):
                if sum(is_fma(i[1]) for i in loop) > 2:
                    found.append((sym, loop))
    return found


def flash_loops(funcs, isa, dtype):
    """[(symbol, loop)]: the fused forward's product loops (simd/
    flash.inc), the innermost loops with more than two FMAs: the scores'
    tile (in flash_forward, flash_tile inlined or not) and the P.V tiles
    of flash_pv (FLASH_MR rows, then FLASH_MRV, then 1)."""
    found = []
    for base in ("flash_forward", "flash_tile", "flash_pv"):
        for sym in symbols(funcs, base, isa, dtype):
            for loop in innermost_loops(funcs[sym]):
                if sum(is_fma(i[1]) for i in loop) > 2:
                    found.append((sym, loop))
    return found


def row_loops(funcs, isa, dtype):
    """[(symbol, loop)]: the vector loop of each of ROW_FUNCS (the
    innermost loop with the most of its instructions on the path's
    vectors; none if no loop has one)."""
    found, reg = [], f"%{ISAS[isa]}"
    for base, kind in ROW_FUNCS.items():
        for sym in symbols(funcs, base, isa, dtype):
            scored = [(sum(m.startswith(kind) and reg in o
                           for _a, m, o in lp), lp)
                      for lp in innermost_loops(funcs[sym])]
            best = max(scored, key=lambda x: x[0], default=(0, None))
            if best[0]:
                found.append((sym, best[1]))
    return found


def row_vectors(loop, reg):
    """Vectors of a row one iteration of a row loop handles: its vector
    loads or its vector stores of the row (memory operands that are not
    constants), whichever are more; at least 1."""
    loads = stores = 0
    for _a, mnem, ops in loop:
        args = operands(ops)
        if not any(reg in a for a in args) or mnem.startswith("vbroadcast"):
            continue
        mem = [i for i, a in enumerate(args)
               if "(" in a and "(%rip)" not in a]
        if mem and mem[-1] == len(args) - 1 and mnem.startswith("vmov"):
            stores += 1            # AT&T: the destination is last
        elif mem:
            loads += 1
    return max(loads, stores, 1)


def operands(ops):
    """AT&T operands split at the top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in ops:
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def stack_regs(insns):
    """The registers that address the stack frame in a function: %rsp,
    and %rbp when the function makes it its frame pointer (otherwise
    GCC may use it as any other register)."""
    frame = any(m.startswith("mov") and o == "%rsp,%rbp"
                for _a, m, o in insns)
    return ("rsp", "rbp") if frame else ("rsp",)


def check_kernel_loop(loop, isa, dtype, mr, stack=("rsp", "rbp"), nv=2):
    """The problems of one k-loop of the micro-kernel, [] if none: it must
    hold k steps of nv MR FMAs (nv = 2 but in the fused forward's tiles)
    on the path's full vectors, each with a
    broadcast operand (a vbroadcast load in the loop, or an embedded
    {1toN} memory broadcast) and the other a B vector loaded in the loop,
    into 2 MR distinct accumulator registers; no other vector
    instruction; nothing on the stack (no spill or reload; stack: the
    registers that address it, see stack_regs) but at most one scalar
    load per loop (a loop bound: GCC keeps K there when the 12 row
    pointers of micro_kernel_rows take the registers)."""
    reg = ISAS[isa]
    sfx, bcast, _ = DTYPES[dtype]
    on_stack = re.compile(r"\(%(?:" + "|".join(stack) + r")[,)]")
    problems = []
    fmas = [i for i in loop if is_fma(i[1])]
    steps, rest = divmod(len(fmas), nv * mr)
    if rest or not steps:
        problems.append(f"{len(fmas)} FMAs, not a multiple of {nv} MR = "
                        f"{nv * mr}")
        steps = max(steps, 1)
    # the A elements broadcast (a broadcast load, or the operand of
    # embedded broadcasts), B vector loads, the FMAs' destinations
    broadcast_regs, loaded_regs, elements, n_load, accs = (set(), set(),
                                                           set(), 0, [])
    stack_scalar = 0
    for addr, mnem, ops in loop:
        ops_l = operands(ops)
        where = f"{addr:x}: {mnem} {ops}"
        vector = bool(_VREG.search(ops)) or mnem.startswith("v")
        if on_stack.search(ops):
            if vector:
                problems.append(f"vector spill or reload: {where}")
                continue
            if ops_l and on_stack.search(ops_l[-1]) and not mnem.startswith(
                    ("cmp", "test")):
                problems.append(f"store to the stack: {where}")
                continue
            stack_scalar += 1
        if not vector:
            continue
        if mnem == bcast and _MEM.search(ops_l[0]):
            broadcast_regs.add(ops_l[-1])
            elements.add(f"load at {addr:x}")
        elif re.fullmatch(r"vmov[au]p[sd]|vmovdq[au](?:64|32)?", mnem) \
                and "(" in ops_l[0] and ops_l[-1].startswith("%"):
            loaded_regs.add(ops_l[-1])
            n_load += 1
        elif is_fma(mnem):
            if not mnem.endswith(sfx) or not ops_l[-1].startswith(f"%{reg}"):
                problems.append(f"not a {reg} {sfx} FMA: {where}")
            srcs = ops_l[:2]
            has_b = sum(s in broadcast_regs or s.endswith(
                f"{{1to{LANES[isa, dtype]}}}") for s in srcs)
            if has_b != 1:
                problems.append(f"no broadcast operand: {where}")
            elif not any(s in loaded_regs or ("(" in s and "{" not in s)
                         for s in srcs):
                problems.append(f"B not a loaded vector: {where}")
            elements.update(s.split("{")[0] for s in srcs if "{1to" in s)
            accs.append(ops_l[-1])
        else:
            problems.append(f"vector instruction other than FMA, broadcast "
                            f"or B load: {where}")
    if len(elements) != mr * steps:
        problems.append(f"{len(elements)} elements of A broadcast for "
                        f"{steps} k step(s), MR = {mr}")
    if n_load > nv * steps:
        problems.append(f"{n_load} vector loads for {steps} k step(s): "
                        f"B takes {nv} a step")
    if len(set(accs)) != nv * mr:
        problems.append(f"{len(set(accs))} accumulator registers, "
                        f"not {nv} MR = {nv * mr}")
    if stack_scalar > 1:
        problems.append(f"{stack_scalar} scalar stack operands (spills)")
    return problems


def mca_source(loop):
    """The loop as assembly llvm-mca reads (AT&T): the backward branch to
    a label at its top, the other branch targets dropped (none in a
    kernel loop)."""
    lines = ["1:"]
    for _addr, mnem, ops in loop:
        if mnem.startswith("j"):
            if loop[-1][1] == mnem and ops == loop[-1][2]:
                lines.append(f"\t{mnem}\t1b")
            continue
        lines.append(f"\t{mnem}\t{ops}" if ops else f"\t{mnem}")
    return "\n".join(lines) + "\n"


# ---- llvm-mca's report -------------------------------------------------

def parse_mca(text):
    """{iterations, cycles, block_rthroughput, pressure} of one llvm-mca
    report (default views): pressure is {resource: cycles per
    iteration} of its 'Resource pressure per iteration' table."""
    def num(label):
        m = re.search(rf"^{label}:\s+([\d.]+)", text, re.M)
        if not m:
            raise ValueError(f"llvm-mca report without {label!r}")
        return float(m.group(1))
    out = {"iterations": int(num("Iterations")),
           "cycles": int(num("Total Cycles")),
           "block_rthroughput": num("Block RThroughput")}
    names = dict(re.findall(r"^\[(\d+(?:\.\d+)?)\]\s+-\s+(\S+)", text, re.M))
    m = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", text)
    if not m:
        raise ValueError("llvm-mca report without resource pressure")
    cols = re.findall(r"\[(\d+(?:\.\d+)?)\]", m.group(1))
    vals = m.group(2).split()
    if len(cols) != len(vals):
        raise ValueError("resource pressure columns do not match")
    out["pressure"] = {names.get(c, c): (0.0 if v == "-" else float(v))
                       for c, v in zip(cols, vals)}
    return out


def mca_row(text, fmas_per_iter, peak_per_cycle=2):
    """(cycles per iteration, share of the FMA peak, bottleneck) from one
    llvm-mca report of a loop with fmas_per_iter FMAs: the peak is
    peak_per_cycle FMAs per cycle; the bottleneck is the resource with
    the most cycles per iteration (ties: the first)."""
    rep = parse_mca(text)
    cpi = rep["cycles"] / rep["iterations"]
    share = fmas_per_iter / (peak_per_cycle * cpi) if fmas_per_iter else 0.0
    res, busy = max(rep["pressure"].items(), key=lambda kv: kv[1])
    return cpi, share, f"{res} {busy:.2f}"


# ---- the report of .ci/mca -------------------------------------------

# llvm-mca's CPUs: the AVX-512 loops run on the first five, the AVX2 ones
# on all.
MCA_CPUS = ("cascadelake", "icelake-server", "sapphirerapids", "znver4",
            "znver5", "znver3")
AVX512_CPUS = MCA_CPUS[:5]


_KNOWN = {}


def find_llvm_mca():
    """$LLVM_MCA, else the newest llvm-mca-NN on PATH, else llvm-mca;
    None if there is none."""
    if os.environ.get("LLVM_MCA"):
        return os.environ["LLVM_MCA"]
    found = {}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for path in Path(folder or ".").glob("llvm-mca*"):
            m = re.fullmatch(r"llvm-mca(?:-(\d+))?", path.name)
            if m and os.access(path, os.X_OK):
                found.setdefault(int(m.group(1) or 0), str(path))
    return found[max(found)] if found else None


def known_cpus(llvm_mca):
    """The -mcpu names this llvm-mca knows."""
    if llvm_mca not in _KNOWN:
        res = subprocess.run([llvm_mca, "-mcpu=help"], capture_output=True,
                             text=True)
        _KNOWN[llvm_mca] = set(re.findall(r"^\s+([\w-]+)\s+- Select",
                                          res.stdout + res.stderr, re.M))
    return _KNOWN[llvm_mca]


def run_mca(llvm_mca, cpu, source, iterations=200):
    """llvm-mca's report of an assembly text on a CPU; None if this
    llvm-mca does not know the CPU."""
    if cpu not in known_cpus(llvm_mca):
        return None
    res = subprocess.run([llvm_mca, f"-mcpu={cpu}",
                          f"-iterations={iterations}"], input=source,
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"llvm-mca -mcpu={cpu}: {res.stderr.strip()}")
    return res.stdout


def fma_peak_source(width, n=24):
    """n independent FMAs on registers: the model's FMA peak."""
    regs = 16 if width == "ymm" else 32
    body = [f"\tvfmadd231ps\t%{width}0,%{width}1,%{width}{2 + i % (regs - 2)}"
            for i in range(n)]
    return "1:\n" + "\n".join(body) + "\n\tdec\t%rax\n\tjne\t1b\n"


def tile_source(mr, nv, width, dtype, embedded=False):
    """One k step of an mr x nv-vector register tile as GCC writes
    TILE_ACCUMULATE: nv B loads, then per row a broadcast load and nv
    FMAs (embedded: each FMA takes the {1toN} memory broadcast itself,
    AVX-512 only)."""
    sfx, bcast, size = DTYPES[dtype]
    regs = 16 if width == "ymm" else 32
    if mr * nv + nv + (0 if embedded else 1) > regs:
        raise ValueError(f"{mr}x{nv} does not fit in {regs} registers")
    lanes = (32 if width == "ymm" else 64) // size
    vbytes = lanes * size
    body = [f"\tvmovup{sfx[1]}\t{vbytes * v}(%rcx),%{width}{v}"
            for v in range(nv)]
    acc = nv + (0 if embedded else 1)
    for r in range(mr):
        src = (f"{size * r}(%rax){{1to{lanes}}}" if embedded
               else f"%{width}{nv}")
        if not embedded:
            body.append(f"\t{bcast}\t{size * r}(%rax),%{width}{nv}")
        for v in range(nv):
            body.append(f"\tvfmadd231{sfx}\t{src},%{width}{v},"
                        f"%{width}{acc + r * nv + v}")
    body += [f"\tadd\t${vbytes * nv},%rcx", f"\tadd\t${size * mr},%rax",
             "\tcmp\t%rcx,%rdx", "\tjne\t1b"]
    return "1:\n" + "\n".join(body) + "\n"


def model_peak(llvm_mca, cpu, width):
    """FMAs per cycle of independent FMAs under llvm-mca's model of cpu."""
    rep = run_mca(llvm_mca, cpu, fma_peak_source(width))
    return None if rep is None else 24 / (parse_mca(rep)["cycles"] / 200)


def mca_report(so, llvm_mca, shapes=False, out=sys.stdout):
    """The tables of .ci/mca: for each path, dtype and CPU llvm-mca knows,
    the slowest of the build's micro-kernel loops (share of 2 FMAs a
    cycle, and of the model's own FMA peak) and the streamed forward's
    row loops; with shapes, other tile shapes written as GCC writes the
    current one (f32)."""
    funcs = disassemble(so)
    peaks = {}

    def peak(cpu, width):
        if (cpu, width) not in peaks:
            peaks[cpu, width] = model_peak(llvm_mca, cpu, width)
        return peaks[cpu, width]

    def cpus_of(isa):
        return [c for c in (AVX512_CPUS if isa == "avx512" else MCA_CPUS)
                if c in known_cpus(llvm_mca)]

    def fma_cols(cpu, width, fmas, rep):
        cpi, share, neck = mca_row(rep, fmas)
        return (f"{cpi:7.2f} {fmas / cpi:7.2f} {share:5.0%} "
                f"{fmas / cpi / peak(cpu, width):6.0%}  {neck}")

    missing = [c for c in MCA_CPUS if c not in known_cpus(llvm_mca)]
    if missing:
        print(f"not known to {llvm_mca}: {' '.join(missing)}", file=out)
    head = f"{'cyc/it':>7} {'FMA/cyc':>7} {'of 2':>5} {'model':>6}  bottleneck"
    print(f"{'micro-kernel k-loop (slowest)':<34} {'cpu':<15} {head}",
          file=out)
    for isa in ("avx512", "avx2"):
        for dtype in DTYPES:
            loops = kernel_loops(funcs, isa, dtype)
            if not loops:
                raise SystemExit(f"no micro-kernel loop for {isa} {dtype}")
            for cpu in cpus_of(isa):
                worst = None
                for sym, loop in loops:
                    rep = run_mca(llvm_mca, cpu, mca_source(loop))
                    cyc = parse_mca(rep)["cycles"]
                    if worst is None or cyc > worst[0]:
                        worst = (cyc, sym, loop, rep)
                _, sym, loop, rep = worst
                fmas = sum(is_fma(i[1]) for i in loop)
                print(f"{sym:<34} {cpu:<15} "
                      f"{fma_cols(cpu, ISAS[isa], fmas, rep)}", file=out)
    print(f"\n{'row loop':<34} {'cpu':<15} {'cyc/it':>7} {'elem/cyc':>8}"
          f"  bottleneck", file=out)
    for isa in ("avx512", "avx2"):
        for dtype in DTYPES:
            for sym, loop in row_loops(funcs, isa, dtype):
                for cpu in cpus_of(isa):
                    rep = run_mca(llvm_mca, cpu, mca_source(loop))
                    cpi, _share, neck = mca_row(rep, 0)
                    elems = LANES[isa, dtype] * row_vectors(loop,
                                                            f"%{ISAS[isa]}")
                    print(f"{sym:<34} {cpu:<15} {cpi:7.2f} "
                          f"{elems / cpi:8.2f}  {neck}", file=out)
    if not shapes:
        return
    print(f"\n{'tile shape, f32 (MR x vectors)':<34} {'cpu':<15} {head}",
          file=out)
    for isa, tiles in (("avx512", [(12, 2, False), (12, 2, True),
                                   (14, 2, False), (8, 3, False),
                                   (6, 4, False), (6, 4, True),
                                   (4, 6, False)]),
                       ("avx2", [(6, 2, False), (4, 3, False),
                                 (5, 2, False)])):
        width = ISAS[isa]
        for mr, nv, emb in tiles:
            name = f"{width} {mr}x{nv}{' {1toN}' if emb else ''}"
            for cpu in cpus_of(isa):
                rep = run_mca(llvm_mca, cpu,
                              tile_source(mr, nv, width, "f32", emb))
                print(f"{name:<34} {cpu:<15} "
                      f"{fma_cols(cpu, width, mr * nv, rep)}", file=out)


def _main(argv):
    cmd = argv[0]
    if cmd == "list":
        funcs = disassemble(argv[1])
        for isa in ISAS:
            for dtype in DTYPES:
                for sym, loop in kernel_loops(funcs, isa, dtype):
                    fmas = sum(is_fma(i[1]) for i in loop)
                    bad = check_kernel_loop(loop, isa, dtype,
                                            loop_rows(isa, loop),
                                            stack_regs(funcs[sym]),
                                            loop_nv(isa, loop))
                    print(f"kernel {sym}+{loop[0][0]:x} {len(loop)} "
                          f"insns {fmas} FMAs: "
                          f"{'; '.join(bad) if bad else 'ok'}")
                for sym, loop in row_loops(funcs, isa, dtype):
                    print(f"row {sym}+{loop[0][0]:x} {len(loop)} insns")
        return 0
    if cmd == "asm":
        funcs = disassemble(argv[1])
        kind, isa, dtype = argv[2:5]
        pick = kernel_loops if kind == "kernel" else row_loops
        loops = [(s, lp) for s, lp in pick(funcs, isa, dtype)
                 if len(argv) < 6 or s.startswith(argv[5])]
        if not loops:
            print(f"no {kind} loop for {isa} {dtype}", file=sys.stderr)
            return 1
        sym, loop = loops[0]
        sys.stdout.write(f"# {sym}\n" + mca_source(loop))
        return 0
    if cmd == "mca":
        llvm_mca = find_llvm_mca()
        if llvm_mca is None:
            print("mca: no llvm-mca on PATH (Debian: apt-get install llvm)")
            return 0
        print(f"mca: {llvm_mca}, {argv[1]}")
        mca_report(argv[1], llvm_mca, shapes="--shapes" in argv[2:])
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
