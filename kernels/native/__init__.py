"""Native CPU loops for the clustered methods, SMYRF, banded attention and rotary positions:
native.c, built with the package, called by ctypes.

On a CPU the PyTorch reference spends its time in (N, C) score matrices and their argmax,
(C, M) softmax and top-k, and tiles of gathered rows; SMYRF's in per-round gathers, (L, S, S)
logits and scatters. The native backend runs those steps as the loops of native.c on CPU
tensors (stage tables: native/clustered.py, native/smyrf.py); the tests compare them with the
reference (same clusters up to ties within float rounding; outputs equal to float32 rounding).

The loops read q, k and v in float32 or bfloat16 (`DTYPES`) and compute in float32: a
bfloat16 row is widened as it is read (exactly: its bits are a float32's upper half), so a
bfloat16 input gives what the float32 loops give on the same values upcast, without a float32
copy of q, k or v. Outputs come back in the input's dtype.

`pip install` compiles native.c once per x86-64 level (setup.py: baseline, v3 = AVX2 + FMA,
v4 = AVX-512) into kernels/native/_native_<level>*.so; `library()` loads the highest level this CPU
runs. CLUSTERSERVE_NATIVE_ISA (x86_64, x86_64_v3 or x86_64_v4) caps the level, so that the
tests can run the loops under another instruction set than the machine's best. Where no
library was built (no C compiler at install time), `library()` is None and `backend_for`
picks the reference. ctypes releases the GIL during a call; work is split by (batch, head)
over torch.get_num_threads() threads.

This module loads the library and wraps each loop (shapes in, tensors out); levels.py says
which levels this CPU runs, calls.py holds the exports' argument types and the marshalling the
wrappers share (pointers, aligned buffers, the split over threads).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from .calls import DTYPES, LANES, _aligned_zeros, _dtype, _ptr, _split, bind
from .calls import compute_dtype as compute_dtype
from .levels import ISA_VARIABLE, runnable_levels
from .levels import X86_LEVELS as X86_LEVELS

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent


def available() -> bool:
    """Whether the native loops were built and load on this CPU."""
    return library() is not None


def bf16_dot() -> bool:
    """Whether the loaded library computes bfloat16 q . k logits with AVX512-BF16's vdpbf16ps
    (SMYRF's cluster attention): the AVX-512 level on a CPU that has it. The sums then differ
    from the float32 loops' by their order, within float32 rounding."""
    lib = library()
    return lib is not None and bool(lib.bf16_dot())


def level() -> str | None:
    """The level of the loaded library ("x86_64_v3", ...), None where none loads."""
    lib = library()
    return None if lib is None else lib.level


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built native.c for the best level this CPU runs (capped by CLUSTERSERVE_NATIVE_ISA);
    None, logged once, where none was built."""
    for name in runnable_levels(os.environ.get(ISA_VARIABLE)):
        path = next(iter(sorted(FOLDER.glob(f"_native_{name}.*so"))), None)
        if path is None:
            continue
        lib = bind(ctypes.CDLL(str(path)))
        lib.level = name
        return lib
    log.warning(
        "the native CPU loops were not built (no C compiler when the package was installed): "
        "the clustered methods run the slower PyTorch reference on CPU"
    )
    return None


def hash_codes(x: Tensor, planes: Tensor) -> Tensor:
    """hashing.hash_codes: x (B, H, N, D) float32 or bfloat16, planes (H, D + 1, bits) ->
    (B, H, N) int64."""
    b, h, n, d = x.shape
    bits = planes.shape[-1]
    aligned = _aligned_zeros(h, d + 1, 64)  # the loop reads whole 64-byte vectors of it
    aligned[:, :, :bits] = planes
    x = x.contiguous()
    codes = torch.empty(b, h, n, dtype=torch.int64)
    _split(library().hash_codes, b * h, _ptr(x), _dtype(x), _ptr(aligned), h, n, d, bits, _ptr(codes))
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


def cluster_means(x: Tensor, assign: Tensor, clusters: int) -> Tensor:
    """kmeans.cluster_means summed in float32: x (B, H, N, D) float32 or bfloat16, assign
    (B, H, N) in [0, C] -> (B, H, C, D) float32, 0 for an empty cluster."""
    b, h, n, d = x.shape
    x, assign = x.contiguous(), assign.contiguous()
    means = torch.empty(b, h, clusters, d, dtype=torch.float32)
    _split(library().cluster_means, b * h, _ptr(x), _dtype(x), _ptr(assign), n, d, clusters, _ptr(means))
    return means


def refine_clusters(q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int) -> Tensor:
    """kmeans.refine_clusters: q (B, H, N, D) float32 or bfloat16, assign (B, H, N) ->
    refined (B, H, N)."""
    b, h, n, d = q.shape
    q, real = q.contiguous(), query_mask.to(torch.uint8).contiguous()
    refined = assign.clone(memory_format=torch.contiguous_format)
    _split(library().refine_clusters, b * h, _ptr(q), _dtype(q), _ptr(real), h, n, d, clusters, iterations, _ptr(refined))
    return refined


def centroid_attention(
    centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The centroid pass of clustered.centroid_attention without its (C, M) probabilities:
    centroids (B, H, C, D) float32, k (B, H, M, D), v (B, H, M, Dv) float32 or bfloat16,
    key_mask (B, M) -> (values (B, H, C, Dv), top_index (B, H, C, k), top_probs, top_valid
    bool), float32."""
    b, h, c, d = centroids.shape
    m, dv = k.shape[2], v.shape[-1]
    blocks, rest = divmod(m, LANES)  # whole vectors of keys: blocks of LANES, dimension by dimension
    keys_t = _aligned_zeros(b, h, blocks + (rest > 0), d, LANES, dtype=k.dtype)
    keys_t[:, :, :blocks] = k[:, :, : blocks * LANES].unflatten(2, (blocks, LANES)).transpose(-1, -2)
    if rest:
        keys_t[:, :, blocks, :, :rest] = k[:, :, blocks * LANES:].transpose(-1, -2)
    mp = keys_t.shape[2] * LANES
    centroids, v = centroids.to(torch.float32).contiguous(), v.contiguous()
    real = key_mask.to(torch.uint8).contiguous()
    values = torch.empty(b, h, c, dv, dtype=torch.float32)
    index = torch.empty(b, h, c, topk, dtype=torch.int64)
    probs = torch.empty(b, h, c, topk, dtype=torch.float32)
    valid = torch.empty(b, h, c, topk, dtype=torch.uint8)
    lib = library()
    _split(
        lib.centroid_attention, b * h * c, _ptr(centroids), _ptr(keys_t), _ptr(v), _dtype(keys_t, v), _ptr(real),
        h, c, d, m, mp, dv, scale, topk, _ptr(values), _ptr(index), _ptr(probs), _ptr(valid),
    )
    return values, index, probs, valid.bool()


def centroid_values_bf16(centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float) -> Tensor:
    """The centroid pass of clustered attention (no top-k) on bfloat16 keys and values by
    vdpbf16ps, as a bfloat16 SDPA computes it: centroids (B, H, C, D) float32, scaled and
    rounded to bfloat16; k (B, H, M, D), v (B, H, M, Dv) bfloat16, any strides with contiguous
    rows (the packed (T, H, D) layout as it is); key_mask (B, M) -> A^c V (B, H, C, Dv)
    float32, rows of 0 where no key is real. Only where `bf16_centroid_pass(k, v)`."""
    if not bf16_centroid_pass(k, v):
        raise ValueError("centroid_values_bf16: needs bfloat16 k, v with D even and Dv a multiple of 16, "
                         "on a CPU with AVX512-BF16 (bf16_centroid_pass)")
    b, h, c, d = centroids.shape
    m, dv = k.shape[2], v.shape[-1]
    words = (centroids.float() * scale).to(torch.bfloat16).contiguous().view(torch.int32)  # (B, H, C, D / 2)
    if k.stride(-1) != 1 or k.stride(2) % 2:  # rows as words: pairs of dimensions
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    real = key_mask.to(torch.uint8).contiguous()
    values = torch.empty(b, h, c, dv, dtype=torch.float32)
    _split(
        library().centroid_values_bf16, b * h * c, _ptr(words), k.data_ptr(), v.data_ptr(), _ptr(real),
        h, c, d, m, dv, *k.stride()[:3], *v.stride()[:3], _ptr(values),
    )
    return values


def bf16_centroid_pass(k: Tensor, v: Tensor) -> bool:
    """Whether centroid_values_bf16 takes these keys and values: bfloat16, D even, Dv a
    multiple of 16, at least one key, on a CPU whose library has vdpbf16ps (bf16_dot)."""
    return (
        k.dtype == v.dtype == torch.bfloat16 and k.shape[-1] % 2 == 0 and v.shape[-1] % 16 == 0 and k.shape[2] > 0
        and bf16_dot()
    )


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
    """The per-query part of improved clustered attention (eq. 15): q (B, H, N, D) float32 or
    bfloat16, assign (B, H, N), each cluster's top-k keys (B, H, C, k, D) and values
    (B, H, C, k, Dv), valid (B, H, C, k), mass (B, H, C), bottom (B, H, C, Dv) float32 ->
    (B, H, N, Dv) in q's dtype."""
    b, h, n, d = q.shape
    c, k, dv = values.shape[2], values.shape[3], values.shape[4]
    q, assign = q.contiguous(), assign.contiguous()
    keys_t = torch.zeros(b, h, c, d, -(-k // LANES) * LANES)  # rows in whole vectors of keys
    keys_t[..., :k] = keys.transpose(-1, -2)
    values, mass, bottom = (t.to(torch.float32).contiguous() for t in (values, mass, bottom))
    ok = valid.to(torch.uint8).contiguous()
    out = torch.empty(b, h, n, dv, dtype=q.dtype)
    _split(
        library().improved_sparse,
        b * h,
        _ptr(q), _dtype(q),
        *(_ptr(t) for t in (assign, keys_t, values, ok, mass, bottom)),
        n, d, dv, c, k, scale, _ptr(out),
    )
    return out


def smyrf_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_orders: Tensor,
    k_orders: Tensor,
    n_real: Tensor,
    m_real: Tensor,
    n_clusters: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """smyrf.cluster_attention's work for all rounds: q (B, H, N, D), k (B, H, M, D),
    v (B, H, M, Dv) float32 or bfloat16; q_orders (R, B, H, N), k_orders (R, B, H, M)
    positions in hash order, real tokens first; n_real, m_real, n_clusters (B,) -> out
    (B, H, N, Dv) in q's dtype, the rounds merged by softmax mass, and each query's largest
    logit and sum of exp(logit - it) (B, H, N) float32, the sum 0 (and the row of out 0) for a
    query that met no key."""
    b, h, n, d = q.shape
    m, dv, rounds = k.shape[2], v.shape[-1], q_orders.shape[0]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_orders, k_orders = q_orders.contiguous(), k_orders.contiguous()
    counts = [t.to(torch.int64).contiguous() for t in (n_real, m_real, n_clusters)]
    out = torch.empty(b, h, n, dv, dtype=q.dtype)
    top, total = torch.empty(b, h, n, dtype=torch.float32), torch.empty(b, h, n, dtype=torch.float32)
    _split(
        library().smyrf_attention,
        b * h,
        _ptr(q), _ptr(k), _ptr(v), _dtype(q, k, v),
        *(_ptr(t) for t in (q_orders, k_orders, *counts)),
        b * h, h, n, m, d, dv, rounds, scale,
        _ptr(out), _ptr(top), _ptr(total),
    )
    return out, top, total


def smyrf_hashes(
    q: Tensor, k: Tensor, query_mask: Tensor, key_mask: Tensor, projections: Tensor
) -> tuple[Tensor, Tensor]:
    """smyrf.asymmetric_hashes: q (B, H, N, D), k (B, H, M, D) float32 or bfloat16,
    query_mask (B, N), key_mask (B, M), projections (R, H, D + 2) -> (R, B, H, N), (R, B, H, M)
    float32, +inf where padded."""
    b, h, n, d = q.shape
    m, rounds = k.shape[2], projections.shape[0]
    q, k = q.contiguous(), k.contiguous()
    q_real, k_real = query_mask.to(torch.uint8).contiguous(), key_mask.to(torch.uint8).contiguous()
    projections = projections.to(torch.float32).contiguous()
    q_hashes = torch.empty(rounds, b, h, n, dtype=torch.float32)
    k_hashes = torch.empty(rounds, b, h, m, dtype=torch.float32)
    _split(
        library().smyrf_hashes,
        b * h,
        _ptr(q), _ptr(k), _dtype(q, k),
        *(_ptr(t) for t in (q_real, k_real, projections)),
        b * h, h, n, m, d, rounds,
        _ptr(q_hashes), _ptr(k_hashes),
    )
    return q_hashes, k_hashes


def argsort(values: Tensor) -> Tensor:
    """values.argsort(dim=-1, stable=True) for float32 values without NaN (-0 equal to +0,
    +inf last): int64 positions of the same shape."""
    values = values.contiguous()
    order = torch.empty(values.shape, dtype=torch.int64)
    length = values.shape[-1]
    rows = values.numel() // length if length else 0
    _split(library().argsort_rows, rows, _ptr(values), length, _ptr(order))
    return order


def banded_attention(
    q: Tensor, k: Tensor, v: Tensor, pooled_keys: Tensor, pooled_values: Tensor, log_count: Tensor,
    sinks: Tensor, sink_real: Tensor, key_mask: Tensor, counted: Tensor, chosen: Tensor, block: int, band: int,
    scale: float,
) -> Tensor:
    """banded.attend: q, k (B, H, N, D), v (B, H, N, Dv) float32 or bfloat16; pooled keys and
    values (B, H, NB, D / Dv), log_count (B, NB) (-inf: an empty block), sinks and sink_real
    (B, S), key_mask and counted (B, N), chosen (B, H, NB, R) far blocks attended exactly (-1:
    none) -> (B, H, N, Dv) in q's dtype, padded queries 0."""
    b, h, n, d = q.shape
    dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pk, pv = (t.to(torch.float32).contiguous() for t in (pooled_keys, pooled_values))
    pooled_real = torch.isfinite(log_count)
    plog = torch.where(pooled_real, log_count, 0.0).to(torch.float32).contiguous()
    flags = [t.to(torch.uint8).contiguous() for t in (pooled_real, sink_real, key_mask, counted)]
    positions = sinks.to(torch.int64).contiguous()
    chosen = chosen.to(torch.int64).contiguous()
    out = torch.empty(b, h, n, dv, dtype=q.dtype)
    _split(
        library().banded_attention,
        b * h,
        _ptr(q), _ptr(k), _ptr(v), _dtype(q, k, v), _ptr(pk), _ptr(pv), _ptr(plog),
        _ptr(flags[0]), _ptr(positions), _ptr(flags[1]), _ptr(flags[2]), _ptr(flags[3]), _ptr(chosen),
        chosen.shape[-1], h, n, d, dv, block, band, positions.shape[1], scale, _ptr(out),
    )
    return out


def banded_block_max(q: Tensor, keys: Tensor, key_mask: Tensor, size: int) -> Tensor:
    """banded.block_max_logits: q (B, H, N, D) float32 or bfloat16, keys (B, H, NB, D) the
    pooled keys, key_mask (B, N), `size` queries a block -> (B, H, NB, NB) float32, the largest
    q . key_c over query block t's real queries; -FLT_MAX where t has none."""
    b, h, n, d = q.shape
    blocks = keys.shape[2]
    nbp = -(-blocks // LANES) * LANES  # whole vectors of blocks, dimension by dimension
    keys_t = _aligned_zeros(b, h, d, nbp)
    keys_t[..., :blocks] = keys.transpose(-1, -2)
    q, real = q.contiguous(), key_mask.to(torch.uint8).contiguous()
    out = torch.empty(b, h, blocks, blocks, dtype=torch.float32)
    _split(library().banded_block_max, b * h, _ptr(q), _dtype(q), _ptr(keys_t), _ptr(real), h, n, d, blocks, nbp,
           size, _ptr(out))
    return out


# Elements of x below which the rotation runs on the calling thread: handing a short input's
# few rows to the pool costs more than rotating them.
ROTARY_SPLIT_ELEMENTS = 1 << 16


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor | None:
    """apply_rotary_torch bit for bit, in one pass: x (T, H, D) float32 or bfloat16, cos and sin
    (T, 1, D) float32 (rows may be strided) -> (T, H, D) in x's dtype; None where this loop does
    not apply (no library, another dtype or layout, an odd D)."""
    lib = library()
    if lib is None or x.dtype not in DTYPES or x.dim() != 3 or not x.is_contiguous():
        return None
    t, h, d = x.shape
    if d % 2 or cos.stride(0) != sin.stride(0) or any(
        c.dtype != torch.float32 or c.shape != (t, 1, d) or c.stride(2) != 1 for c in (cos, sin)
    ):
        return None
    out = torch.empty_like(x)
    args = (_ptr(x), DTYPES[x.dtype], cos.data_ptr(), sin.data_ptr(), cos.stride(0), h, d, int(interleaved), _ptr(out))
    if x.numel() < ROTARY_SPLIT_ELEMENTS:
        lib.rotary(*args, 0, t)
    else:
        _split(lib.rotary, t, *args)
    return out
