"""The offline cost model of one Triton launch on an H100 SXM (sm_90), with no GPU: a recorded
launch (bench.costmodel.recording) compiled for sm_90 (bench.costmodel.compiling), its SASS and
loops (bench.costmodel.sass), the trip counts of its loops (bench.costmodel.trip_counts), one
warp's cost (bench.costmodel.warp_cost), then occupancy, waves, bytes and where they hit:

    est_us = launch + max(issue-bound, latency-bound, bandwidth-bound)

Every figure is an estimate. `validate` sets the model of bench.costmodel.flash_attention's
FlashAttention-2 kernel beside published H100 figures of Triton's fused attention.
bench.costmodel.gpu_model adds up a call's launches; bench/README.md explains the model and its
constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import sass, warp_cost
from .compiling import compile_kernel, ptxas_usage, specialisation
from .recording import Launch
from .trip_counts import UnknownBound, bound_arguments, declared_bounds, loop_trips

SMS = 132  # H100 SXM5 (NVIDIA H100 datasheet)
HBM_BYTES_PER_S = 3.35e12  # HBM3, H100 SXM5 datasheet
L2_BYTES_PER_S = 7.0e12  # modelled: Chips and Cheese measured ~5.5 TB/s on the 114-SM PCIe card
L2_BYTES = 50e6  # H100 SXM5 datasheet: 50 MB of L2
SM_BYTES_PER_CLK = 64  # modelled: what one SM moves to and from L2 a clock (a grid under 132 programs)
HBM_LATENCY = 600  # cycles, a load served by HBM (an L2 hit: warp_cost.LATENCY["global"])
LAUNCH_US = 2.0  # modelled: one kernel boundary on the device (drain + fill), in a CUDA graph or not
# Per SM on sm_90 (CUDA C++ Programming Guide, technical specifications for compute capability
# 9.0): 64 K registers (allocated per warp in units of 256), 228 KB shared memory (1 KB of it
# reserved per block), 32 blocks, 64 warps.
REGISTERS, REGISTER_UNIT, SHARED_BYTES, SHARED_PER_BLOCK, MAX_BLOCKS, MAX_WARPS = 65536, 256, 233472, 1024, 32, 64


@dataclass
class LaunchEstimate:
    kernel: str
    programs: int
    warps: int
    registers: int
    shared_bytes: int
    blocks_per_sm: int  # occupancy: resident programs per SM
    waves: float  # programs / (132 x blocks_per_sm)
    instructions: float  # warp instructions the slowest program issues (SASS per loop x trip counts x warps)
    working_set_bytes: float  # the launch's tensors
    hbm_bytes: float
    l2_bytes: float
    hbm_fraction: float  # of the loaded bytes, those served by HBM (the rest: L2 hits)
    issue_us: float
    latency_us: float
    bandwidth_us: float
    est_us: float
    loops: list  # per SASS loop: "source: trips per entry, instructions a trip, runs a program"

    @property
    def bound(self) -> str:
        return max(("issue", self.issue_us), ("latency", self.latency_us), ("bandwidth", self.bandwidth_us),
                   key=lambda kv: kv[1])[0]


@dataclass
class Compiled:
    """What the model reads of one compiled kernel variant."""

    listing: sass.Listing
    loops: list
    warps: int
    registers: int
    shared_bytes: int


_compiled: dict = {}  # (kernel, target, specialisation) -> Compiled


def compiled(launch: Launch, capability: int = 90) -> Compiled:
    """The launch's kernel compiled for sm_<capability>, disassembled, its loops found (once per
    variant: Triton specialises on constexprs and on which integers are 1 or multiples of 16)."""
    key = (launch.name, capability, specialisation(launch))
    if key not in _compiled:
        kernel = compile_kernel(launch, capability)
        listing = sass.disassemble(kernel.asm["cubin"])
        registers = ptxas_usage(kernel.asm["ptx"], capability)[0]
        _compiled[key] = Compiled(listing, sass.find_loops(listing), int(kernel.metadata.num_warps), registers,
                                  int(kernel.metadata.shared))
    return _compiled[key]


def loop_trip_counts(launch: Launch, variant: Compiled) -> dict:
    """Trips per entry of every SASS loop of the launch, by id(loop). A source loop that became
    several sibling SASS loops (an unrolled body and its remainder) is counted once, on the
    smallest: its trips at the cost of one source iteration each."""
    arguments = bound_arguments(launch.kernel, launch.args, launch.kwargs)
    declared = declared_bounds(launch.kernel, arguments)
    blocks = sass.basic_blocks(variant.listing)
    trips = {}

    def visit(siblings):
        smallest = {}
        for loop in siblings:
            size = sum(blocks[b][1] - blocks[b][0] for b in loop.blocks)
            if loop.location not in smallest or size < smallest[loop.location][0]:
                smallest[loop.location] = (size, id(loop))
        for loop in siblings:
            chosen = smallest[loop.location][1] == id(loop)
            trips[id(loop)] = _trips(loop) if chosen else 0
            visit(loop.children)

    def _trips(loop) -> float:
        try:
            return loop_trips(launch.kernel, arguments, declared, loop.location)
        except UnknownBound:
            # An mbarrier wait (TMA, warp specialisation) spins until its data lands: its cost
            # is a latency, taken once, not a loop of the source.
            waits = any(ins.opcode.startswith("SYNCS") for b in loop.blocks
                        for ins in variant.listing.instructions[slice(*blocks[b])])
            if waits and not loop.children:
                return 1
            raise

    visit(variant.loops)
    return trips


_costs: dict = {}  # (variant, its loops' trips, global latency, simulate) -> warp_cost.WarpCost


def variant_cost(variant: Compiled, trips: dict, global_latency: float | None = None,
                 simulate: bool = True) -> warp_cost.WarpCost:
    """warp_cost.warp_cost of a compiled variant under these trip counts (once per distinct
    case: a call repeats launches, such as its Lloyd iterations, with the same trips)."""
    key = (id(variant), tuple(trips.values()), global_latency, simulate)
    if key not in _costs:
        _costs[key] = warp_cost.warp_cost(variant.listing, variant.loops, lambda loop: trips[id(loop)],
                                          global_latency, simulate)
    return _costs[key]


def occupancy(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs resident per SM: the least that registers, shared memory, warps and blocks allow."""
    per_warp = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS // per_warp) // warps if per_warp else MAX_BLOCKS
    by_shared = SHARED_BYTES // (shared_bytes + SHARED_PER_BLOCK)
    return max(1, min(MAX_BLOCKS, MAX_WARPS // warps, by_registers, by_shared))


def where_loads_hit(working_set: float, l2_bytes: float, programs: int, resident: int) -> tuple[float, float]:
    """(HBM bytes, fraction of loaded bytes served by HBM) of a launch that loads l2_bytes from a
    working set of its tensors' bytes. A first touch of each byte comes from HBM (bandwidth); its
    latency is an L2 hit only when the whole working set fits the L2 (a previous launch left it
    there). A re-read misses the L2 in the proportion by which what one wave of programs touches
    (its share of the working set, in grid order) overflows the L2."""
    if not l2_bytes:
        return working_set, 1.0
    first = min(working_set, l2_bytes)
    rereads = l2_bytes - first
    wave = working_set * min(1.0, SMS * resident / max(programs, 1))
    reread_miss = max(0.0, 1.0 - L2_BYTES / wave) if wave else 0.0
    first_miss = 1.0 if working_set > L2_BYTES else 0.0
    return first + rereads * reread_miss, (first * first_miss + rereads * reread_miss) / l2_bytes


def estimate_launch(launch: Launch, capability: int = 90) -> LaunchEstimate:
    """The model's figures for one recorded launch (see the module docstring)."""
    variant = compiled(launch, capability)
    trips = loop_trip_counts(launch, variant)
    warps, registers, shared = variant.warps, variant.registers, variant.shared_bytes
    resident = occupancy(registers, warps, shared)
    programs = launch.programs
    working_set = sum(math.prod(shape) * size for shape, size in filter(None, launch.shapes))
    loaded = variant_cost(variant, trips, simulate=False).global_bytes
    l2_bytes = loaded * warps * programs
    hbm_bytes, from_hbm = where_loads_hit(working_set, l2_bytes, programs, resident)
    global_latency = warp_cost.LATENCY["global"] + from_hbm * (HBM_LATENCY - warp_cost.LATENCY["global"])
    warp = variant_cost(variant, trips, global_latency)
    per_sm = math.ceil(programs / SMS)
    together = min(per_sm, resident)
    waves = math.ceil(per_sm / together)
    warps_per_smsp = math.ceil(together * warps / warp_cost.SMSPS)
    issue = waves * warps_per_smsp * warp.busy / warp_cost.CLOCK_HZ
    latency = waves * warp.latency / warp_cost.CLOCK_HZ
    active_sms = min(programs, SMS)
    bandwidth = max(hbm_bytes / HBM_BYTES_PER_S, l2_bytes / L2_BYTES_PER_S,
                    l2_bytes / (active_sms * SM_BYTES_PER_CLK * warp_cost.CLOCK_HZ))
    est = LAUNCH_US + 1e6 * max(issue, latency, bandwidth)
    return LaunchEstimate(launch.name, programs, warps, registers, shared, resident, programs / (SMS * resident),
                          warp.instructions * warps, working_set, hbm_bytes, l2_bytes, from_hbm, 1e6 * issue,
                          1e6 * latency, 1e6 * bandwidth, est, _loop_rows(variant.listing, variant.loops, trips))


def _loop_rows(listing, loops, trips, runs: float = 1.0) -> list[dict]:
    """Each SASS loop: where it is in the source (the `for`, then the calls it is inlined at), its
    trips per entry, its own instructions (nested loops apart) and its runs per program."""
    blocks = sass.basic_blocks(listing)
    rows = []
    for loop in loops:
        nested = set().union(*(c.blocks for c in loop.children)) if loop.children else set()
        body = sum(blocks[b][1] - blocks[b][0] for b in loop.blocks if b not in nested)
        source = " < ".join(f"{file}:{line}" for file, line in loop.location)
        rows.append(f"{source}: {trips[id(loop)]:.4g} trips, {body} instructions a trip, "
                    f"{runs * trips[id(loop)]:.4g} runs a program")
        rows += _loop_rows(listing, loop.children, trips, runs * trips[id(loop)])
    return rows


def bytes_us(nbytes: float, programs: int = SMS) -> float:
    """A library kernel that streams nbytes: HBM or L2 bandwidth by its working set, or what its
    programs' SMs move when it has fewer than 132 (microseconds, launch boundary apart)."""
    sms = min(max(programs, 1), SMS)
    rate = min(HBM_BYTES_PER_S if nbytes > L2_BYTES else L2_BYTES_PER_S,
               sms * SM_BYTES_PER_CLK * warp_cost.CLOCK_HZ)
    return 1e6 * nbytes / rate


# Triton's fused-attention (FlashAttention-2) kernel on an H100 SXM5, forward, non-causal, bf16/fp16,
# TFLOP/s at (batch, heads, tokens, head dim).
PUBLISHED_TRITON_ATTENTION = [
    dict(shape=(4, 32, 4096, 64), tflops=400, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 64, 'Triton'"),
    dict(shape=(1, 32, 16384, 64), tflops=403, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 64, 'Triton'"),
    dict(shape=(4, 16, 4096, 128), tflops=389, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 128, 'Triton'"),
    dict(shape=(1, 16, 16384, 128), tflops=395, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 128, 'Triton'"),
    dict(shape=(4, 16, 4096, 128), tflops=458, source="pytorch/benchmark ff65cb6, triton_tutorial_flash_v2 on H100"),
    dict(shape=(1, 16, 16384, 128), tflops=477, source="pytorch/benchmark ff65cb6, triton_tutorial_flash_v2 on H100"),
]


def flash_launch(batch: int, heads: int, n: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """The recorded launch of bench.costmodel.flash_attention at one shape (meta tensors, nothing runs)."""
    from .flash_attention import _flash_forward_kernel, launch_arguments

    q, k, v, out = (torch.empty(batch, heads, n, head_dim, dtype=dtype, device="meta") for _ in range(4))
    grid, args, kwargs = launch_arguments(q, k, v, out)
    tensor = [isinstance(a, torch.Tensor) for a in args]
    return Launch(_flash_forward_kernel, grid, tuple(a.dtype if t else a for a, t in zip(args, tensor)), kwargs,
                  tuple((tuple(a.shape), a.element_size()) if t else None for a, t in zip(args, tensor)))


def validate() -> list[dict]:
    """The model's estimate of the FlashAttention-2 kernel at each published shape, and its error."""
    rows = []
    for ref in PUBLISHED_TRITON_ATTENTION:
        b, h, n, d = ref["shape"]
        estimate = estimate_launch(flash_launch(b, h, n, d))
        tflops = 4 * b * h * n * n * d / (estimate.est_us * 1e6)
        rows.append(dict(ref, est_us=estimate.est_us, est_tflops=tflops, bound=estimate.bound,
                         error=tflops / ref["tflops"] - 1))
    return rows
