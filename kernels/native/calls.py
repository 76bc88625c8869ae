"""How Python calls native.c: the argument types of its exported functions, the codes of the
dtypes its loops read, its vector width, and the marshalling every wrapper in
kernels/native/__init__.py shares (pointers of contiguous CPU tensors, 64-byte aligned
buffers, the split of a call's (batch, head) slices over threads). ctypes releases the GIL
during a call, so the parts of a split run in parallel."""

from __future__ import annotations

import ctypes
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

# The dtypes the loops read q, k and v in, and their codes in native.c (F32, BF16).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Floats per vector of native.c (its LANES): the blocks of keys its centroid pass reads.
LANES = 16
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# Argument types of the exported functions, in order (pointers are tensors' data_ptr()).
_SIGNATURES = {
    "hash_codes": (_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64),
    "hamming_kmeans": (_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64),
    "cluster_means": (_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64),
    "refine_clusters": (_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64),
    "centroid_attention": (_PTR,) * 3 + (_I64, _PTR) + (_I64,) * 6 + (ctypes.c_float, _I64) + (_PTR,) * 4 + (_I64, _I64),
    "centroid_values_bf16": (_PTR,) * 4 + (_I64,) * 11 + (_PTR, _I64, _I64),
    "improved_sparse": (_PTR, _I64) + (_PTR,) * 6 + (_I64,) * 5 + (ctypes.c_float, _PTR, _I64, _I64),
    "smyrf_attention": (_PTR,) * 3 + (_I64,) + (_PTR,) * 5 + (_I64,) * 7 + (ctypes.c_float,) + (_PTR,) * 3 + (_I64, _I64),
    "smyrf_hashes": (_PTR, _PTR, _I64) + (_PTR,) * 3 + (_I64,) * 6 + (_PTR, _PTR, _I64, _I64),
    "argsort_rows": (_PTR, _I64, _PTR, _I64, _I64),
    "banded_attention": (_PTR,) * 3 + (_I64,) + (_PTR,) * 9 + (_I64,) * 8 + (ctypes.c_float, _PTR, _I64, _I64),
    "banded_block_max": (_PTR, _I64, _PTR, _PTR) + (_I64,) * 6 + (_PTR, _I64, _I64),
    "rotary": (_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64),
    "bf16_dot": (),
}
_RESULTS = {"bf16_dot": ctypes.c_int}  # the others return nothing


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the argument and result types of every exported function set."""
    for function, argtypes in _SIGNATURES.items():
        fn = getattr(lib, function)
        fn.argtypes, fn.restype = argtypes, _RESULTS.get(function)
    return lib


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="clusterserve-native")


def _split(fn, total: int, *args) -> None:
    """fn(*args, start, end) over [0, total) in torch.get_num_threads() contiguous parts."""
    parts = max(1, min(torch.get_num_threads(), total))
    bounds = [total * i // parts for i in range(parts + 1)]
    if parts == 1:
        fn(*args, 0, total)
        return
    list(_pool().map(lambda i: fn(*args, bounds[i], bounds[i + 1]), range(parts)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the native stages take q, k and v in: float32 and bfloat16 as they are,
    anything else (float16) converted to float32."""
    return dtype if dtype in DTYPES else torch.float32


def _dtype(*tensors: Tensor) -> int:
    """native.c's code of the tensors' shared dtype (float32 or bfloat16)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES or any(t.dtype != dtype for t in tensors):
        raise ValueError(f"the native loops read float32 or bfloat16 q, k, v of one dtype, got {[t.dtype for t in tensors]}")
    return DTYPES[dtype]


def _aligned_zeros(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A contiguous tensor of zeros whose data starts on a 64-byte boundary."""
    count, size = math.prod(shape), torch.empty((), dtype=dtype).element_size()
    flat = torch.zeros(count + 64 // size, dtype=dtype)
    start = (-flat.data_ptr() % 64) // size
    return flat[start : start + count].view(shape)


def _ptr(t: Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()
