"""The offline cost model's parts on small inputs, without compiling: loops of a SASS listing
(bench.costmodel.sass), one warp's cost over them (bench.costmodel.warp_cost) and loop trip counts read from a
kernel's source (bench.costmodel.trip_counts)."""

import inspect

import pytest
import triton
import triton.language as tl

from clusterserve.bench.costmodel import sass, warp_cost
from clusterserve.bench.costmodel.trip_counts import UnknownBound, bound_arguments, loop_trips

# An outer loop (line 11) around an inner one (line 14), then an exit and the idle loop that
# follows every kernel.
LISTING = """
        //## File "/src/toy.py", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        //## File "/src/toy.py", line 12
        /*0010*/                   FFMA R1, R0, R0, R1 ;
        /*0020*/                   MUFU.EX2 R2, R1 ;
.L_x_1:
        //## File "/src/toy.py", line 14 inlined at "/src/toy.py", line 13
        //## File "/src/toy.py", line 13
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0040*/                   ISETP.GE.AND P0, PT, R3, 0x10, PT ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        //## File "/src/toy.py", line 11
        /*0060*/                   ISETP.GE.AND P1, PT, R2, 0x10, PT ;
        /*0070*/              @!P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2) ;
"""


def test_loops_nest_and_carry_their_source_lines():
    listing = sass.parse_listing(LISTING)
    (outer,) = sass.find_loops(listing)
    (inner,) = outer.children
    assert outer.location == (("toy.py", 11),)
    assert inner.location == (("toy.py", 14), ("toy.py", 13))
    assert inner.blocks < outer.blocks and not inner.children


def test_a_line_two_calls_deep_carries_both_call_sites():
    # nvdisasm writes one annotation a frame: each caller "inlined at" its own caller.
    listing = sass.parse_listing("""
        //## File "/src/toy.py", line 30 inlined at "/src/toy.py", line 20
        //## File "/src/toy.py", line 20 inlined at "/src/toy.py", line 10
        //## File "/src/toy.py", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   EXIT ;
""")
    assert listing.instructions[0].location == (("toy.py", 30), ("toy.py", 20), ("toy.py", 10))


def test_warp_cost_multiplies_each_block_by_its_loops_trips():
    listing = sass.parse_listing(LISTING)
    (outer,) = loops = sass.find_loops(listing)
    trips = {id(outer): 3, id(outer.children[0]): 5}
    cost = warp_cost.warp_cost(listing, loops, lambda loop: trips[id(loop)])
    # S2R + 3 x (FFMA, MUFU + 5 x 3 inner + ISETP, BRA) + EXIT
    assert cost.instructions == 1 + 3 * (2 + 5 * 3 + 2) + 1
    assert cost.pipes["xu"] == 3 * 8  # one MUFU a trip, 8 cycles of its SMSP (16 results/clk/SM)
    assert cost.busy == pytest.approx(max(cost.instructions, cost.pipes["fma"], cost.pipes["alu"]) + 3 * 8)
    assert cost.latency > 3 * 5 * 4  # the inner loop's dependent adds alone


def test_a_warp_reduction_is_a_shuffle_and_a_global_reduction_moves_bytes():
    listing = sass.parse_listing("""
        /*0000*/                   REDUX.SUM.S32 UR4, R2 ;
        /*0010*/                   REDG.E.ADD.STRONG.GPU desc[UR6][R4.64], R3 ;
        /*0020*/                   RED.E.ADD.STRONG.GPU [R4.64], R3 ;
""")
    redux, redg, red = listing.instructions
    assert warp_cost.unit(redux) == "shfl" and warp_cost.registers(redux)[0] == ["UR4"]
    assert warp_cost.unit(redg) == warp_cost.unit(red) == "global"
    assert warp_cost.registers(redg)[0] == warp_cost.registers(red)[0] == []
    cost = warp_cost.warp_cost(listing, [], lambda loop: 1)
    assert cost.global_bytes == 2 * 32 * 4  # the two global reductions, 4 bytes a thread


@triton.jit
def _toy_sum(x_ptr, n, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):  # loop: helper
        total += tl.load(x_ptr + start + tl.arange(0, BLOCK))
    return tl.sum(total, axis=0)  # line: no loop


@triton.jit
def _toy_kernel(x_ptr, out_ptr, N, STEPS, BLOCK: tl.constexpr):
    first = tl.program_id(0) * BLOCK
    total = 0.0
    for _ in range(STEPS):  # loop: steps
        total += _toy_sum(x_ptr, N, BLOCK)  # call: helper
    for start in range(first, N, BLOCK):  # loop: local bound
        total += tl.load(x_ptr + start)
    tl.store(out_ptr, total)


def _line(marker: str) -> tuple[str, int]:
    lines, _ = inspect.getsourcelines(inspect.getmodule(_line))
    return "test_cost_model_parts.py", next(i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker))


def test_trip_counts_come_from_the_launch_arguments_through_helper_calls():
    arguments = bound_arguments(_toy_kernel, ("x", "out", 1000, 3), {"BLOCK": 64, "num_warps": 4})
    assert arguments == {"x_ptr": "x", "out_ptr": "out", "N": 1000, "STEPS": 3, "BLOCK": 64}
    assert loop_trips(_toy_kernel, arguments, {}, (_line("# loop: steps"),)) == 3
    assert loop_trips(_toy_kernel, arguments, {}, (_line("# loop: helper"), _line("# call: helper"))) == 16


def test_a_loop_headed_by_a_line_of_an_inlined_helper_is_the_for_around_the_call():
    """ptxas may give a loop's first instructions a line of a helper inlined in its body: the
    loop is the innermost `for` around the call (the steps), not an error."""
    arguments = bound_arguments(_toy_kernel, ("x", "out", 1000, 3), {"BLOCK": 64})
    assert loop_trips(_toy_kernel, arguments, {}, (_line("# line: no loop"), _line("# call: helper"))) == 3
    with pytest.raises(UnknownBound, match="is not a `for"):
        loop_trips(_toy_kernel, arguments, {}, (_line("first = tl.program_id(0) * BLOCK"),))


def test_a_bound_the_arguments_do_not_give_is_declared_or_an_error():
    arguments = bound_arguments(_toy_kernel, ("x", "out", 1000, 3), {"BLOCK": 64})
    location = (_line("# loop: local bound"),)
    with pytest.raises(UnknownBound, match="`first`.*LOOP_BOUNDS"):
        loop_trips(_toy_kernel, arguments, {}, location)
    assert loop_trips(_toy_kernel, arguments, {"first": 0}, location) == 16
    assert loop_trips(_toy_kernel, arguments, {"first": 500.0}, location) == pytest.approx(500 / 64)
