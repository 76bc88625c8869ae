"""How many times each loop of a Triton kernel runs for one launch, read from its source.

A loop of the SASS carries the source line of its `for` and the lines of the calls it is inlined
at (nvdisasm -gi). From the kernel's source that names one `for ... in range(start, stop, step)`
and the chain of helper calls above it; the bounds are evaluated with the launch's own arguments
(each helper's parameters bound to the values its call site passes), so a loop such as
`for start in range(0, N, BLOCK_N)` needs nothing but the launch.

A bound that the arguments do not give (a local computed from program ids or from data, such
as a split's first key or the number of empty clusters) comes from bench.costmodel.loop_bounds'
`LOOP_BOUNDS` table: kernel module and name -> a function of the launch's arguments (by
parameter name) returning {name: value}, as the slowest program sees them. A loop whose bound is in
neither is an error that names the kernel, the line and the missing name.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap
from pathlib import Path

from clusterserve.bench.costmodel.loop_bounds import LOOP_BOUNDS


class UnknownBound(LookupError):
    """A loop bound that neither the launch's arguments nor bench.costmodel.loop_bounds give."""


def bound_arguments(kernel, args: tuple, kwargs: dict) -> dict:
    """The launch's arguments by parameter name (tensors stand as whatever the recording kept)."""
    signature = inspect.signature(kernel.fn)
    named = {k: v for k, v in kwargs.items() if k in signature.parameters}
    bound = signature.bind_partial(*args, **named)
    bound.apply_defaults()
    return dict(bound.arguments)


def declared_bounds(kernel, arguments: dict) -> dict:
    """clusterserve.bench.costmodel.loop_bounds' entry for this launch ({} when it has none)."""
    entry = LOOP_BOUNDS.get(kernel.fn.__module__, {}).get(kernel.fn.__name__)
    return dict(entry(arguments)) if entry else {}


def loop_trips(kernel, arguments: dict, declared: dict, location: tuple) -> float:
    """Trips per entry of the source loop at `location` ((file, line) innermost first: the `for`
    line, then the lines of the calls it is inlined at, the last one in the kernel)."""
    chain = list(reversed(location))
    frames = [(kernel.fn, dict(arguments))]
    for (_, call_line), (file, line) in zip(chain, chain[1:]):
        frames.append(_enter_call(*frames[-1], declared, call_line, file, line, kernel))
    file, line = chain[-1]
    fn, env = frames[-1]
    loop = _node_at(fn, line, ast.For)
    # ptxas may give a loop's first instructions the line of a helper inlined in its body: the
    # loop is then the innermost `for` around that call, in a caller.
    depth = len(frames) - 1
    while loop is None and depth > 0:
        depth -= 1
        fn, env = frames[depth]
        file, line = chain[depth]
        loop = _enclosing_for(fn, line)
    if loop is None or not isinstance(loop.iter, ast.Call) or not _name(loop.iter.func).endswith("range"):
        raise UnknownBound(f"{kernel.fn.__name__}: {file}:{line} is not a `for ... in range(...)` loop")
    values = [_eval(a, env, declared, fn, f"{kernel.fn.__name__} ({file}:{line})") for a in loop.iter.args]
    start, stop, step = (0, values[0], 1) if len(values) == 1 else (*values, 1)[:3]
    span = (stop - start) / step
    # A declared average (a float) stays fractional; integer bounds make whole trips.
    exact = all(isinstance(v, int) for v in (start, stop, step))
    return max(0, math.ceil(span) if exact else span)


def _enter_call(fn, env: dict, declared: dict, call_line: int, file: str, line: int, kernel):
    """The helper called at `call_line` of fn whose source holds (file, line), and its
    parameters bound to the values passed (None where a value is unknown)."""
    tree, first, _ = _parsed(fn)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.lineno + first - 1 <= call_line <= node.end_lineno + first - 1:
            continue
        callee = _resolve(fn, node.func)
        if callee is None:
            continue
        _, callee_first, callee_last = _parsed(callee)
        if Path(inspect.getsourcefile(callee)).name != file or not callee_first <= line <= callee_last:
            continue
        where = f"{kernel.fn.__name__} (call at line {call_line})"
        params = list(inspect.signature(callee).parameters.values())
        values = {}
        for param, arg in zip(params, node.args):
            values[param.name] = _try_eval(arg, env, declared, fn, where)
        for keyword in node.keywords:
            values[keyword.arg] = _try_eval(keyword.value, env, declared, fn, where)
        for param in params:
            if param.name not in values and param.default is not inspect.Parameter.empty:
                values[param.name] = param.default
        return callee, values
    raise UnknownBound(f"{kernel.fn.__name__}: no call at line {call_line} into {file}:{line}")


@functools.cache
def _parsed(fn):
    """(AST of fn's source, its first line in the file, its last line)."""
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    return tree, first, first + len(lines) - 1


def _node_at(fn, line: int, kind):
    tree, first, _ = _parsed(fn)
    for node in ast.walk(tree):
        if isinstance(node, kind) and node.lineno + first - 1 == line:
            return node
    return None


def _enclosing_for(fn, line: int):
    """The innermost `for` of fn whose body holds `line` (None if none does)."""
    tree, first, _ = _parsed(fn)
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For)
             and node.body[0].lineno + first - 1 <= line <= node.end_lineno + first - 1]
    return max(loops, key=lambda node: node.lineno, default=None)


def _resolve(fn, func: ast.expr):
    """The Python function of the Triton function a call names, from fn's module globals (None
    if it names no Triton function; compiled and interpreted ones alike)."""
    parts = _name(func).split(".")
    value = fn.__globals__.get(parts[0])
    for part in parts[1:]:
        value = getattr(value, part, None)
    inner = getattr(value, "fn", None)
    return inner if inspect.isfunction(inner) else None


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b,
              ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b}
_FUNCTIONS = {"min": min, "max": max, "minimum": min, "maximum": max, "cdiv": lambda a, b: -(-a // b)}


def _try_eval(node, env, declared, fn, where):
    try:
        return _eval(node, env, declared, fn, where)
    except UnknownBound:
        return None  # only an error if a loop bound needs it


def _eval(node: ast.expr, env: dict, declared: dict, fn, where: str):
    """A loop bound's value: arithmetic, min/max/cdiv and `.to(...)` casts over the bound
    parameters, the declared names and the module's numeric constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        for scope in (env, declared):
            if scope.get(node.id) is not None and isinstance(scope[node.id], (int, float)):
                return scope[node.id]
        constant = fn.__globals__.get(node.id)
        if isinstance(constant, (int, float)) and not isinstance(constant, bool):
            return constant
        raise UnknownBound(f"{where}: loop bound `{node.id}` is not an argument of the launch; "
                           f"give it in bench.costmodel.loop_bounds' LOOP_BOUNDS[{fn.__module__!r}]")
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_eval(node.left, env, declared, fn, where),
                                         _eval(node.right, env, declared, fn, where))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env, declared, fn, where)
    if isinstance(node, ast.Call):
        name = _name(node.func)
        if name.endswith(".to") and isinstance(node.func, ast.Attribute):
            return _eval(node.func.value, env, declared, fn, where)
        function = _FUNCTIONS.get(name.rsplit(".", 1)[-1])
        if function is not None:
            return function(*(_eval(a, env, declared, fn, where) for a in node.args))
    raise UnknownBound(f"{where}: cannot evaluate loop bound `{ast.unparse(node)}`")
