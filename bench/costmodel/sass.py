"""A compiled kernel's SASS as data: nvdisasm's listing of the cubin (with each instruction's
source line and the calls it is inlined at), its basic blocks, and its natural loops.

    listing = disassemble(cubin)   # nvdisasm -c -gi
    loops = find_loops(listing)    # loops of the control-flow graph, nested; each carries the
                                   # source location of its back-branch: the `for` line, then
                                   # the lines of the calls it is inlined at

bench.costmodel.warp_cost prices it; bench.costmodel.trip_counts says how often each loop runs.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    offset: int
    opcode: str  # with its modifiers, e.g. "LDG.E.128"
    operands: list[str]
    guard: str | None  # "P0", "!P1", ...
    location: tuple  # ((file, line), ...) innermost first: the line and the calls it is inlined at

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class Listing:
    instructions: list[Instruction]
    labels: dict[str, int]  # label -> index of the instruction it marks


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SOURCE = re.compile(r'"([^"]+)", line (\d+)')


def disassemble(cubin: bytes) -> Listing:
    """nvdisasm's listing of a cubin, with each instruction's source line (-gi: the kernel is
    compiled with line info, and inlined helpers name the line they are called from)."""
    import tempfile

    from triton import knobs

    nvdisasm = knobs.nvidia.nvdisasm.path  # the wheel's own
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([nvdisasm, "-c", "-gi", file.name], capture_output=True, text=True,
                              check=True).stdout
    return parse_listing(text)


def parse_listing(text: str) -> Listing:
    instructions, labels, pending, location = [], {}, [], ()
    for line in text.splitlines():
        if instructions and re.match(r"\s*\.type\s+\S+,@function", line):
            break  # a subroutine (a called slow path, e.g. IEEE division) follows the kernel
        if line.lstrip().startswith("//##"):
            pending.append(line)
            continue
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        if pending:  # the innermost line "inlined at" its caller, then each caller "inlined at" its own
            frames = [[(Path(f).name, int(n)) for f, n in _SOURCE.findall(note)] for note in pending]
            location = tuple(frames[0] + [frame for later in frames[1:] for frame in later[1:]])
            pending = []
        body = match.group(2)
        guard = None
        if body.startswith("@"):
            guard, body = body[1:].split(None, 1)
        opcode, _, rest = body.partition(" ")
        operands = [o.strip() for o in re.split(r",(?![^\[]*\])", rest)] if rest.strip() else []
        instructions.append(Instruction(int(match.group(1), 16), opcode, operands, guard, location))
    return Listing(instructions, labels)


@dataclass
class Loop:
    """A natural loop of the control-flow graph: a header block that dominates the branches
    back to it, and the blocks that reach those branches without passing the header (code the
    compiler placed out of line included)."""

    header: int  # index of the header block
    blocks: frozenset  # indices of the body's blocks, nested loops' included
    location: tuple  # the source line of its back-branch: the `for`, and the calls it is inlined at
    children: list = field(default_factory=list)


def basic_blocks(listing: Listing) -> list[tuple[int, int]]:
    """[start, stop) instruction ranges: split at labels and after branches, exits and returns."""
    count = len(listing.instructions)
    starts = {0} | {i for i in listing.labels.values() if i < count}
    for index, ins in enumerate(listing.instructions):
        if ins.base in ("BRA", "BRX", "JMX", "EXIT", "RET") and index + 1 < count:
            starts.add(index + 1)
    ordered = sorted(starts)
    return list(zip(ordered, ordered[1:] + [count]))


def _successors(listing: Listing, blocks: list[tuple[int, int]]) -> list[list[int]]:
    block_at = {start: b for b, (start, _) in enumerate(blocks)}
    successors = []
    for b, (_, stop) in enumerate(blocks):
        last = listing.instructions[stop - 1]
        conditional = last.guard is not None and last.guard not in ("PT", "UPT")
        following = [b + 1] if b + 1 < len(blocks) else []
        if last.base in ("BRA", "BRX", "JMX"):
            target = re.search(r"\.L_x_\d+", last.operands[-1]) if last.operands else None
            jump = [block_at[listing.labels[target.group(0)]]] if target and target.group(0) in listing.labels else []
            successors.append(jump + (following if conditional or last.opcode.startswith("BRA.DIV") else []))
        elif last.base in ("EXIT", "RET"):
            successors.append(following if conditional else [])
        else:
            successors.append(following)
    return successors


def find_loops(listing: Listing) -> list[Loop]:
    """The outermost natural loops, each with its nested loops (children)."""
    blocks = basic_blocks(listing)
    successors = _successors(listing, blocks)
    predecessors: list[list[int]] = [[] for _ in blocks]
    for b, targets in enumerate(successors):
        for t in targets:
            predecessors[t].append(b)
    dominators = _dominators(successors, predecessors)
    bodies: dict[int, set] = {}
    latches: dict[int, list] = {}
    for b, targets in enumerate(successors):
        for header in targets:
            if dominators[b] is not None and header in dominators[b]:  # a back edge
                body = bodies.setdefault(header, {header})
                stack = [b]
                while stack:
                    node = stack.pop()
                    if node not in body:
                        body.add(node)
                        stack.extend(predecessors[node])
                latches.setdefault(header, []).append(b)
    loops = [Loop(h, frozenset(body), listing.instructions[blocks[max(latches[h])][1] - 1].location)
             for h, body in bodies.items()]
    loops.sort(key=lambda lp: len(lp.blocks))
    roots = []
    for i, loop in enumerate(loops):
        parent = next((outer for outer in loops[i + 1:] if loop.blocks < outer.blocks), None)
        (parent.children if parent else roots).append(loop)
    for loop in loops:
        loop.children.sort(key=lambda c: c.header)
    roots.sort(key=lambda c: c.header)
    return roots


def reachable(listing: Listing) -> set[int]:
    """Blocks the entry reaches (not the idle loop after the last EXIT)."""
    return _reached(_successors(listing, basic_blocks(listing)))


def _reached(successors: list[list[int]]) -> set[int]:
    seen, stack = set(), [0]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(successors[node])
    return seen


def _dominators(successors: list[list[int]], predecessors: list[list[int]]) -> list[set | None]:
    """Each block's dominators (iterative data flow from the entry block 0); None for a block
    the entry never reaches (the idle loop after the last EXIT)."""
    everything = set(range(len(successors)))
    live = _reached(successors)
    dominators = [set(everything) for _ in successors]
    dominators[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(live - {0}):
            incoming = [dominators[p] for p in predecessors[b] if p in live]
            new = set.intersection(*incoming) | {b} if incoming else {b}
            if new != dominators[b]:
                dominators[b], changed = new, True
    return [d if b in live else None for b, d in enumerate(dominators)]
