"""The loop bounds of the Triton kernels that a launch's arguments do not give, for the offline
cost model (bench/trip_counts.py, bench/gpu_model.py): per kernel module and kernel, a function
of the launch's arguments (by parameter name) returning {name: value}, as the slowest program
of the launch sees them. A bound that is neither here nor in the arguments is an error of
bench.trip_counts that names the kernel, the line and the missing name.

The data-dependent ones are set from the reference on real text: the refinement's steps
leave no cluster empty (its candidates and donor launches find nothing to do); the Hamming
update's empty clusters are about 2 x (C / 100)^2 a head in the first of 10 iterations,
almost none after, the slowest block taking all of a launch's share, a donor found in one
chunk. The centroid top-k's are not: they assume 1.3 TOP keys a row at or above its threshold,
spread evenly (random logits). On the default model's real projections a row has 2.7-5 TOP, and
the slowest program runs 2.3-3.7x these rounds (bench.topk_filter; docs/benchmarks.md).
"""

from __future__ import annotations

import math
from typing import Callable

Bounds = Callable[[dict], dict]


def slowest_chunk(n: int, chunk: int) -> dict:
    """The rows [start, stop) of the slowest program of a head's chunks, the last full one (a
    count of the rows before it is the longest there)."""
    start = max(0, n // chunk - 1) * chunk
    return {"start": start, "stop": min(start + chunk, n)}


def cluster_range(clusters: int, per_program: int) -> dict:
    """The clusters [first_cluster, last_cluster) of the slowest program, the last full one (the
    most clusters before it and a full block of its own)."""
    first = max(0, clusters // per_program - 1) * per_program
    return {"first_cluster": first, "last_cluster": min(first + per_program, clusters)}


def band_span(a: dict) -> dict:
    """Banded attention's slowest program: the band's loop over its BLOCK_M rows' blocks plus BAND
    blocks each side; the chosen blocks', once per query block its rows meet."""
    size, block_m = a["SIZE"], a["BLOCK_M"]
    aligned = size % block_m == 0 or block_m % size == 0
    row_blocks = -(-block_m // size) + (0 if aligned else 1)
    return {"lo": 0, "hi": min(a["N"], (row_blocks + 2 * a["BAND"]) * size), "first": 0, "last": (row_blocks - 1) * size}


def topk_rounds(a: dict) -> dict:
    """The centroid top-k's split and its rounds of candidates per block of keys: a row's
    ~1.3 TOP keys at or above its threshold spread over the M keys; a block's rounds are the
    most any of its rows has (a Poisson maximum)."""
    per_row = 1.3 * a["TOP"] * a["BLOCK_M"] / max(a["M"], 1)
    cdf, term, rounds, k = 0.0, math.exp(-per_row), 0.0, 0
    while cdf < 1 - 1e-9 and k < a["BLOCK_M"]:
        cdf += term
        rounds += 1 - cdf ** a["BLOCK_C"]  # P(max > k)
        k += 1
        term *= per_row / k
    return {"first": 0, "stop": min(a["CHUNK"], a["M"]), "candidates": rounds}


def first_tile_keys(a: dict) -> dict:
    """The key ranks SMYRF's first tile of sorted queries streams (all tokens real): those of the
    clusters its BLOCK_M ranks fall in."""
    n, m, block_m = a["N"], a["M"], a["BLOCK_M"]
    clusters = max(1, min(-(-max(n, m) // a["cluster_size"]), n, m))
    last_cluster = (min(block_m, n) - 1) * clusters // n
    return {"key_start": 0, "key_stop": -(-(last_cluster + 1) * m // clusters)}


def _by_rows(a: dict) -> dict:
    return slowest_chunk(a["N"], a["CHUNK"])


LOOP_BOUNDS: dict[str, dict[str, Bounds]] = {
    "kernels.triton.banded": {"_banded_kernel": band_span},
    "kernels.triton.centroid": {
        "_centroid_attention_kernel": lambda a: {"first": 0, "stop": min(a["CHUNK"], a["M"])},
        "_centroid_topk_kernel": topk_rounds,
    },
    "kernels.triton.cluster_layout": {
        "_layout_counts_kernel": lambda a: {**_by_rows(a), "zero_stop": _by_rows(a)["start"]},  # no padding
        "_layout_scatter_kernel": _by_rows,
    },
    "kernels.triton.hamming": {
        "_hamming_initial_kernel": lambda a: {  # all queries real: no rank is counted
            **slowest_chunk(a["N"], a["CHUNK"]), "c_first": 0, "c_last": a["C"] / -(-a["N"] // a["CHUNK"]) + 3,
            "scan_stop": slowest_chunk(a["N"], a["CHUNK"])["start"],
        },
        "_hamming_assign_kernel": _by_rows,
    },
    "kernels.triton.hamming_step": {
        "_hamming_step_kernel": lambda a: {
            **slowest_chunk(a["N"], a["CHUNK"]), "chunk": max(0, a["N"] // a["CHUNK"] - 1),
            "lo": 0, "hi": -(-a["C"] * a["BLOCK_BITS"] // a["CHUNKS"]), "n_empty": 0.2 * (a["C"] / 100) ** 2,
        },
    },
    "kernels.triton.hashing": {"_hash_kernel": _by_rows},
    "kernels.triton.hamming_update": {
        "_hamming_update_kernel": lambda a: {
            **cluster_range(a["C"], a["PER_PROGRAM"]), "chunk": 0, "stop": a["CHUNK"],
            "block_empties": 0.2 * (a["C"] / 100) ** 2,
        },
    },
    "kernels.triton.lloyd": {
        "_candidates_kernel": lambda a: {"start": 0, "stop": 0},
        "_donor_kernel": lambda a: {"wanted": 0, "empties": 0},
        "_nearest_kernel": _by_rows,
    },
    "kernels.triton.means": {
        "_sums_kernel": _by_rows,
        "_means_kernel": lambda a: cluster_range(a["C"], a["PER_PROGRAM"]),
    },
    "kernels.triton.smyrf": {
        "_smyrf_attention_kernel": first_tile_keys,
        "_smyrf_norms_kernel": lambda a: slowest_chunk(max(a["N"], a["M"]), a["CHUNK"]),
    },
}  # fmt: skip
