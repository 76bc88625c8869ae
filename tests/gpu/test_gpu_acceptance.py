"""The Triton backend against the PyTorch reference at realistic sizes, on a GPU.

    python -m pytest -m gpu tests/gpu -rA -s        # on a CUDA machine; bench/README.md

Every case runs one method both ways on the default model's Q, K, V of real text
(bench.common.real_qkv) and compares:
- max |triton - torch| against a tolerance: 1e-4 for float32, and for float16 / bfloat16 two
  units in the last place of the output's largest value (both backends compute in float32;
  they may round a few outputs to neighbouring half values, and the SMYRF and banded kernels
  round probabilities to the value dtype before P @ V, as flash attention does);
- the share of queries that the two backends put in the same cluster (SMYRF: the same
  bucket in every round; banded: the same far blocks for a query block). At 64k tokens a
  hash projection or K-means distance within rounding of a tie can go either way, and one
  moved query moves its cluster's centroid: whole clusters then differ, and the useful
  comparison is each backend's error to exact float32 attention.

A case passes within tolerance, or when clusters differ and the Triton error to exact is no
worse than the reference's (x1.05 + 1e-3). The reference runs under torch's deterministic
algorithms, so that its clusters and its output come from the same sums. Also: exactness
cases through the Triton backend (one query per cluster, top-k >= N, one SMYRF cluster, a
band over the sequence), padding, queries and keys of different lengths (not banded:
self-attention only), head dims 32 and 128, and on CUDA, per method, host synchronisations
inside a call and a CUDA-graph capture replayed against the eager output. Each case prints
one line of figures (run with -s to see them).

Without CUDA the module skips. With GPU_TEST_DRY_RUN=1 and TRITON_INTERPRET=1 it runs on CPU
through Triton's interpreter at 64 tokens with tiny knobs (tests/bench runs it so): that
tests this module, not the kernels' speed or scale. GPU_TEST_MODEL names a checkpoint folder
(default: the embedded all-MiniLM-L6-v2); GPU_TEST_LENGTHS overrides the lengths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
import warnings

import pytest
import torch
from torch import Tensor

from clusterserve.bench.common import SPECS, exact_attention, long_text_ids, real_qkv, rel_err
from clusterserve.bench.gpu.settings import dry_run_spec
from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.clustered import REFERENCE
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.reference.smyrf import asymmetric_hashes, smyrf_cluster_count, smyrf_projections
from clusterserve.kernels.stages import cluster_queries

pytestmark = pytest.mark.gpu

DRY_RUN = not torch.cuda.is_available() and os.environ.get("GPU_TEST_DRY_RUN") == "1"
if not torch.cuda.is_available() and not (DRY_RUN and os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA (or GPU_TEST_DRY_RUN=1 and TRITON_INTERPRET=1 on CPU)", allow_module_level=True)

DEVICE = torch.device("cpu" if DRY_RUN else "cuda")
HEADS = 2 if DRY_RUN else 12
LENGTHS = [int(n) for n in os.environ.get("GPU_TEST_LENGTHS", "64" if DRY_RUN else "4096 16384 65536").split()]
MIDDLE = sorted(LENGTHS)[len(LENGTHS) // 2]  # padding, N_q != N_k and other head dims
DTYPES = [torch.bfloat16] if DRY_RUN else [torch.float32, torch.float16, torch.bfloat16]
METHODS = ["i-clustered", "smyrf", "banded"] if DRY_RUN else [label for label, spec in SPECS.items() if spec.method != "full"]
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def spec_of(label: str) -> AttentionSpec:
    return dry_run_spec(SPECS[label]) if DRY_RUN else SPECS[label]


@functools.lru_cache(maxsize=1)
def encoder():
    from clusterserve.models import load_encoder

    longest = max(max(LENGTHS), 32768)
    return load_encoder(os.environ.get("GPU_TEST_MODEL"), max_input_tokens=longest, device=DEVICE, dtype=torch.float32)


@functools.lru_cache(maxsize=4)
def text_qkv(n: int, head_dim: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """float32 q, k, v of n tokens of real text, HEADS heads of head_dim."""
    with torch.inference_mode():
        return real_qkv(encoder(), long_text_ids(encoder(), n), head_dim, HEADS, torch.float32)


@functools.lru_cache(maxsize=2)
def exact_for(n: int, dtype: torch.dtype, head_dim: int = 64) -> Tensor:
    q, k, v = (t.to(dtype) for t in text_qkv(n, head_dim))
    return exact_attention(q, k, v, None, head_dim**-0.5)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@contextlib.contextmanager
def deterministic():
    """The reference's cluster sums (index_add_) add with float atomics on CUDA, in whatever
    order the threads run: two reference calls on the same inputs can break a K-means near-tie
    differently, and the tie rule compares the clusters of one call with the output of another.
    Deterministic algorithms fix the order; warn_only lets ops that have none run as they are."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def compare(name: str, q: Tensor, k: Tensor, v: Tensor, label: str, mask: Tensor | None, exact: Tensor) -> None:
    """One method both ways at scale 1/sqrt(D); exact = exact_attention of the same inputs.
    Prints the case's figures; fails unless within tolerance or a tie as the docstring says."""
    start = time.perf_counter()
    spec = spec_of(label)
    scale = 1.0 / math.sqrt(q.shape[-1])
    tri = attention(q, k, v, spec, key_padding_mask=mask, scale=scale, backend="triton")
    with deterministic():
        ref = attention(q, k, v, spec, key_padding_mask=mask, scale=scale, backend="reference")
    diff = (tri.float() - ref.float()).abs()
    tol = 1e-4 if q.dtype == torch.float32 else 4 * UNIT_ROUNDOFF[q.dtype] * ref.float().abs().max().item()
    worst = diff.max().item()
    rows_off = (diff.amax(-1) > tol).float().mean().item()
    same = same_clusters(q, k, spec, mask)
    err_tri, err_ref = rel_err(tri, exact), rel_err(ref, exact)
    if worst <= tol:
        status = "PASS"
    elif same < 1 and err_tri <= 1.05 * err_ref + 1e-3:
        status = "TIES"
    else:
        status = "FAIL"
    print(f"\n{name:44s} {status:6s} max|tri-ref| {worst:.3g} tol {tol:.2g} rows>tol {rows_off:.2%} "
          f"same_clusters {same:.2%} err_tri {err_tri:.3g} err_ref {err_ref:.3g} {time.perf_counter() - start:.1f} s")
    assert status != "FAIL", f"{name}: max diff {worst:.3g} > {tol:.2g}, error to exact {err_tri:.3g} vs {err_ref:.3g}"


def same_clusters(q: Tensor, k: Tensor, spec: AttentionSpec, mask: Tensor | None) -> float:
    """Share of real queries that both backends put in the same cluster (SMYRF: the same
    bucket, queries and keys, averaged over rounds)."""
    key_mask, query_mask = token_masks(q, k, mask)
    if spec.method == "banded":
        from clusterserve.kernels.reference import banded as reference
        from clusterserve.kernels.triton.banded_pool import pool
        from clusterserve.kernels.triton.banded_select import select

        scale = 1.0 / math.sqrt(q.shape[-1])
        tri = select(q, pool(k, k, key_mask, spec), key_mask, spec, scale).chosen
        ref = reference.select(q.float(), reference.pool(k.float(), k.float(), key_mask, spec), key_mask, spec, scale)
        return (tri == ref.chosen).all(dim=-1).float().mean().item()
    if spec.method != "smyrf":
        from clusterserve.kernels.triton.clustered import TRITON

        with deterministic():
            expected = cluster_queries(REFERENCE, q.float(), query_mask, spec)
        same = cluster_queries(TRITON, q, query_mask, spec) == expected
        return same.transpose(0, 1)[:, query_mask].float().mean().item()
    from clusterserve.kernels.triton.smyrf import smyrf_hashes_triton

    projections = smyrf_projections(spec.hash_rounds, q.shape[1], q.shape[-1], spec.seed)
    tri = smyrf_hashes_triton(q, k, mask, projections.to(q.device))
    ref = asymmetric_hashes(q.float(), k.float(), query_mask, key_mask, projections)
    n_real, m_real = query_mask.sum(1), key_mask.sum(1)
    n_clusters = smyrf_cluster_count(n_real, m_real, spec.cluster_size)
    shares = []
    for side, real, count in ((0, query_mask, n_real), (1, key_mask, m_real)):
        buckets = [_buckets(h[side], count, n_clusters) for h in (tri, ref)]
        shares.append((buckets[0] == buckets[1]).permute(0, 2, 1, 3)[:, :, real].float().mean().item())
    return sum(shares) / 2


def _buckets(hashes: Tensor, count: Tensor, n_clusters: Tensor) -> Tensor:
    """hashes (R, B, H, N) -> each token's cluster floor(rank L / count), as both backends cut."""
    rank = hashes.argsort(dim=-1, stable=True).argsort(dim=-1)
    return rank * n_clusters[None, :, None, None] // count.clamp(min=1)[None, :, None, None]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("label", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("n", LENGTHS)
def test_matches_reference(n, dtype, label):
    q, k, v = (t.to(dtype) for t in text_qkv(n))
    compare(f"N={n} d=64 {_name(dtype)} {label}", q, k, v, label, None, exact_for(n, dtype))


def padded_batch(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The same text twice at MIDDLE tokens, the second copy padded to 70%."""
    n = MIDDLE
    q, k, v = (torch.cat([t, t]).to(dtype) for t in text_qkv(n))
    lengths = torch.tensor([n, int(0.7 * n)], device=DEVICE)
    mask = torch.arange(n, device=DEVICE)[None, :] < lengths[:, None]
    return q, k, v, mask


@pytest.mark.parametrize("label", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_padded_batch_matches_reference(dtype, label):
    q, k, v, mask = padded_batch(dtype)
    compare(f"N={MIDDLE} d=64 {_name(dtype)} padded {label}", q, k, v, label, mask,
            exact_attention(q, k, v, mask, 1 / 8))


@pytest.mark.parametrize("label", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_fewer_queries_than_keys_matches_reference(dtype, label):
    if spec_of(label).method == "banded":
        pytest.skip("banded attention is self-attention: queries and keys share positions")
    q, k, v, mask = padded_batch(dtype)
    short = q[:, :, : MIDDLE // 4]
    compare(f"Nq={MIDDLE // 4} M={MIDDLE} {_name(dtype)} padded {label}", short, k, v, label, mask,
            exact_attention(short, k, v, mask, 1 / 8))


@pytest.mark.parametrize("label", METHODS)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_other_head_dims_match_reference(head_dim, label):
    q, k, v = (t.to(torch.bfloat16) for t in text_qkv(MIDDLE, head_dim))
    compare(f"N={MIDDLE} d={head_dim} bfloat16 {label}", q, k, v, label, None,
            exact_for(MIDDLE, torch.bfloat16, head_dim))


EXACT_KNOB = {"clustered": ("clusters", "one query per cluster"), "i-clustered": ("topk", "top-k = N"),
              "smyrf": ("cluster_size", "one cluster"), "banded": ("band", "a band over the sequence")}


@pytest.mark.parametrize("label", METHODS)
def test_exact_specs_give_exact_attention(label):
    """Specs under which each method is exact attention, through the Triton backend, float32
    (n <= 4096, the largest number of clusters and top-k keys a spec takes)."""
    n = min(min(LENGTHS), 4096)
    q, k, v = text_qkv(n)
    spec = spec_of(label)
    knob, what = EXACT_KNOB[spec.method]
    out = attention(q, k, v, dataclasses.replace(spec, **{knob: n}), scale=1 / 8, backend="triton")
    exact = exact_for(n, torch.float32)
    worst = (out.float() - exact).abs().max().item()
    print(f"\nN={n} float32 exact: {label}, {what}: max|out-exact| {worst:.3g} rel_err {rel_err(out, exact):.3g}")
    assert worst <= 1e-4


def longest_bf16_call(label: str):
    q, k, v = (t.to(torch.bfloat16) for t in text_qkv(max(LENGTHS)))
    spec = spec_of(label)
    return lambda: attention(q, k, v, spec, backend="triton")


@pytest.mark.skipif(DRY_RUN, reason="host synchronisation is a CUDA matter")
@pytest.mark.parametrize("label", METHODS)
def test_no_host_sync_inside_a_call(label):
    call = longest_bf16_call(label)
    call()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Setting the mode warns once that it is a prototype; that warning is not a synchronisation.
    syncs = sorted({str(w.message).splitlines()[0] for w in caught
                    if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)})
    print(f"\nN={max(LENGTHS)} bfloat16 {label}: host syncs in one call: {len(syncs)} {'; '.join(syncs)[:200]}")
    assert not syncs


@pytest.mark.skipif(DRY_RUN, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("label", METHODS)
def test_cuda_graph_replays_the_eager_output(label):
    from clusterserve.bench.timing import capture_graph

    call = longest_bf16_call(label)
    eager = call()
    graph, out = capture_graph(call, DEVICE)
    graph.replay()
    torch.cuda.synchronize()
    worst = (out.float() - eager.float()).abs().max().item()
    print(f"\nN={max(LENGTHS)} bfloat16 {label}: CUDA graph replay vs eager max diff {worst:.3g}")
    assert worst == 0
    del graph, out
    torch.cuda.empty_cache()
