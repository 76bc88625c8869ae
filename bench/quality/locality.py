"""Where the approximate methods break on a real encoder: one document through the model with
one layer (or one head) approximated at a time, and how local each head's exact attention is.

    python -m clusterserve.bench.quality.locality [--model PATH|NAME] [--tokens 4096] [--dtype float32]
                             [--methods ...] [--head-cosines METHOD]

One exact pass captures every layer's q, k, v (a wrapper around the attention call); per layer
and head it reports, offline from those:
    mass_64, mass_256, mass_1024   the exact attention's mean mass on keys within +-64, +-256,
                                   +-1024 positions of the query
    mass_sinks                     its mean mass on the special and prompt tokens ([CLS], the
                                   prompt's tokens, [SEP])
    near_128, near_256             mass on band +-128 / +-256 together with those tokens
    rel_err[method]                ||o - o_exact|| / ||o_exact|| of that head's attention output
Then the model runs again once per (method, layer), that layer approximated and every other
exact: cosine[method] is the pooled vector's cosine to exact. --head-cosines METHOD also runs
one pass per (layer, head) with only that head approximated by METHOD (slow: layers x heads
passes).

Writes bench/results/locality-<model>-<tokens>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import clusterserve.models.networks.rotary_bert as rotary_bert
from clusterserve import kernels
from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder

from ..common import device_name, long_text_ids, print_table, write_report

DEFAULT_MODEL = "/root/.cache/clusterserve/nomic-embed-text-v1.5.f16.gguf"
RADII = (64, 256, 1024)
NEAR_RADII = (128, 256)
METHODS = {
    "clustered-200": dict(method="clustered", clusters=200, iterations=3, refine=2),
    "i-clustered-200/64": dict(method="i-clustered", clusters=200, topk=64, iterations=5, refine=3),
    "smyrf-8x128": dict(method="smyrf", hash_rounds=8, cluster_size=128),
}


@contextmanager
def layer_attention(choose: Callable[[int, Callable[..., Tensor], tuple], Tensor]):
    """Every attention call of models.networks.rotary_bert goes through choose(layer, attention, args):
    layer counts the calls of one pass (one document: one call per layer)."""
    original = rotary_bert.attention
    calls = [0]

    def wrapped(q, k, v, spec, **kwargs):
        layer = calls[0]
        calls[0] += 1
        return choose(layer, original, (q, k, v, spec), kwargs)

    rotary_bert.attention = wrapped
    try:
        yield calls
    finally:
        rotary_bert.attention = original


def capture(encoder, ids: list[int]) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]]]:
    """The exact pooled vector and each layer's q, k, v (1, H, N, D)."""
    kept: list[tuple[Tensor, Tensor, Tensor]] = []

    def choose(layer, original, args, kwargs):
        q, k, v, _ = args
        kept.append((q.contiguous().clone(), k.contiguous().clone(), v.contiguous().clone()))
        return original(q, k, v, AttentionSpec(method="full"), **kwargs)

    with layer_attention(choose):
        exact = encoder.embed([ids], AttentionSpec(method="full"), max_batch_tokens=len(ids))
    return exact, kept


def sink_positions(encoder, n: int) -> list[int]:
    """[CLS], the default prompt's tokens and [SEP] of a framed document of n tokens."""
    prompt = encoder.tokenize([encoder.prompts.text(None)])[0].ids[1:-1]
    return list(range(1 + len(prompt))) + [n - 1]


def locality(q: Tensor, k: Tensor, sinks: list[int], scale: float, block: int = 512) -> dict[str, Tensor]:
    """Per head (H,) mean exact-attention masses (see the module docstring)."""
    _, h, n, _ = q.shape
    pos = torch.arange(n)
    is_sink = torch.zeros(n, dtype=torch.bool)
    is_sink[sinks] = True
    sums = {name: torch.zeros(h, dtype=torch.float64) for name in
            [f"mass_{r}" for r in RADII] + ["mass_sinks"] + [f"near_{r}" for r in NEAR_RADII]}
    qf, kf = q[0].float(), k[0].float()
    for start in range(0, n, block):
        stop = min(n, start + block)
        probs = torch.softmax((qf[:, start:stop] @ kf.transpose(-1, -2)) * scale, dim=-1)  # (H, b, N)
        dist = (pos[None, :] - pos[start:stop, None]).abs()  # (b, N)
        for r in RADII:
            sums[f"mass_{r}"] += (probs * (dist <= r)).sum((-1, -2)).double()
        sums["mass_sinks"] += probs[..., is_sink].sum((-1, -2)).double()
        for r in NEAR_RADII:
            sums[f"near_{r}"] += (probs * ((dist <= r) | is_sink)).sum((-1, -2)).double()
    return {name: total / n for name, total in sums.items()}


def relative_error(approx: Tensor, exact: Tensor) -> Tensor:
    """Per head (H,): ||approx - exact|| / ||exact|| over the head's (N, D) output."""
    a, e = approx[0].float(), exact[0].float()
    return (a - e).norm(dim=(-1, -2)) / e.norm(dim=(-1, -2))


def pooled_cosine(
    encoder, ids: list[int], exact: Tensor, replace: Callable[[int, Tensor, Tensor, Tensor, Callable], Tensor | None]
) -> float:
    """Cosine to `exact` of a pass where layer l's attention is replace(l, q, k, v, exact_fn)
    when that returns a tensor, else exact."""

    def choose(layer, original, args, kwargs):
        q, k, v, _ = args
        out = replace(layer, q, k, v, lambda spec: original(q, k, v, spec, **kwargs))
        return original(q, k, v, AttentionSpec(method="full"), **kwargs) if out is None else out

    with layer_attention(choose):
        vec = encoder.embed([ids], AttentionSpec(method="full"), max_batch_tokens=len(ids))
    return F.cosine_similarity(vec, exact, dim=-1).item()


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--offset", type=int, default=0, help="tokens into the licence texts")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"of {list(METHODS)} or JSON AttentionSpec kwargs")
    parser.add_argument("--no-layer-cosines", action="store_true", help="skip the per-layer pooled cosines")
    parser.add_argument("--head-cosines", default=None, help="a method: one pass per (layer, head) approximated by it")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, dtype=getattr(torch, args.dtype))
    ids = long_text_ids(encoder, args.tokens, offset=args.offset)
    n = len(ids)
    sinks = sink_positions(encoder, n)
    methods = {name: METHODS[name] if name in METHODS else json.loads(name) for name in args.methods}

    start = time.perf_counter()
    exact, qkv = capture(encoder, ids)
    exact_s = time.perf_counter() - start
    print(f"{encoder.name}: {n} tokens, {len(qkv)} layers, exact pass {exact_s:.1f} s, sinks at {sinks}")
    rows = head_rows_of(qkv, sinks, methods)
    layer_rows = [] if args.no_layer_cosines else layer_cosines(encoder, ids, exact, len(qkv), methods)
    head_rows = head_cosines(encoder, ids, exact, qkv, args.head_cosines, methods) if args.head_cosines else []
    meta = dict(
        device=device_name(), model=encoder.name, dtype=args.dtype, tokens=n, sinks=sinks, exact_pass_s=round(exact_s, 2),
        text="Debian common-licenses, framed with the default prompt", methods=methods,
    )
    name = args.name or f"locality-{encoder.name.split('/')[-1].split('.')[0]}-{n}"
    path = write_report(name, dict(meta=meta, heads=rows, layers=layer_rows, head_cosines=head_rows))
    print(f"wrote {path}")


def head_rows_of(qkv: list, sinks: list[int], methods: dict[str, dict]) -> list[dict]:
    """Per layer and head: the exact attention's masses near the query and on the sinks, and each
    method's relative error to it."""
    rows = []
    for layer, (q, k, v) in enumerate(qkv):
        scale = q.shape[-1] ** -0.5
        masses = locality(q, k, sinks, scale)
        exact_out = kernels.attention(q, k, v, AttentionSpec(method="full"))
        errors = {}
        for name, knobs in methods.items():
            approx = kernels.attention(q, k, v, AttentionSpec(**knobs))
            errors[name] = relative_error(approx, exact_out)
        for head in range(q.shape[1]):
            row = dict(layer=layer, head=head, **{key: round(float(val[head]), 4) for key, val in masses.items()})
            row.update({f"err {name}": round(float(err[head]), 4) for name, err in errors.items()})
            rows.append(row)
        print_table(rows[-q.shape[1]:], list(rows[-1]))
    return rows


def layer_cosines(encoder, ids: list[int], exact: Tensor, layers: int, methods: dict[str, dict]) -> list[dict]:
    """Per method and layer: the pooled vector's cosine to exact with only that layer approximated."""
    rows = []
    for name, knobs in methods.items():
        spec = AttentionSpec(**knobs)
        for layer in range(layers):
            cos = pooled_cosine(encoder, ids, exact, lambda at, q, k, v, run: run(spec) if at == layer else None)
            rows.append(dict(method=name, layer=layer, cosine=round(cos, 5)))
            print(rows[-1], flush=True)
    return rows


def head_cosines(encoder, ids: list[int], exact: Tensor, qkv: list, method: str, methods: dict[str, dict]) -> list[dict]:
    """Per layer and head: the pooled vector's cosine to exact with only that head approximated."""
    spec = AttentionSpec(**methods[method])
    rows = []
    for layer in range(len(qkv)):
        for head in range(qkv[0][0].shape[1]):
            def replace(at, q, k, v, run, layer=layer, head=head):
                if at != layer:
                    return None
                out = run(AttentionSpec(method="full")).clone()
                out[:, head] = run(spec)[:, head]
                return out

            cos = pooled_cosine(encoder, ids, exact, replace)
            rows.append(dict(method=method, layer=layer, head=head, cosine=round(cos, 5)))
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
