"""Short-text throughput through HTTP: one request of many sentences, exact attention against
the server's default and each approximate method, as a client sees it.

    python -m clusterserve.bench.cpu.short_texts [--url http://127.0.0.1:8000] [--sentences 64] [--repeats 4]

Without --url it starts `clusterserve serve` on a free loopback port (bench.cpu.http_latency's
helpers). The sentences are the first lines of real prose (Debian's licence texts), each
about 15 tokens. Each variant runs once untimed, then `repeats` rounds in turn; the best and
the median client wall time are reported with what the server says ran (`x-attention`).
Prints a table and writes bench/results/short_texts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx

from ..common import print_table, write_results
from .http_latency import corpus, serving

# (label, the request's attention object; None = the server's default)
VARIANTS = [
    ("full", {"method": "full"}),
    ("default", None),
    ("i-clustered", {"method": "i-clustered"}),
    ("clustered", {"method": "clustered"}),
    ("smyrf", {"method": "smyrf"}),
]


def sentences(count: int, words: int = 12) -> list[str]:
    """`count` distinct pieces of real prose of `words` words (about 15 tokens each)."""
    tokens = corpus().split()
    return [" ".join(tokens[i * words : (i + 1) * words]) for i in range(count)]


def post(http: httpx.Client, texts: list[str], attention: dict | None) -> tuple[float, str]:
    body = {"input": texts, "model": "default"}
    if attention is not None:
        body["attention"] = attention
    start = time.perf_counter()
    response = http.post("/v1/embeddings", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.headers["x-attention"]


def measure(http: httpx.Client, texts: list[str], repeats: int) -> list[dict]:
    times: dict[str, list[float]] = {label: [] for label, _ in VARIANTS}
    ran: dict[str, str] = {}
    for _, attention in VARIANTS:  # untimed: first-batch costs
        post(http, texts, attention)
    for _ in range(repeats):
        for label, attention in VARIANTS:
            elapsed, ran[label] = post(http, texts, attention)
            times[label].append(elapsed)
    full = min(times["full"])
    return [
        {
            "variant": label,
            "best_s": min(times[label]),
            "median_s": statistics.median(times[label]),
            "vs_full": min(times[label]) / full,
            "ran": json.loads(ran[label]).get("method"),
        }
        for label, _ in VARIANTS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start one on a free loopback port")
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    with serving(args.url) as url:
        with httpx.Client(base_url=url, timeout=3600) as http:
            info = http.get("/info").json()
            texts = sentences(args.sentences)
            tokens = [len(t) for t in http.post("/tokenize", json={"inputs": texts}).json()]
            rows = measure(http, texts, args.repeats)
        print(f"{len(texts)} sentences, {min(tokens)}-{max(tokens)} tokens each")
        print_table(rows, ["variant", "ran", "best_s", "median_s", "vs_full"])
        meta = {
            "sentences": len(texts),
            "tokens": [min(tokens), max(tokens)],
            "model": info["model"],
            "device": info["device"],
            "backend": info["backend"],
            "cpu_count": os.cpu_count(),
            "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        print(f"\nwrote {write_results('short_texts', rows, meta)}")


if __name__ == "__main__":
    main()
