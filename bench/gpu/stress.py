"""Repeatability of the clustered pipelines on a GPU: the same inputs, again and again, with the
caching allocator's free memory filled between calls. A bit that changes is a race or a read of
memory no launch wrote, which Triton's interpreter (one program at a time, on CPU) cannot show.

    python -m clusterserve.bench.gpu.stress [--model DIR] [--tokens 16384] [--repeats 16]
    TRITON_INTERPRET=1 python -m clusterserve.bench.gpu.stress --tokens 64 --repeats 1   # the script on CPU

Per dtype (float32, bfloat16), method (bench.common's clustered and i-clustered) and case (a
padded batch of two copies of the text, self-attention; its first quarter of queries over all
its keys), it prints how many assignments, centroid values and output values of the fused
clustering stage and of whole calls differed from the first call, and how many assignments
the fused stage and the staged one (cluster_queries) disagree on. Fills cycle through random
bytes, 0xFF, 0x00 and 0x7F. Exits 1 if anything changed.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.stages import cluster_queries

from ..common import SPECS, gpu_script_qkv, gpu_script_setup
from .settings import dry_run_spec

FILLS = (None, 0xFF, 0x00, 0x7F)  # None: random bytes


def fill_free_memory(device: torch.device, step: int) -> None:
    """Return every cached block to the driver, then take, fill and free ~1 GiB in large blocks
    and ~8 MiB in small ones: the next allocations are carved from filled memory."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    fill = FILLS[step % len(FILLS)]
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device=device) for _ in range(4)]
    blocks += [torch.empty(kib << 10, dtype=torch.uint8, device=device)
               for kib in (1, 4, 16, 64, 256, 512) for _ in range(40)]
    for block in blocks:
        if fill is None:
            block.random_(0, 256)
        else:
            block.fill_(fill)


def differing(a: Tensor, b: Tensor) -> int:
    """Elements that differ (NaN equal to NaN)."""
    unequal = a != b
    if a.is_floating_point():
        unequal &= ~(a.isnan() & b.isnan())
    return int(unequal.sum().item())


def repeat_case(q, k, v, mask, spec: AttentionSpec, repeats: int) -> dict[str, int]:
    """The worst count of changed elements over the repeats, per output, and the fused stage's
    disagreement with the staged one."""
    from clusterserve.kernels.triton.clustered import TRITON, cluster_means_triton_stages

    query_mask = token_masks(q, k, mask)[1]

    def call():
        return attention(q, k, v, spec, key_padding_mask=mask, scale=q.shape[-1] ** -0.5, backend="triton")

    assign0, means0 = (t.clone() for t in cluster_means_triton_stages(q, query_mask, spec))
    out0 = call().clone()
    worst = dict(assign=0, means=0, out=0)
    for step in range(repeats):
        fill_free_memory(q.device, step)
        assign, means = cluster_means_triton_stages(q, query_mask, spec)
        changed = dict(assign=differing(assign, assign0), means=differing(means, means0))
        fill_free_memory(q.device, step + 1)
        changed["out"] = differing(call(), out0)
        worst = {key: max(worst[key], changed[key]) for key in worst}
    worst["fused_vs_staged"] = differing(assign0, cluster_queries(TRITON, q, query_mask, spec))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--methods", nargs="+", default=["clustered", "i-clustered"], choices=["clustered", "i-clustered"])
    args = parser.parse_args(argv)
    n = args.tokens
    device, encoder, _ = gpu_script_setup(args.model, [n])
    interpret = device.type == "cpu"
    q, k, v = (torch.cat([t, t]) for t in gpu_script_qkv(encoder, n, torch.float32))
    mask = torch.arange(n, device=device)[None, :] < torch.tensor([n, int(0.7 * n)], device=device)[:, None]
    changed = 0
    for dtype in args.dtypes:
        for label in args.methods:
            spec = dry_run_spec(SPECS[label]) if interpret else SPECS[label]
            for case, queries in (("self, padded", q), ("1/4 of the queries", q[:, :, : n // 4])):
                qd, kd, vd = (t.to(getattr(torch, dtype)) for t in (queries, k, v))
                worst = repeat_case(qd, kd, vd, mask, spec, args.repeats)
                changed += any(worst[key] for key in ("assign", "means", "out", "fused_vs_staged"))
                print(f"{dtype:9s} {label:12s} {case:19s} over {args.repeats} repeats, most elements changed: "
                      f"assignments {worst['assign']}, means {worst['means']}, output {worst['out']}; "
                      f"fused vs staged assignments {worst['fused_vs_staged']}", flush=True)
    print("cases with a change:", changed)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
