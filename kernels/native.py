"""Native CPU loops for the clustered methods: native.c, compiled on first use, called by ctypes.

On a CPU the PyTorch reference spends its time in (N, C) score matrices and their argmax,
(C, M) softmax and top-k, and tiles of gathered rows. The torch backend hands those steps to
the loops in native.c when they can run: a float32 input on the CPU, a C compiler on the
machine, and CLUSTERSERVE_NATIVE not set to 0. Otherwise it runs the reference, which is what
the tests compare these loops against (same clusters; outputs equal to float32 rounding).

The library is built once per source, compiler and CPU into the cache folder
(CLUSTERSERVE_CACHE_DIR, else $XDG_CACHE_HOME/clusterserve, else ~/.cache/clusterserve, else
the temp folder). ctypes releases the GIL during a call; work is split by (batch, head) over
torch.get_num_threads() threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# Compiled with -ffast-math (vectorised expf, reassociated sums) but linked without it: linking
# with it would add crtfastmath.o, which sets flush-to-zero for the whole process on load.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# Argument types of the exported functions, in order (pointers are tensors' data_ptr()).
_SIGNATURES = {
    "hash_codes": (_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64),
    "hamming_kmeans": (_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64),
    "refine_clusters": (_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64),
    "softmax_topk": (_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64),
    "improved_sparse": (_PTR,) * 7 + (_I64,) * 5 + (ctypes.c_float, _PTR, _I64, _I64),
}


def enabled() -> bool:
    """Whether the native loops are switched on (CLUSTERSERVE_NATIVE, default 1)."""
    return os.environ.get("CLUSTERSERVE_NATIVE", "1") != "0"


def available() -> bool:
    """Whether the native loops are switched on and built (building them on the first call)."""
    return enabled() and library() is not None


def usable(x: Tensor) -> bool:
    """Whether the native loops run for this compute tensor: float32 on the CPU, and available."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and available()


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled native.c, built on the first call; None (logged once) if it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found: the clustered methods run the slower PyTorch reference on CPU")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip()[-500:]
        log.warning("could not build %s (%s): the clustered methods run the PyTorch reference on CPU", SOURCE.name, detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        key.update(part)
    folder = _cache_dir()
    path = folder / f"clusterserve-native-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a private name and renamed: processes that build at once never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    objects = partial[: -len(".so")] + ".o"
    try:
        subprocess.run([compiler, *FLAGS, "-c", "-o", objects, str(SOURCE)], capture_output=True, text=True, check=True)
        # libm brings glibc's vector expf.
        subprocess.run([compiler, "-shared", "-o", partial, objects, "-lm"], capture_output=True, text=True, check=True)
        os.replace(partial, path)
    finally:
        for leftover in (partial, objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("built %s", path)
    return path


def _cache_dir() -> Path:
    for candidate in (
        os.environ.get("CLUSTERSERVE_CACHE_DIR"),
        os.environ.get("XDG_CACHE_HOME") and os.path.join(os.environ["XDG_CACHE_HOME"], "clusterserve"),
        os.path.expanduser("~/.cache/clusterserve"),
    ):
        if candidate and _writable(Path(candidate)):
            return Path(candidate)
    return Path(tempfile.gettempdir()) / "clusterserve"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _cpu_signature() -> str:
    """-march=native builds for this CPU: its model and flags are part of the cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


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


def _aligned_zeros(*shape: int) -> Tensor:
    """A contiguous float32 tensor of zeros whose data starts on a 64-byte boundary."""
    count = math.prod(shape)
    flat = torch.zeros(count + 16, dtype=torch.float32)
    start = (-flat.data_ptr() % 64) // 4
    return flat[start : start + count].view(shape)


def _ptr(t: Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


def hash_codes(x: Tensor, planes: Tensor) -> Tensor:
    """hashing.hash_codes: x (B, H, N, D) float32, planes (H, D + 1, bits) -> (B, H, N) int64."""
    b, h, n, d = x.shape
    bits = planes.shape[-1]
    aligned = _aligned_zeros(h, d + 1, 64)  # the loop reads whole 64-byte vectors of it
    aligned[:, :, :bits] = planes
    x = x.contiguous()
    codes = torch.empty(b, h, n, dtype=torch.int64)
    _split(library().hash_codes, b * h, _ptr(x), _ptr(aligned), h, n, d, bits, _ptr(codes))
    return codes


def hamming_kmeans(codes: Tensor, query_mask: Tensor, initial: Tensor, iterations: int, bits: int) -> Tensor:
    """kmeans.hamming_kmeans on packed codes: codes (B, H, N) int64, query_mask (B, N) bool,
    initial (B, H, C) int64 codes of the initial centroids -> assignments (B, H, N)."""
    b, h, n = codes.shape
    clusters = initial.shape[-1]
    codes, real = codes.contiguous(), query_mask.to(torch.uint8).contiguous()
    centroids = initial.clone(memory_format=torch.contiguous_format)
    assign = torch.empty(b, h, n, dtype=torch.int64)
    lib = library()
    _split(lib.hamming_kmeans, b * h, _ptr(codes), _ptr(real), h, n, bits, _ptr(centroids), clusters, iterations, _ptr(assign))
    return assign


def refine_clusters(q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int) -> Tensor:
    """kmeans.refine_clusters: q (B, H, N, D) float32, assign (B, H, N) -> refined (B, H, N)."""
    b, h, n, d = q.shape
    q, real = q.contiguous(), query_mask.to(torch.uint8).contiguous()
    refined = assign.clone(memory_format=torch.contiguous_format)
    _split(library().refine_clusters, b * h, _ptr(q), _ptr(real), h, n, d, clusters, iterations, _ptr(refined))
    return refined


def softmax_topk(logits: Tensor, key_mask: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Softmax over the real keys of logits (B, H, C, M), in place, and each row's `topk`
    most probable real keys: (probs, top_index (B, H, C, k), top_probs, top_valid bool)."""
    b, h, c, m = logits.shape
    assert logits.is_contiguous()
    real = key_mask.to(torch.uint8).contiguous()
    index = torch.empty(b, h, c, topk, dtype=torch.int64)
    probs = torch.empty(b, h, c, topk, dtype=torch.float32)
    valid = torch.empty(b, h, c, topk, dtype=torch.uint8)
    rows = b * h * c
    _split(library().softmax_topk, rows, _ptr(logits), _ptr(real), h * c, m, topk, _ptr(index), _ptr(probs), _ptr(valid))
    return logits, index, probs, valid.bool()


def improved_sparse(
    q: Tensor,
    assign: Tensor,
    keys: Tensor,
    values: Tensor,
    valid: Tensor,
    mass: Tensor,
    bottom: Tensor,
    scale: float,
) -> Tensor:
    """The per-query part of improved clustered attention (eq. 15): q (B, H, N, D),
    assign (B, H, N), each cluster's top-k keys (B, H, C, k, D) and values (B, H, C, k, Dv),
    valid (B, H, C, k), mass (B, H, C), bottom (B, H, C, Dv) -> (B, H, N, Dv)."""
    b, h, n, d = q.shape
    c, k, dv = values.shape[2], values.shape[3], values.shape[4]
    q, assign = q.contiguous(), assign.contiguous()
    keys_t = keys.transpose(-1, -2).contiguous()
    values, mass, bottom = values.contiguous(), mass.contiguous(), bottom.contiguous()
    ok = valid.to(torch.uint8).contiguous()
    out = torch.empty(b, h, n, dv, dtype=torch.float32)
    _split(
        library().improved_sparse,
        b * h,
        *(_ptr(t) for t in (q, assign, keys_t, values, ok, mass, bottom)),
        n, d, dv, c, k, scale, _ptr(out),
    )
    return out
