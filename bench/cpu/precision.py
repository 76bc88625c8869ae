"""The served precision: float32 against bfloat16 on this CPU, in one run.

    python -m clusterserve.bench.cpu.precision [--tokens 16384] [--repeats 3] [--http-repeats 20] [--skip-http]

In-process, one document of real prose (Debian's licence texts) of `--tokens` tokens:
- exact attention in float32 and in bfloat16, and the cosine between the two vectors;
- the server's default, auto at target fidelity 0.98, in float32 (the float32 calibration
  table) and in bfloat16 (the bfloat16 table), with each one's cosine to exact in float32;
- how far bfloat16 moves the default's vector, beside how far another seed moves it in the
  same dtype: an approximate method's clusters come from q, so bfloat16 can only be asked to
  change its answer about as much as a different seed does.
Over HTTP (unless --skip-http): 64 short texts in one request to a float32 server and to a
bfloat16 server (`clusterserve serve --dtype ...`, started here), the server's default attention,
`http_repeats` rounds (a request takes a tenth of a second: a few rounds are noise).
Variants run in turn, `repeats` rounds after an untimed one; medians and the medians of the
per-round ratios are reported. Prints a table and writes bench/results/precision.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder
from clusterserve.models.timing import alternated_seconds

from ..common import long_text_ids, print_table, run_conditions, write_results

TARGET = 0.98
EXACT = AttentionSpec(method="full")
AUTO = AttentionSpec(method="auto")


def in_process(tokens: int, repeats: int) -> tuple[list[dict], dict, dict]:
    full32 = load_encoder(None, dtype="float32")
    half = load_encoder(None, dtype="bfloat16")
    ids = long_text_ids(full32, tokens)
    vectors = {
        "exact float32": lambda: full32.embed([ids], EXACT),
        "exact bfloat16": lambda: half.embed([ids], EXACT),
        "auto 0.98 float32": lambda: full32.embed([ids], AUTO, target_fidelity=TARGET),
        "auto 0.98 bfloat16": lambda: half.embed([ids], AUTO, target_fidelity=TARGET),
    }
    times = alternated_seconds(vectors, repeats)
    reference = vectors["exact float32"]()
    rows = []
    for name, fn in vectors.items():
        rows.append({
            "variant": name,
            "tokens": len(ids),
            "median_s": statistics.median(times[name]),
            "vs_exact_float32": statistics.median(e / s for s, e in zip(times[name], times["exact float32"])),
            "vs_auto_float32": statistics.median(a / s for s, a in zip(times[name], times["auto 0.98 float32"])),
            "cosine_to_exact_float32": cosine(fn(), reference),
        })  # fmt: skip
    chosen = {
        "float32": full32.calibration.choose(len(ids), TARGET).spec.to_json() if full32.calibration else None,
        "bfloat16": half.calibration.choose(len(ids), TARGET).spec.to_json() if half.calibration else None,
    }
    default32, default16 = vectors["auto 0.98 float32"](), vectors["auto 0.98 bfloat16"]()
    other_seed = AttentionSpec(method="auto", seed=1)
    agreement = {
        "bfloat16 default vs float32 default": cosine(default16, default32),
        "float32 default, seed 1 vs seed 0": cosine(full32.embed([ids], other_seed, target_fidelity=TARGET), default32),
        "bfloat16 default, seed 1 vs seed 0": cosine(half.embed([ids], other_seed, target_fidelity=TARGET), default16),
    }
    return rows, chosen, agreement


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b).item()


def over_http(repeats: int) -> list[dict]:
    import httpx

    from .http_latency import serving
    from .short_texts import sentences

    texts = sentences(64)
    urls = {}
    servers = {}
    times: dict[str, list[float]] = {}
    try:
        for dtype in ("float32", "bfloat16"):
            servers[dtype] = serving(None, extra_flags=["--dtype", dtype])
            urls[dtype] = servers[dtype].__enter__()
        clients = {dtype: httpx.Client(base_url=url, timeout=3600) for dtype, url in urls.items()}

        def post(dtype: str):
            return lambda: clients[dtype].post("/v1/embeddings", json={"input": texts}).raise_for_status()

        times = alternated_seconds({dtype: post(dtype) for dtype in urls}, repeats)
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
    return [
        {
            "variant": f"64 short texts, HTTP, {dtype}",
            "median_s": statistics.median(seconds),
            "vs_float32": statistics.median(f / s for s, f in zip(seconds, times["float32"])),
        }
        for dtype, seconds in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--http-repeats", type=int, default=20)
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows, chosen, agreement = in_process(args.tokens, args.repeats)
    print_table(rows, ["variant", "tokens", "median_s", "vs_exact_float32", "vs_auto_float32", "cosine_to_exact_float32"])
    print(f"auto at {TARGET} chose: {chosen}")
    for pair, value in agreement.items():
        print(f"cosine, {pair}: {value:.5f}")
    http_rows = [] if args.skip_http else over_http(args.http_repeats)
    if http_rows:
        print_table(http_rows, ["variant", "median_s", "vs_float32"])
    meta = run_conditions(chosen=chosen, agreement=agreement, repeats=args.repeats, http_repeats=args.http_repeats)
    print(f"\nwrote {write_results('precision', rows + http_rows, meta)}")


if __name__ == "__main__":
    main()
