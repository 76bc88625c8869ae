"""How many Lloyd iterations i-clustered's K-means needs on a real encoder, and whether
clusters carried over from the previous layer (a warm start) need fewer.

    python -m clusterserve.bench.quality.convergence [--model PATH|NAME] [--tokens 4096 8192] [--dtype float32]

One exact pass captures every layer's q, k, v (bench.quality.locality). Per layer and head, on the
native backend with i-clustered 100/32's hashes:
    cold_iterations   Hamming iterations until the centroids repeat, from the paper's start
                      (evenly spaced ranks), capped at CAP; the device skips a head's later
                      iterations, but a launch lasts as long as its slowest head
    warm_iterations   the same from the previous layer's final clusters: each centroid the
                      majority vote of this layer's codes over that cluster's members
    refine_steps      Euclidean Lloyd steps after the paper's 10 Hamming iterations until the
                      assignments repeat, capped at CAP
Then whole passes with every layer approximated, per variant (cold or warm, Hamming
iterations, refinement steps): the pooled vector's cosine to exact attention. A warm layer
starts from the previous layer's final clusters; layer 0 runs 10 / 3. Then, on other
stretches of the texts (SAMPLES), the served counts against 5 / 3 and against one refinement
step fewer (0 / 2), for i-clustered and clustered 100.

Writes bench/results/convergence-<model>.json. The GPU cost of an iteration is the offline
model's (bench.costmodel.gpu_model); these figures say how many of them a call really needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.native import hamming_kmeans, refine_clusters
from clusterserve.kernels.native.clustered import NATIVE
from clusterserve.kernels.reference.hashing import unpack_bits
from clusterserve.kernels.reference.kmeans import initial_centroid_positions, initial_offsets
from clusterserve.kernels.stages import run_clustered
from clusterserve.models import load_encoder

from ..common import device_name, long_text_ids, print_table, write_report
from .locality import DEFAULT_MODEL, capture, layer_attention

# The paper's 10 Hamming iterations, then 3 refinement steps: where the chains start.
BASE = AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=10, refine=3)
CAP = 40
# (name, warm, Hamming iterations, refinement steps)
VARIANTS = (
    ("cold 10/3", False, 10, 3),
    ("cold 5/3", False, 5, 3),
    ("cold 0/3 (served)", False, 0, 3),
    ("cold 0/2", False, 0, 2),
    ("cold 0/1", False, 0, 1),
    ("cold 3/1", False, 3, 1),
    ("warm 3/1", True, 3, 1),
    ("cold 2/0", False, 2, 0),
    ("warm 2/0", True, 2, 0),
    ("warm 1/0", True, 1, 0),
)
# Other stretches of the texts, (tokens, offset in tokens): the served counts against 5 / 3 and
# against 0 / 2 for both clustered methods, differences that one stretch of text cannot settle
# (0 / 2 is the cheaper count the offline GPU model prices at short lengths).
SAMPLES = ((2048, 5000), (2048, 20000), (3072, 12000), (4096, 10000), (4096, 30000), (8192, 20000))
COMPARED = tuple(v for v in VARIANTS if v[0] in ("cold 5/3", "cold 0/3 (served)", "cold 0/2"))


def cold_initial(codes: Tensor, mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The paper's initial centroid codes (B, H, C): the codes at evenly spaced ranks."""
    positions = initial_centroid_positions(mask, spec.clusters, initial_offsets(codes.shape[1], spec.seed))
    return codes.gather(2, positions)


def warm_initial(codes: Tensor, mask: Tensor, previous: Tensor, spec: AttentionSpec) -> Tensor:
    """Centroid codes (B, H, C) from the previous layer's assignments: the majority vote of
    this layer's codes over each cluster's members (ties to 0); an empty cluster starts as
    the cold start's."""
    b, h, n = codes.shape
    ones = torch.zeros(b, h, spec.clusters + 1, spec.bits)
    ones.scatter_add_(2, previous[..., None].expand(-1, -1, -1, spec.bits), unpack_bits(codes, spec.bits))
    members = torch.zeros(b, h, spec.clusters + 1).scatter_add_(2, previous, torch.ones(b, h, n))
    majority = (2 * ones > members[..., None]).long()[:, :, : spec.clusters]
    packed = (majority << torch.arange(spec.bits)).sum(-1)
    return torch.where(members[:, :, : spec.clusters] > 0, packed, cold_initial(codes, mask, spec))


def settled_at(chain: list[Tensor]) -> list[int]:
    """Per head: the first step after which the chain's assignments (B, H, N) repeat, CAP if
    none does within it."""
    last = len(chain) - 1
    return [next((i for i in range(last) if torch.equal(chain[i][:, h], chain[i + 1][:, h])), last)
            for h in range(chain[0].shape[1])]


def hamming_chain(codes: Tensor, mask: Tensor, initial: Tensor, spec: AttentionSpec) -> list[Tensor]:
    """The assignments after 0, 1, ..., CAP Hamming iterations from `initial`."""
    return [hamming_kmeans(codes, mask, initial, i, spec.bits) for i in range(CAP + 1)]


def refine_chain(q: Tensor, assign: Tensor, mask: Tensor, spec: AttentionSpec) -> list[Tensor]:
    """The assignments after 0, 1, ..., CAP Euclidean steps from `assign` (a step depends only
    on the assignments it starts from, so step k is refine_clusters' k steps)."""
    chain = [assign]
    for _ in range(CAP):
        chain.append(refine_clusters(q, chain[-1], mask, spec.clusters, 1))
    return chain


def iterations_to_converge(codes: Tensor, mask: Tensor, initial: Tensor, spec: AttentionSpec) -> list[int]:
    """Per head: the Hamming iterations after which the assignments no longer change (the
    centroids repeat one iteration later), CAP if they still change then."""
    return settled_at(hamming_chain(codes, mask, initial, spec))


def pass_cosine(encoder, ids: list[int], exact: Tensor, warm: bool, iterations: int, refine: int,
                method: str = "i-clustered", bits: int = BASE.bits) -> float:
    """The pooled vector's cosine to `exact` with every layer's attention `method` 100(/32)
    (iterations, refine, bits: 0 seeds in Euclidean space); warm: each layer after the first
    starts from the previous one's clusters."""
    carried: list[Tensor] = []
    base = dataclasses.replace(BASE, method=method)

    def choose(layer, original, args, kwargs):
        q, k, v, _ = args
        spec = base if warm and layer == 0 else dataclasses.replace(base, iterations=iterations, refine=refine, bits=bits)

        def observe(name, stage, *stage_args):
            if name == "cluster" and warm and carried:
                codes, mask = stage_args[0], stage_args[1]
                assign = hamming_kmeans(codes, mask, warm_initial(codes, mask, carried[-1], spec), spec.iterations, spec.bits)
            else:
                assign = stage(*stage_args)
            if name == "refine" or (name == "cluster" and not spec.refine):
                carried.append(assign)
            return assign

        scale = q.shape[-1] ** -0.5
        return run_clustered(NATIVE, q, k, v, spec, None, scale, observe).to(q.dtype)

    with layer_attention(choose):
        vector = encoder.embed([ids], AttentionSpec(method="full"), max_batch_tokens=len(ids))
    return F.cosine_similarity(vector, exact, dim=-1).item()


def summarize(head_rows: list[dict]) -> list[dict]:
    """Per length, per layer: the slowest head's iterations (what a launch waits for)."""
    summary = []
    for tokens in sorted({r["tokens"] for r in head_rows}):
        layers: dict[int, list[dict]] = {}
        for r in head_rows:
            if r["tokens"] == tokens:
                layers.setdefault(r["layer"], []).append(r)
        slowest = {key: [max(r[key] for r in rows) if rows[0][key] is not None else None for rows in layers.values()]
                   for key in ("cold_iterations", "warm_iterations", "refine_steps")}
        summary.append(dict(tokens=tokens, **{f"slowest_head_{key}": value for key, value in slowest.items()}))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, dtype=getattr(torch, args.dtype))
    head_rows, pass_rows = [], []
    for tokens in args.tokens:
        ids = long_text_ids(encoder, tokens)
        start = time.perf_counter()
        exact, qkv = capture(encoder, ids)
        print(f"{encoder.name}: {len(ids)} tokens, exact pass {time.perf_counter() - start:.1f} s", flush=True)
        previous = None
        for layer, (q, _k, _v) in enumerate(qkv):
            q = q.float().contiguous()
            mask = torch.ones(1, q.shape[2], dtype=torch.bool)
            codes = NATIVE.hash(q, BASE)
            hamming = hamming_chain(codes, mask, cold_initial(codes, mask, BASE), BASE)
            refined = refine_chain(q, hamming[BASE.iterations], mask, BASE)
            cold, steps = settled_at(hamming), settled_at(refined)
            warm = iterations_to_converge(codes, mask, warm_initial(codes, mask, previous, BASE), BASE) if layer else cold
            previous = refined[BASE.refine]  # the clusters after 10 / 3, which the next layer's warm start reads
            for head in range(q.shape[1]):
                head_rows.append(dict(tokens=len(ids), layer=layer, head=head, cold_iterations=cold[head],
                                      warm_iterations=warm[head] if layer else None, refine_steps=steps[head]))
            print(f"layer {layer}: cold max {max(cold)} mean {sum(cold) / len(cold):.1f}, "
                  f"warm max {max(warm)} mean {sum(warm) / len(warm):.1f}, refine max {max(steps)}", flush=True)
        for name, warm_start, iterations, refine in VARIANTS:
            cosine = pass_cosine(encoder, ids, exact, warm_start, iterations, refine)
            pass_rows.append(dict(tokens=len(ids), variant=name, warm=warm_start, iterations=iterations, refine=refine,
                                  cosine=round(cosine, 5)))
            print(pass_rows[-1], flush=True)

    sample_rows = []
    for tokens, offset in SAMPLES:
        ids = long_text_ids(encoder, tokens, offset=offset)
        exact = encoder.embed([ids], AttentionSpec(method="full"), max_batch_tokens=len(ids))
        for method in ("i-clustered", "clustered"):
            for name, _warm, iterations, refine in COMPARED:
                cosine = pass_cosine(encoder, ids, exact, False, iterations, refine, method)
                sample_rows.append(dict(tokens=len(ids), offset=offset, method=method, variant=name,
                                        cosine=round(cosine, 5)))
                print(sample_rows[-1], flush=True)

    summary = summarize(head_rows)
    print_table(pass_rows, list(pass_rows[0]))
    print_table(sample_rows, list(sample_rows[0]))
    for row in summary:
        print(row)
    meta = dict(device=device_name(), model=encoder.name, dtype=args.dtype, spec=BASE.to_json(), cap=CAP,
                text="Debian common-licenses, framed with the default prompt")
    name = args.name or f"convergence-{encoder.name}"
    path = write_report(name, dict(meta=meta, summary=summary, passes=pass_rows, samples=sample_rows,
                                    heads=head_rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
