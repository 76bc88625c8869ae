"""The loop bounds of the Triton kernels that a launch's arguments do not give, for the offline
cost model (bench/costmodel/trip_counts.py, bench/costmodel/gpu_model.py): per kernel module and kernel, a function
of the launch's arguments (by parameter name) returning {name: value}, as the slowest program
of the launch sees them. A bound that is neither here nor in the arguments is an error of
bench.costmodel.trip_counts that names the kernel, the line and the missing name.

The data-dependent ones are set from the reference on real text: the refinement's steps
leave no cluster empty (its candidates and donor launches find nothing to do); the Hamming
update's empty clusters are about 2 x (C / 100)^2 a head in the first of 10 iterations,
almost none after, the slowest block taking all of a launch's share, a donor found in one
chunk. The centroid top-k's merges of its candidate buffers are bench.costmodel.topk_filter's replay
of the kernel on the default model's real text (bench/results/topk-filter-nomic.json): a row
there has 2.7-11 TOP keys at or above its threshold (4k-64k), where random logits leave 1.3 TOP.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Callable

Bounds = Callable[[dict], dict]


def slowest_chunk(n: int, chunk: int) -> dict:
    """The rows [start, stop) of the slowest program of a head's chunks, the last full one (a
    count of the rows before it is the longest there)."""
    start = max(0, n // chunk - 1) * chunk
    return {"start": start, "stop": min(start + chunk, n)}


def seed_search(a: dict) -> dict:
    """clusterserve.kernels.triton.seeding's search for the seeds in the slowest chunk: all queries real (no
    rank is counted), its share of the clusters and one to spare each side."""
    chunk = slowest_chunk(a["N"], a["CHUNK"])
    return {**chunk, "c_first": 0, "c_last": a["C"] / -(-a["N"] // a["CHUNK"]) + 3, "scan_stop": chunk["start"]}


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


# bench.costmodel.topk_filter's replay of the centroid top-k on the default model's real text (i-clustered
# 100/32, TOP 32): per length, the slowest program's merges of full buffers within its split.
TOPK_REPLAY = Path(__file__).resolve().parents[1] / "results" / "topk-filter-nomic.json"


@functools.cache
def _replayed_merges() -> list[tuple[int, float, int]]:
    """(tokens, chunks merged within the split a block of keys, chunks of the last merge) of
    the slowest program at each replayed length."""
    rows = json.loads(TOPK_REPLAY.read_text())["rows"]
    return sorted((r["tokens"], r["inner_chunks_max"] / r["blocks"], r["last_max"]) for r in rows
                  if r["lanes"] == "rotated")


def topk_merges(a: dict) -> dict:
    """The centroid top-k's split and its merges, as the slowest program on real text makes
    them: the replay's at the nearest replayed lengths (interpolated in log length, held
    beyond them). A block's merges are the chunks merged within the split a block, replayed at
    TOP 32 (the kernel's loop runs a merge's chunks; other TOPs are priced alike)."""
    m = a["M"]
    replayed = _replayed_merges()
    lower = max((r for r in replayed if r[0] <= m), default=replayed[0])
    upper = min((r for r in replayed if r[0] >= m), default=replayed[-1])
    weight = 0.0 if upper[0] == lower[0] else math.log(m / lower[0]) / math.log(upper[0] / lower[0])
    rate = lower[1] + weight * (upper[1] - lower[1])
    last = lower[2] + weight * (upper[2] - lower[2])
    # The last merge runs at least once where no merge ran before (it writes the kept keys).
    return {"first": 0, "stop": min(a["CHUNK"], m), "merges": rate, "last_merges": last if rate > 0 else max(1.0, last)}


def first_tile_keys(a: dict) -> dict:
    """The key ranks SMYRF's first tile of sorted queries streams (all tokens real): those of the
    clusters its BLOCK_M ranks fall in."""
    n, m, block_m = a["N"], a["M"], a["BLOCK_M"]
    clusters = max(1, min(-(-max(n, m) // a["cluster_size"]), n, m))
    last_cluster = (min(block_m, n) - 1) * clusters // n
    return {"key_start": 0, "key_stop": -(-(last_cluster + 1) * m // clusters)}


def _by_rows(a: dict) -> dict:
    return slowest_chunk(a["N"], a["CHUNK"])


def exact_case_counts(a: dict) -> dict:
    """helpers.exact_case's counts of the rest of the row: none where the slowest chunk holds
    more real queries than clusters (the modelled inputs are all real)."""
    rows = _by_rows(a)
    few = rows["stop"] - rows["start"] <= a["C"]
    return {**rows, "before_stop": rows["start"] if few else 0, "after_start": rows["stop"] if few else a["N"]}


LOOP_BOUNDS: dict[str, dict[str, Bounds]] = {
    "clusterserve.kernels.triton.banded": {"_banded_kernel": band_span},
    "clusterserve.kernels.triton.centroid": {
        "_centroid_attention_kernel": lambda a: {  # no padded key: the blocks without the mask
            "first": 0, "stop": min(a["CHUNK"], a["M"]), "masked_stop": 0, "clean_stop": min(a["CHUNK"], a["M"]),
        },
    },
    "clusterserve.kernels.triton.centroid_topk": {"_centroid_topk_kernel": topk_merges},
    "clusterserve.kernels.triton.cluster_layout": {
        "_layout_counts_kernel": lambda a: {**_by_rows(a), "zero_stop": _by_rows(a)["start"]},  # no padding
        "_layout_scatter_kernel": _by_rows,
    },
    "clusterserve.kernels.triton.hamming": {
        "_hamming_initial_kernel": lambda a: {
            **seed_search(a), "lo": 0, "hi": -(-a["C"] * a["BLOCK_BITS"] // a["CHUNKS"]),  # its slice of the first totals
        },
        "_hamming_assign_kernel": exact_case_counts,
    },
    "clusterserve.kernels.triton.hamming_step": {
        "_hamming_step_kernel": lambda a: {
            **exact_case_counts(a), "chunk": max(0, a["N"] // a["CHUNK"] - 1),
            "lo": 0, "hi": -(-a["C"] * a["BLOCK_BITS"] // a["CHUNKS"]), "n_empty": 0.2 * (a["C"] / 100) ** 2,
        },
    },
    "clusterserve.kernels.triton.hashing": {"_hash_kernel": _by_rows},
    "clusterserve.kernels.triton.seeding": {"_seed_means_kernel": seed_search},
    "clusterserve.kernels.triton.hamming_update": {
        "_hamming_update_kernel": lambda a: {
            **cluster_range(a["C"], a["PER_PROGRAM"]), "chunk": 0, "stop": a["CHUNK"],
            "block_empties": 0.2 * (a["C"] / 100) ** 2,
        },
    },
    "clusterserve.kernels.triton.donors": {
        "_candidates_kernel": lambda a: {"start": 0, "stop": 0},
        "_means_candidates_kernel": lambda a: {**cluster_range(a["C"], a["PER_PROGRAM"]), "summed_chunks": 0,
                                               "start": 0, "stop": 0},
        "_donor_kernel": lambda a: {"wanted": 0, "empties": 0},
    },
    "clusterserve.kernels.triton.lloyd": {
        "_nearest_kernel": lambda a: {**exact_case_counts(a), "donor_lists": 0},  # no cluster empty
    },
    "clusterserve.kernels.triton.means": {
        "_sums_kernel": _by_rows,
        "_means_kernel": lambda a: cluster_range(a["C"], a["PER_PROGRAM"]),
    },
    "clusterserve.kernels.triton.smyrf": {
        "_smyrf_attention_kernel": first_tile_keys,
        "_smyrf_norms_kernel": lambda a: slowest_chunk(max(a["N"], a["M"]), a["CHUNK"]),
    },
}  # fmt: skip
