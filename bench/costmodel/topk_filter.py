"""How much work the centroid top-k's filter leaves on real text (kernels/triton/centroid_topk.py), on
the CPU: the filter of `_centroid_topk_kernel` replayed on a model's projections, per length.

    python -m clusterserve.bench.costmodel.topk_filter [--model nomic] [--lengths 4096 8192 16384 32768 65536]
        [--head-dim D] [--lanes rotated mod]

i-clustered 100/32 (the benchmark's) clusters layer 0's queries with the reference; then, per
head and cluster, the threshold is the TOP-th largest of the 2 TOP lane maxima of the centroid's
logits, and the top-k kernel's programs (TOPK_BLOCK_C centroids, one split of the keys) scan
their blocks of TOPK_BLOCK_M keys: a candidate is a logit at or above the row's floor (first
its threshold), appended to the row's buffer of TOPK_BUFFER; when a row's buffer could not
take another block's, the program merges all its buffers into the kept keys (as many chunks
of TOP keys as its fullest buffer holds), after which a row that keeps TOP keys takes only
logits above the least of them; and once more at the end. Printed per length and lane
scheme: keys at or above the threshold per row (mean, max), the chunks a program merges
(mean, and the slowest program's: its merges within the split, their chunks, and its last
merge's chunks), also in bench/results/NAME.json; bench.costmodel.loop_bounds reads the slowest
program's from bench/results/topk-filter-nomic.json. `rotated` is the kernel's lanes (a key's
column in its block, rotated by _lane_shift); `mod` is key index mod 2 TOP, for comparison.
"""

from __future__ import annotations

import argparse

import torch
import triton

from clusterserve.kernels.reference.clustered import REFERENCE
from clusterserve.kernels.reference.kmeans import cluster_means
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.triton.centroid import LOG2E
from clusterserve.kernels.triton.centroid_topk import THRESHOLD_MARGIN, TOPK_BLOCK_C, TOPK_BLOCK_M, TOPK_BUFFER
from clusterserve.kernels.triton.helpers import key_splits

from ..common import SPECS, long_text_ids, print_table, real_qkv, write_report


def lane_shift(block: torch.Tensor, block_m: int) -> torch.Tensor:
    """clusterserve.kernels.triton.centroid._lane_shift on a tensor of block indices."""
    return (((block & 0x7FFF) * 40503) & 0xFFFF) * block_m >> 16


def lanes_of(m: int, block_m: int, lanes: int, scheme: str) -> torch.Tensor:
    index = torch.arange(m)
    if scheme == "mod":
        return index % lanes
    # The kernel loads key start + (j + shift) % BLOCK_M into column j: key i is in column
    # (i - start - shift) mod BLOCK_M.
    return ((index % block_m) - lane_shift(index // block_m, block_m)) % block_m % lanes


def centroid_logits(encoder, n: int, head_dim: int | None = None) -> tuple[torch.Tensor, int]:
    """Base-2 logits (H, C, M) of i-clustered 100/32's centroids against the keys of layer 0 (at
    a multiple of the model's head dim, its first layers' heads side by side, as bench.gpu.speed
    does: bench.common.real_qkv); TOP."""
    spec = SPECS["i-clustered"]
    config = encoder.model.config
    q, k, _ = real_qkv(encoder, long_text_ids(encoder, n), head_dim or config.head_dim, config.num_heads, torch.float32)
    query_mask = token_masks(q, q, None)[1]
    assign = REFERENCE.refine(q, REFERENCE.cluster(REFERENCE.hash(q, spec), query_mask, spec), query_mask, spec)
    means = cluster_means(q, assign, spec.clusters)
    return (means @ k.transpose(-1, -2))[0] * q.shape[-1] ** -0.5 * LOG2E, triton.next_power_of_2(spec.topk)


def replay(logits: torch.Tensor, top: int, scheme: str) -> dict:
    """The filter's work on (H, C, M) logits under a lane scheme: keys at or above each row's
    threshold, and per program (TOPK_BLOCK_C rows, one split) its merges of full buffers
    within the split, their TOP-key chunks, and the chunks its last merge takes (the kernel's
    loop bounds)."""
    heads, clusters, m = logits.shape
    block_m, lanes = max(64, 2 * top), 2 * top
    lane = lanes_of(m, block_m, lanes, scheme).expand(heads, clusters, m)
    maxima = torch.full((heads, clusters, lanes), float("-inf")).scatter_reduce(-1, lane, logits, "amax")
    threshold = maxima.topk(top, dim=-1).values[..., -1]
    threshold = threshold - THRESHOLD_MARGIN * (threshold.abs() + 1)
    above = (logits >= threshold[..., None]).sum(-1).float()
    blocks = triton.cdiv(clusters, TOPK_BLOCK_C)
    splits, chunk = key_splits(m, heads * blocks, block_m)
    buffer = max(TOPK_BUFFER, top)
    merges, inner, last, chunks = [], [], [], []
    for head in range(heads):
        for first in range(0, clusters, TOPK_BLOCK_C):
            rows = slice(first, min(clusters, first + TOPK_BLOCK_C))
            for split in range(splits):
                begin = split * chunk
                floor = threshold[head, rows]
                count = torch.zeros(floor.numel(), dtype=torch.int64)
                full = taken = 0
                for start in range(begin, min(m, begin + chunk), TOPK_BLOCK_M):
                    count += (logits[head, rows, start : start + TOPK_BLOCK_M] >= floor[:, None]).sum(1)
                    if int(count.max()) > buffer - TOPK_BLOCK_M:
                        full += 1
                        taken += triton.cdiv(int(count.max()), top)
                        count[:] = 0
                        # Every key so far at or above its floor was buffered, so the kept keys are
                        # the split's TOP largest so far (where that many reached the threshold).
                        seen = logits[head, rows, begin : start + TOPK_BLOCK_M]
                        least = seen.topk(min(top, seen.shape[-1]), dim=-1).values[:, -1]
                        risen = torch.nextafter(least, torch.full_like(least, float("inf")))
                        floor = torch.where(least >= threshold[head, rows], torch.maximum(floor, risen), floor)
                merges.append(full)
                inner.append(taken)
                last.append(triton.cdiv(int(count.max()), top))
                chunks.append(taken + max(last[-1], 0 if full else 1))
    slowest = max(range(len(chunks)), key=chunks.__getitem__)
    return dict(keys_above_mean=above.mean().item(), keys_above_max=above.max().item(),
                chunks_mean=sum(chunks) / len(chunks), chunks_max=chunks[slowest], merges_max=merges[slowest],
                inner_chunks_max=inner[slowest], last_max=last[slowest], blocks=triton.cdiv(chunk, TOPK_BLOCK_M))


def main() -> None:
    from clusterserve.models import load_encoder

    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="nomic", help="a load_encoder name or folder (default: nomic)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--head-dim", type=int, help="default: the model's (64 for nomic; bench.gpu.speed runs 64)")
    parser.add_argument("--name", default="topk-filter", help="report: bench/results/NAME.json")
    parser.add_argument("--lanes", nargs="+", default=["rotated", "mod"], choices=["rotated", "mod"])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, max_input_tokens=max(max(args.lengths), 8192))
    rows = []
    for n in args.lengths:
        logits, top = centroid_logits(encoder, n, args.head_dim)
        for scheme in args.lanes:
            rows.append(dict(model=encoder.name, tokens=n, lanes=scheme, top=top, **replay(logits, top, scheme)))
            print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    path = write_report(args.name, dict(label="the centroid top-k's filter replayed on the CPU", rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
