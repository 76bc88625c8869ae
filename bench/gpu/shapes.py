"""Launch shapes of the Triton pipelines on a GPU: the same calls timed in a CUDA graph under
other program counts, warps and key tiles than the shipped ones, in one run, so that a shape
the cost model cannot judge (occupancy against latency) is decided by measurement.

    python -m clusterserve.bench.gpu.shapes [--model DIR] [--lengths 4096 16384] [--out DIR] [--name STEM]
    TRITON_INTERPRET=1 python -m clusterserve.bench.gpu.shapes --lengths 64   # the script on CPU

Per method, length and variant: the median time of the call replayed from a CUDA graph
(`graph_ms`; eager on CPU), its ratio to the shipped shape's, and its output's relative error
to the shipped shape's output (0 when the variant computes the same: the K-means' votes are
integers, but chunk boundaries change the order of the float sums of the refinement) and to
exact attention. A variant patches module constants of kernels.triton for its calls only.
Writes <STEM>-shapes.json under --out (default bench/out/gpu), again after every row.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from clusterserve.kernels import attention

from ..common import device_name, exact_attention, gpu_script_qkv, gpu_script_setup, rel_err
from ..timing import capture_graph, median_ms
from .settings import SPECS, dry_run_spec, slug

CLUSTERED = ("clustered (default)", "i-clustered (default)")
# name -> (methods it applies to, {"module.attribute": value}); "shipped" is the reference.
VARIANTS = {
    "shipped": (CLUSTERED + ("banded",), {}),
    **{name: (CLUSTERED, {"clusterserve.kernels.triton.helpers.TARGET_PROGRAMS": programs})
       for name, programs in (("programs x2", 528), ("programs x4", 1056), ("programs /2", 132))},
    "Hamming 8 warps": (CLUSTERED, {"clusterserve.kernels.triton.hamming.NUM_WARPS": 8}),
    **{f"means {per} a program, {group} chunks a load": (CLUSTERED, {"clusterserve.kernels.triton.means.PER_PROGRAM": per,
                                                                     "clusterserve.kernels.triton.means.SUMS_GROUP": group})
       for per, group in ((8, 8), (2, 32))},
    **{f"top-k {rows} centroids a program": (CLUSTERED[1:], {"clusterserve.kernels.triton.centroid_topk.TOPK_BLOCK_C": rows})
       for rows in (32, 16)},
    "merges 8 splits a load": (CLUSTERED, {"clusterserve.kernels.triton.centroid.COMBINE_SPLITS": 8}),
    "banded 128-key tiles": (("banded",), {"clusterserve.kernels.triton.banded.key_tile": lambda head_dim, dtype, interpreted:
                                           16 if interpreted else 128 if head_dim <= 64 and dtype != torch.float32
                                           else 64}),
}


@contextmanager
def patched(overrides: dict):
    """Module attributes set to other values for the duration, then restored."""
    saved = []
    try:
        for path, value in overrides.items():
            module, name = path.rsplit(".", 1)
            target = importlib.import_module(module)
            saved.append((target, name, getattr(target, name)))
            setattr(target, name, value)
        yield
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)


def time_call(call, device: torch.device, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of call replayed from a CUDA graph (eager off CUDA), and its output."""
    if device.type != "cuda":
        out = call()
        return median_ms(call, device, repeats, 0), out
    graph, out = capture_graph(call, device)
    ms = median_ms(graph.replay, device, repeats, 3)
    out = out.clone()
    del graph
    return ms, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu"))
    parser.add_argument("--name", help="file stem (default <date>-<gpu>)")
    args = parser.parse_args(argv)
    device, encoder, dtype = gpu_script_setup(args.model, args.lengths)
    interpret = device.type == "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{datetime.date.today().isoformat()}-{slug('cpu-interpret' if interpret else device_name())}"
    path = args.out / f"{stem}-shapes.json"
    rows = []
    for n in args.lengths:
        q, k, v = gpu_script_qkv(encoder, n, dtype)
        scale = q.shape[-1] ** -0.5
        exact = exact_attention(q, k, v, None, scale)
        for label in (*CLUSTERED, "banded"):
            spec = dry_run_spec(SPECS[label]) if interpret else SPECS[label]
            shipped_ms = shipped_out = None
            for variant in ["shipped", *(name for name in args.variants if name != "shipped")]:
                methods, overrides = VARIANTS[variant]
                if label not in methods:
                    continue
                with patched(overrides):
                    ms, out = time_call(lambda: attention(q, k, v, spec, scale=scale, backend="triton"), device,
                                        args.repeats)
                if variant == "shipped":
                    shipped_ms, shipped_out = ms, out
                row = dict(method=label, tokens=n, variant=variant, graph_ms=round(ms, 4),
                           vs_shipped=round(ms / shipped_ms, 3) if shipped_ms else None,
                           err_to_shipped=rel_err(out, shipped_out) if shipped_out is not None else None,
                           err_to_exact=rel_err(out, exact), device=device_name())
                rows.append(row)
                path.write_text(json.dumps(rows, indent=1) + "\n")  # after every row: a run cut short keeps them
                print(f"{label:22s} {n:6d} {variant:38s} {ms:8.3f} ms  x{row['vs_shipped'] or 0:.3f} of shipped  "
                      f"err to shipped {row['err_to_shipped'] or 0:.2e}, to exact {row['err_to_exact']:.3f}", flush=True)
                del out
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
