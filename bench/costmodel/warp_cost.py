"""What one warp of a compiled kernel costs an H100 SM, instruction by instruction.

    cost = warp_cost(listing, loops, trips)   # bench.costmodel.sass's listing and loops; trips(loop): runs
                                              # per entry -> issue slots, unit cycles, global
                                              # bytes, busy cycles, latency of one warp

Measured (the compiler's own): the instructions, their order, operands, control flow and source
lines. Modelled: what each costs. An instruction takes one issue slot of its SM sub-partition
(SMSP) and holds its unit for 128 / (results per clock per SM) cycles (PIPE_RESULTS; tensor
cores by the MMA's shape); its result is ready LATENCY cycles after issue.

`busy`: the cycles a warp holds its SMSP. The short units overlap under the dispatch (issue
slots, ALU, FMA, shuffles, the L1/shared data path: the largest counts); tensor-core and
special-function work add to it, as phases the warp waits for (a warp's matmuls and
exponentials do not overlap unless it is scheduled for it: Shah et al. 2024, FlashAttention-3).
`latency`: one warp alone, issuing in order, each instruction waiting for its source registers
and its unit (async copies and warpgroup MMAs wait at their barriers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .sass import Instruction, Listing, Loop, basic_blocks, reachable

CLOCK_HZ = 1.83e9  # H100 SXM5: the clock of NVIDIA's 989 TFLOP/s dense bf16 (132 SMs x 4096 FLOP/clk)
SMSPS = 4  # sub-partitions per SM, each issuing one warp instruction per clock

# Results per clock per SM (CUDA C++ Programming Guide, "Arithmetic Instructions", cc 9.0); a warp
# instruction holds its unit 128 / results cycles on one SMSP (32 threads over a quarter of the
# SM's lanes). fp32 multiply-adds: 128; integer multiply-add (IMAD, on the same FMA pipe): 64;
# integer, logic, compare, select, min/max: 64; special functions and conversions: 16;
# shuffles: 32.
PIPE_RESULTS = {"fma": 128, "imad": 64, "alu": 64, "xu": 16, "shfl": 32}
# Dense tensor-core multiply-adds per clock per SMSP: 989 TFLOP/s / (132 x 4 x 2 x 1.83 GHz)
# = 512 for 16-bit operands (half that for tf32, twice for 8-bit). wgmma (HGMMA) runs at that
# rate; mma.sync (HMMA) is modelled at half of it (an assumption: the warp-level MMA Hopper keeps
# from Ampere is reported to reach about half of the wgmma peak).
TENSOR_FMA_PER_CLK = 512
HMMA_RATE = 0.5
# Units whose work overlaps under the dispatch; the others (tensor cores, special functions) add up.
OVERLAPPED = ("fma", "alu", "shfl", "data")
# The L1/shared-memory data path: 128 bytes per clock per SM (32 banks of 4 bytes), a quarter
# of it per SMSP.
DATA_BYTES_PER_CLK = 128 / SMSPS
# Cycles from issue until a result can be read (round figures from microbenchmarks of Hopper:
# Luo et al. 2024, arXiv:2402.13499; Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of
# Bandwidth", 2023). A global load is priced as an L2 hit (~260): what a kernel re-reads sits in
# L2; a first touch of HBM takes longer (~600+), a reuse from L1 less (~35).
LATENCY = {"fma": 4, "imad": 4, "alu": 4, "xu": 16, "shfl": 24, "shared": 30, "global": 260, "tensor": 32,
           "barrier": 20, "other": 4}

_FMA = ("FFMA", "FADD", "FMUL", "FSWZADD", "HFMA2", "HADD2", "HMUL2")
_IMAD = ("IMAD", "IMUL")
_XU = ("MUFU", "F2F.", "F2I", "I2F.", "FRND", "POPC", "FLO", "BREV", "FCHK")
_SHFL = ("SHFL", "REDUX", "MATCH")
_SHARED = ("LDS", "STS", "LDSM", "STSM", "ATOMS")
# Global reductions are RED. / REDG.; REDUX (a warp's reduction into a register) is a shuffle.
_GLOBAL = ("LDG.", "STG", "LDGSTS", "RED.", "REDG", "ATOM", "ATOMG", "LD.", "ST.", "LDL", "STL")
_ISSUE_ONLY = ("BRA", "BAR", "EXIT", "NOP", "U", "S2R", "S2UR", "R2UR", "LDC", "CS2R", "DEPBAR", "LDGDEPBAR",
               "WARPSYNC", "WARPGROUP", "BSSY", "BSYNC", "MEMBAR", "FENCE", "CALL", "RET", "ENDCOLLECTIVE",
               "ERRBAR", "CCTL", "YIELD", "SYNCS", "ELECT", "BMOV", "PMTRIG", "VOTEU")
_NO_DEST = _ISSUE_ONLY + ("STS", "STSM", "STG", "STL", "ST.", "RED.", "REDG", "LDGSTS", "UTMA")
_REGISTER = re.compile(r"(?<![\w.])(U?R\d+|U?P\d)(?:\.64)?(?![\w])")


# ---- pricing one instruction -------------------------------------------------------------------


def unit(ins: Instruction) -> str:
    op = ins.opcode
    if op.startswith(("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "DMMA", "BMMA")):
        return "tensor"
    if op.startswith(_SHARED):
        return "shared"
    if op.startswith(_GLOBAL):
        return "global"
    if op.startswith(_XU):
        return "xu"
    if op.startswith(_SHFL):
        return "shfl"
    if op.startswith(_FMA):
        return "fma"
    if op.startswith(_IMAD):
        return "imad"
    if op.startswith("BAR"):
        return "barrier"
    if op.startswith(_ISSUE_ONLY):
        return "other"
    return "alu"  # integer, logic, compare, select, min/max, moves, conversions to half precision


def access_bytes(ins: Instruction) -> int:
    """Bytes one warp moves with a load or store (32 threads x the access width)."""
    op = ins.opcode
    if op.startswith(("LDSM", "STSM")):
        return 128 * (4 if ".4" in op else 2 if ".2" in op else 1)
    width = 16 if ".128" in op else 8 if ".64" in op else 2 if re.search(r"\.[US]16", op) else \
        1 if re.search(r"\.[US]8", op) else 4
    return 32 * width


def tensor_cycles(ins: Instruction) -> float:
    """Cycles one warp's share of an MMA holds its SMSP's tensor core."""
    op = ins.opcode
    shape = re.search(r"(\d+)x(\d+)x(\d+)", op)
    if shape:  # HGMMA.64xNxK: a warpgroup's MMA, a quarter of it per warp
        m, n, k = (int(s) for s in shape.groups())
        fma, rate = m * n * k / SMSPS, 1.0
    else:  # HMMA.16816: m16 n8 k16
        digits = re.search(r"MMA\.(\d{2})(\d)(\d+)", op)
        m, n, k = (int(s) for s in digits.groups()) if digits else (16, 8, 16)
        fma, rate = m * n * k, HMMA_RATE
    per_clk = TENSOR_FMA_PER_CLK * rate
    if ".TF32" in op:
        per_clk /= 2
    elif re.search(r"\.(S8|U8|E4M3|E5M2)", op):
        per_clk *= 2
    return fma / per_clk


def pipe_cycles(ins: Instruction) -> tuple[str, float]:
    """The unit an instruction holds and for how many cycles of its SMSP."""
    kind = unit(ins)
    if kind in PIPE_RESULTS:
        return "fma" if kind == "imad" else kind, 128 / PIPE_RESULTS[kind]
    if kind == "tensor":
        return kind, tensor_cycles(ins)
    if kind in ("shared", "global"):
        return "data", access_bytes(ins) / DATA_BYTES_PER_CLK
    return "issue", 0.0


def _dest_width(ins: Instruction) -> int:
    op = ins.opcode
    if op.startswith("HGMMA"):
        n = int(re.search(r"\d+x(\d+)x", op).group(1))
        return n // 2 if ".F32" in op else n // 4
    if op.startswith("HMMA"):
        return 4 if ".F32" in op else 2
    if op.startswith("LDSM"):
        return 4 if ".4" in op else 2 if ".2" in op else 1
    if ".128" in op:
        return 4
    if ".64" in op or ".WIDE" in op or op.startswith(("DADD", "DMUL", "DFMA")):
        return 2
    return 1


def registers(ins: Instruction) -> tuple[list[str], list[str]]:
    """(registers written, registers read), predicates and uniform registers included."""
    written: list[str] = []
    operands = ins.operands
    writes = 0 if ins.opcode.startswith(_NO_DEST) else 1
    if ins.opcode.startswith(("ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "UISETP", "UPLOP3", "VOTE")):
        writes = 2 if len(operands) > 1 and re.fullmatch(r"U?P(T|\d)", operands[1]) else 1
    for operand in operands[:writes]:
        found = _REGISTER.search(operand)
        if found:
            name = found.group(1)
            prefix = re.match(r"U?[RP]", name).group(0)
            first = int(name[len(prefix):])
            width = _dest_width(ins) if prefix.endswith("R") and operand is operands[0] else 1
            written += [f"{prefix}{first + i}" for i in range(width)]
    read = []
    for operand in operands[writes:] + ([ins.guard.lstrip("!")] if ins.guard else []):
        for match in _REGISTER.finditer(operand):
            name = match.group(1)
            prefix = re.match(r"U?[RP]", name).group(0)
            first = int(name[len(prefix):])
            width = 2 if match.group(0).endswith(".64") else 1
            read += [f"{prefix}{first + i}" for i in range(width)]
    return written, read


# ---- one warp's cost over a region of code -----------------------------------------------------


@dataclass
class WarpCost:
    """What one warp of a program spends, summed over the trips of every loop."""

    instructions: float = 0.0  # issue slots
    pipes: dict = field(default_factory=dict)  # unit -> cycles it is held on the warp's SMSP
    global_bytes: float = 0.0  # bytes moved by global loads and stores
    latency: float = 0.0  # cycles for the warp alone, issuing in order and waiting for operands

    @property
    def busy(self) -> float:
        """Cycles the warp holds its SMSP: the short units (ALU, FMA, shuffles, the L1/shared
        data path) overlap under the one-instruction-per-clock dispatch, while tensor-core and
        special-function work are phases the warp waits for, one after the other."""
        short = [self.instructions, *(c for p, c in self.pipes.items() if p in OVERLAPPED)]
        return max(short) + sum(c for p, c in self.pipes.items() if p not in OVERLAPPED)


def warp_cost(listing: Listing, loops: list[Loop], trips, global_latency: float | None = None,
              simulate: bool = True) -> WarpCost:
    """One warp's cost of the whole kernel, each loop running trips(loop) times per entry; a
    global load's latency is global_latency cycles (LATENCY["global"], an L2 hit, unless given).
    simulate=False leaves the latency out (0): the counts alone."""
    latency = dict(LATENCY, **({"global": global_latency} if global_latency is not None else {}))
    blocks = basic_blocks(listing)
    live = reachable(listing)
    multiplier = [1.0 if b in live else 0.0 for b in range(len(blocks))]

    def scale(loop_list, factor):
        for loop in loop_list:
            for b in loop.blocks:
                multiplier[b] = factor * trips(loop)
            scale(loop.children, factor * trips(loop))  # the children overwrite their own blocks

    scale(loops, 1.0)
    cost = WarpCost()
    for (start, stop), times in zip(blocks, multiplier):
        for ins in listing.instructions[start:stop]:
            cost.instructions += times
            pipe, cycles = pipe_cycles(ins)
            if cycles:
                cost.pipes[pipe] = cost.pipes.get(pipe, 0.0) + times * cycles
            if unit(ins) == "global":
                cost.global_bytes += times * access_bytes(ins)
    if not simulate:
        return cost
    inside = set().union(*(loop.blocks for loop in loops)) if loops else set()
    outside = [b for b in sorted(live) if b not in inside]
    cost.latency = _simulate(listing, _sequence(blocks, outside, loops, listing, trips, latency), passes=1,
                             latency=latency)
    return cost


def _loop_latency(loop: Loop, blocks, listing: Listing, trips, latency: dict) -> float:
    """Cycles one warp spends in a loop per entry: trips x its steady per-iteration time."""
    if not trips(loop):
        return 0.0
    nested = set().union(*(c.blocks for c in loop.children)) if loop.children else set()
    own = [b for b in loop.blocks if b not in nested]
    return trips(loop) * _simulate(listing, _sequence(blocks, own, loop.children, listing, trips, latency), passes=2,
                                   latency=latency)


def _sequence(blocks, own: list[int], children: list[Loop], listing: Listing, trips, latency: dict) -> list:
    """Instruction indices of `own` blocks in address order, with each child loop as a number
    (its cycles per entry) where its first block lies."""
    items = [(blocks[b][0], range(*blocks[b])) for b in own]
    items += [(min(blocks[b][0] for b in child.blocks), _loop_latency(child, blocks, listing, trips, latency))
              for child in children]
    sequence: list = []
    for _, item in sorted(items, key=lambda kv: kv[0]):
        sequence.extend(item) if isinstance(item, range) else sequence.append(float(item))
    return sequence


def _simulate(listing: Listing, sequence: list, passes: int, latency: dict = LATENCY) -> float:
    """In-order issue of a sequence, `passes` times: each instruction waits for its source
    registers and its unit; a nested loop (a float: its cycles) waits for every register and
    takes its time. Returns the cycles of the last pass."""
    ready: dict[str, float] = {}
    unit_free: dict[str, float] = {}
    copy_groups: list[float] = []  # completion of each committed group of async copies (LDGSTS)
    copies_open = 0.0
    mma_done = 0.0  # completion of the outstanding warpgroup MMAs
    now = begin = 0.0
    for _ in range(passes):
        begin = now
        for item in sequence:
            if isinstance(item, float):
                now = max([now, mma_done, *ready.values()]) + item
                continue
            ins = listing.instructions[item]
            written, read = registers(ins)
            kind = unit(ins)
            pipe, cycles = pipe_cycles(ins)
            if ins.opcode.startswith("HGMMA"):
                read = [r for r in read if r not in written]  # the accumulator chains in the tensor core
            issue = max([now, unit_free.get(pipe, 0.0), *(ready.get(r, 0.0) for r in read)])
            if ins.opcode.startswith("DEPBAR"):
                keep = re.search(r"(0x[0-9a-f]+|\d+)$", ins.operands[-1]) if ins.operands else None
                keep = int(keep.group(1), 0) if keep else 0
                issue = max([issue, *(copy_groups[:-keep] if keep else copy_groups)])
            elif ins.opcode.startswith("WARPGROUP.DEPBAR"):
                issue = max(issue, mma_done)
            if cycles and pipe != "issue":
                unit_free[pipe] = issue + cycles
            now = issue + (latency["barrier"] if kind == "barrier" else 1)
            done = issue + latency[kind] + (cycles if kind == "tensor" else 0)
            if ins.opcode.startswith("LDGSTS"):
                copies_open = max(copies_open, done)
            elif ins.opcode.startswith("LDGDEPBAR"):
                copy_groups.append(copies_open)
                copies_open = 0.0
            if kind == "tensor":
                mma_done = max(mma_done, done)
            for r in written:
                ready[r] = done
    return now - begin
