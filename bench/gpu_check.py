"""`python -m bench.gpu --check`: the Triton backend against the PyTorch reference at
realistic sizes (issue #4's acceptance run on a GPU), logged under bench/results/.

Each case runs one method both ways on the model's Q, K, V of real text and reports:
- max |triton - torch| against a tolerance: 1e-4 for float32 (issue #4), and for float16 /
  bfloat16 two units in the last place of the output's largest value (both backends compute
  in float32; they may round a few outputs to neighbouring half values, and the SMYRF kernel
  rounds probabilities to the value dtype before P @ V, as flash attention does);
- how many queries the two backends put in the same cluster (for SMYRF, the same bucket in
  every round). At 64k tokens a hash projection or K-means distance within rounding of a tie
  can go either way, and one moved query changes its cluster's centroid: then whole
  clusters differ, and the useful comparison is the error of each backend to exact attention;
- the relative error of each backend to exact float32 attention.

Status: PASS within tolerance; TIES when clusters differ and the Triton error to exact is no
worse than the reference's (x1.05 + 1e-3); FAIL otherwise. Also: exactness cases through the
Triton backend (one query per cluster, top-k >= N, one SMYRF cluster), padding, queries and
keys of different lengths, head dims 32 and 128, and on a GPU, per method, host
synchronisations inside a call (torch.cuda.set_sync_debug_mode) and a CUDA-graph capture
replayed against the eager output. Exit status 1 if any case fails.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from kernels import AttentionSpec, attention
from kernels.clustered import REFERENCE
from kernels.stages import cluster_queries
from kernels.masks import token_masks
from kernels.smyrf import asymmetric_hashes, smyrf_projections

from .common import long_text_ids
from .gpu import Settings, exact_attention, real_qkv, rel_err

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


class Log:
    """Lines printed and appended to the log file as they come (a cut-short run keeps them)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        path.write_text("")
        self.failures = 0
        self.cases = 0

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def run_check(settings: Settings, encoder) -> int:
    log = Log(settings.out / f"{settings.stem}-check.log")
    import triton

    log(f"# bench.gpu --check  {time.strftime('%Y-%m-%d %H:%M:%S')}")
    log(f"# device: {settings.device_label}; torch {torch.__version__}; triton {triton.__version__}; "
        f"python {platform.python_version()}{'; DRY RUN (interpreter, tiny knobs)' if settings.dry_run else ''}")
    log(f"# heads {settings.heads}, lengths {list(settings.check_lengths)}, "
        f"dtypes {[_name(d) for d in settings.check_dtypes]}")
    specs = {label: spec for label, spec in settings.specs.items() if spec.method != "full"}
    for label, spec in specs.items():
        log(f"# {label}: {spec.used_knobs()}")
    log(f"{'case':44s} {'status':6s} {'max|tri-ref|':>12s} {'tol':>9s} {'rows>tol':>8s} {'same_cl':>7s} "
        f"{'err_tri':>9s} {'err_ref':>9s} {'s':>6s}")

    lengths = sorted(settings.check_lengths)
    texts = {}
    for n in lengths:
        texts[n] = long_text_ids(encoder, n)
        base = real_qkv(encoder, texts[n], 64, settings.heads, torch.float32)
        for dtype in settings.check_dtypes:
            q, k, v = (t.to(dtype) for t in base)
            exact = exact_attention(q, k, v, None, 1 / 8)
            for label, spec in specs.items():
                _case(log, f"N={n} d=64 {_name(dtype)} {label}", q, k, v, spec, None, exact)

    # Padding, N_q != N_k and other head dims, at a middle length.
    n = lengths[len(lengths) // 2] if len(lengths) > 1 else lengths[0]
    ids = texts[n]
    base = real_qkv(encoder, ids, 64, settings.heads, torch.float32)
    lengths_real = torch.tensor([n, int(0.7 * n)], device=settings.device)
    mask = torch.arange(n, device=settings.device)[None, :] < lengths_real[:, None]
    for dtype in settings.check_dtypes:
        q, k, v = (torch.cat([t, t]).to(dtype) for t in base)  # the same text twice, the second padded
        short = q[:, :, : n // 4]
        exact, exact_short = exact_attention(q, k, v, mask, 1 / 8), exact_attention(short, k, v, mask, 1 / 8)
        for label, spec in specs.items():
            _case(log, f"N={n} d=64 {_name(dtype)} padded {label}", q, k, v, spec, mask, exact)
            _case(log, f"Nq={n // 4} M={n} {_name(dtype)} padded {label}", short, k, v, spec, mask, exact_short)
    for head_dim in (32, 128):
        q, k, v = real_qkv(encoder, ids, head_dim, settings.heads, torch.bfloat16)
        exact = exact_attention(q, k, v, None, head_dim**-0.5)
        for label, spec in specs.items():
            _case(log, f"N={n} d={head_dim} bfloat16 {label}", q, k, v, spec, None, exact)

    _exact_cases(log, encoder, settings, min(lengths[0], 4096), specs)
    if settings.device.type == "cuda":
        _capture_cases(log, encoder, settings, lengths[-1], specs)
    log(f"# {log.cases} cases, {log.failures} failed")
    return 1 if log.failures else 0


def _case(log: Log, name: str, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mask: Tensor | None,
          exact: Tensor) -> None:
    """One method both ways at scale 1/sqrt(D); exact = exact_attention of the same inputs."""
    start = time.perf_counter()
    scale = 1.0 / math.sqrt(q.shape[-1])
    tri = attention(q, k, v, spec, key_padding_mask=mask, scale=scale, backend="triton")
    ref = attention(q, k, v, spec, key_padding_mask=mask, scale=scale, backend="reference")
    diff = (tri.float() - ref.float()).abs()
    largest = ref.float().abs().max().item()
    tol = 1e-4 if q.dtype == torch.float32 else 4 * UNIT_ROUNDOFF[q.dtype] * largest
    worst = diff.max().item()
    rows_off = (diff.amax(-1) > tol).float().mean().item()
    same = _same_clusters(q, k, spec, mask)
    err_tri, err_ref = rel_err(tri, exact), rel_err(ref, exact)
    if worst <= tol:
        status = "PASS"
    elif same < 1 and err_tri <= 1.05 * err_ref + 1e-3:
        status = "TIES"
    else:
        status = "FAIL"
    _record(log, name, status, worst, tol, rows_off, same, err_tri, err_ref, start)


def _same_clusters(q: Tensor, k: Tensor, spec: AttentionSpec, mask: Tensor | None) -> float:
    """Share of real queries that both backends put in the same cluster (SMYRF: the same
    bucket, queries and keys, averaged over rounds)."""
    key_mask, query_mask = token_masks(q, k, mask)
    if spec.method != "smyrf":
        from kernels.clustered_triton import TRITON

        same = cluster_queries(TRITON, q, query_mask, spec) == cluster_queries(REFERENCE, q.float(), query_mask, spec)
        return same.transpose(0, 1)[:, query_mask].float().mean().item()
    from kernels.smyrf_triton import smyrf_hashes_triton

    projections = smyrf_projections(spec.hash_rounds, q.shape[1], q.shape[-1], spec.seed)
    tri = smyrf_hashes_triton(q, k, mask, projections.to(q.device))
    ref = asymmetric_hashes(q.float(), k.float(), query_mask, key_mask, projections)
    n_real, m_real = query_mask.sum(1), key_mask.sum(1)
    n_clusters = torch.minimum((torch.maximum(n_real, m_real) + spec.cluster_size - 1) // spec.cluster_size,
                               torch.minimum(n_real, m_real)).clamp(min=1)
    shares = []
    for side, real, count in ((0, query_mask, n_real), (1, key_mask, m_real)):
        buckets = [_buckets(h[side], count, n_clusters) for h in (tri, ref)]
        shares.append((buckets[0] == buckets[1]).permute(0, 2, 1, 3)[:, :, real].float().mean().item())
    return sum(shares) / 2


def _buckets(hashes: Tensor, count: Tensor, n_clusters: Tensor) -> Tensor:
    """hashes (R, B, H, N) -> each token's cluster floor(rank L / count), as both backends cut."""
    rank = hashes.argsort(dim=-1, stable=True).argsort(dim=-1)
    return rank * n_clusters[None, :, None, None] // count.clamp(min=1)[None, :, None, None]


def _exact_cases(log: Log, encoder, settings: Settings, n: int, specs: dict) -> None:
    """Specs under which each method is exact attention, through the Triton backend, float32
    (n <= 4096, the largest number of clusters and top-k keys a spec takes)."""
    ids = long_text_ids(encoder, n)
    q, k, v = real_qkv(encoder, ids, 64, settings.heads, torch.float32)
    scale = 1.0 / math.sqrt(64)
    exact = exact_attention(q, k, v, None, scale)
    exact_knob = {"clustered": ("clusters", "one query per cluster"), "i-clustered": ("topk", "top-k = N"),
                  "smyrf": ("cluster_size", "one cluster")}
    for label, spec in specs.items():
        knob, what = exact_knob[spec.method]
        label, spec = f"{label}, {what}", dataclasses.replace(spec, **{knob: n})
        start = time.perf_counter()
        out = attention(q, k, v, spec, scale=scale, backend="triton")
        worst = (out.float() - exact).abs().max().item()
        status = "PASS" if worst <= 1e-4 else "FAIL"
        _record(log, f"N={n} float32 exact: {label}", status, worst, 1e-4, None, None, rel_err(out, exact), None, start)


def _capture_cases(log: Log, encoder, settings: Settings, n: int, specs: dict) -> None:
    """Per method at the longest length in bfloat16: no host sync inside a call, and a CUDA
    graph of the call replays to the eager output."""
    from .timing import capture_graph

    q, k, v = real_qkv(encoder, long_text_ids(encoder, n), 64, settings.heads, torch.bfloat16)
    for label, spec in specs.items():
        start = time.perf_counter()

        def call(spec=spec):
            return attention(q, k, v, spec, backend="triton")

        eager = call()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        status = "PASS" if not syncs else "FAIL"
        log(f"N={n} bfloat16 {label}: host syncs in one call: {len(syncs)} {status} "
            f"{'; '.join(sorted(set(syncs)))[:200]}")
        log.cases += 1
        log.failures += status == "FAIL"
        try:
            graph, out = capture_graph(call, settings.device)
            graph.replay()
            torch.cuda.synchronize()
            worst = (out.float() - eager.float()).abs().max().item()
            status = "PASS" if worst == 0 else "FAIL"
            detail = f"replay vs eager max diff {worst:.3g}"
            del graph, out
        except Exception as error:  # noqa: BLE001 - the failure is the finding
            status, detail = "FAIL", f"capture failed: {type(error).__name__}: {str(error)[:200]}"
        log(f"N={n} bfloat16 {label}: CUDA graph {status} {detail} ({time.perf_counter() - start:.1f} s)")
        log.cases += 1
        log.failures += status == "FAIL"
        torch.cuda.empty_cache()


def _record(log: Log, name, status, worst, tol, rows_off, same, err_tri, err_ref, start) -> None:
    log.cases += 1
    log.failures += status == "FAIL"
    log(f"{name:44s} {status:6s} {worst:12.3g} {tol:9.2g} {_opt(rows_off, '8.2%')} {_opt(same, '7.2%')} "
        f"{_opt(err_tri, '9.3g')} {_opt(err_ref, '9.3g')} {time.perf_counter() - start:6.1f}")


def _opt(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(value, spec) if value is not None else "-".rjust(width)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

