"""Triton's interpreter (TRITON_INTERPRET=1) without two kinds of work whose results it drops.

- **Re-swapping the language on every helper call.** The interpreter swaps triton.language's
  builtins for NumPy versions when a launch starts (`_patch_lang`) and puts them back when it
  ends. It runs that swap again on every call of a @triton.jit helper inside the launch,
  scanning the language modules each time (`inspect.getmembers`): the swap is already in
  place, so nothing changes. Here a helper's call skips it when the launch has already swapped
  every language module the helper sees; any other call swaps as before.
- **Overflow checks that cannot fire.** Every int32 add, sub and mul is redone in int64 and
  compared with int32's range (`binary_op_sanitize_overflow_impl`) for a device assert, which
  the interpreter drops unless its `debug` option is on (it is off). Here the check is skipped
  exactly when that assert would be dropped.

In kernels that call helpers in loops the two are over half of the interpreter's time. Results
are unchanged: the same builtins run, and no assert was ever raised. Nothing changes when the
interpreter is off, or in a Triton whose interpreter keeps its swap for good (no
`_LangPatchScope`, as in 3.4): there, nothing is wrapped.
"""

from __future__ import annotations

import os

import triton.language as tl

_patched: set[int] = set()  # ids of the language modules the running launch has swapped


class _LaunchScope:
    """The launch's own scope: restoring it also forgets which modules it swapped."""

    def __init__(self, inner):
        self._inner = inner

    def restore(self) -> None:
        _patched.clear()
        self._inner.restore()


class _NothingSwapped:
    def restore(self) -> None:
        pass


def _language_modules(fn) -> set[int]:
    return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}


def _skip_repeated_swaps(interpreter) -> None:
    original = interpreter._patch_lang

    def patch_lang(fn):
        langs = _language_modules(fn)
        if _patched and langs <= _patched:
            return _NothingSwapped()  # a helper's call inside a launch that swapped them all
        scope = original(fn)
        launch = not _patched  # else a helper saw a module the launch had not swapped
        _patched.update(langs)
        return _LaunchScope(scope) if launch else scope

    patch_lang._skips_work = True
    interpreter._patch_lang = patch_lang


def _skip_dropped_overflow_checks(interpreter) -> None:
    semantic = interpreter.interpreter_semantic
    original = semantic.binary_op_sanitize_overflow_impl

    def sanitize_overflow(lhs, rhs, binary_op):
        if semantic.builder.options.debug:  # the only case where its device assert is kept
            return original(lhs, rhs, binary_op)
        return None

    sanitize_overflow._skips_work = True
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow


def skip_dropped_work() -> bool:
    """Wrap the interpreter's language swap and overflow check (once): True where they are
    wrapped, False where the interpreter is off or this Triton's interpreter differs."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if not (hasattr(interpreter, "_LangPatchScope") and hasattr(interpreter, "_patch_lang")
            and hasattr(semantic, "binary_op_sanitize_overflow_impl") and hasattr(semantic, "builder")):
        return False
    if not getattr(interpreter._patch_lang, "_skips_work", False):
        _skip_repeated_swaps(interpreter)
    if not getattr(semantic.binary_op_sanitize_overflow_impl, "_skips_work", False):
        _skip_dropped_overflow_checks(interpreter)
    return True
