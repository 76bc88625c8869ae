"""Mixed lengths in one call: packed batches against the same inputs sent apart.

    python -m clusterserve.bench.cpu.packing [--repeats 5] [--skip-http] [--url http://127.0.0.1:8000]

Three workloads of real prose (Debian's licence texts), each timed in-process through
`Encoder.embed` and over HTTP through POST /v1/embeddings with the server's defaults:

- chunks: a ~8k-token document cut at paragraph breaks into 18 chunks of 70-1000 tokens,
  with exact attention: the chunks in one call, against each chunk in its own call, and
  against one sequence of the same tokens;
- mixed: one 16k-token document plus 63 short texts in one call, against the document alone
  plus the texts alone (both calls), with the server's default attention (auto at 0.98);
- short: 64 short texts in one call.

Variants of a workload run in turn, `repeats` rounds after an untimed one; each round's
ratios are taken within the round and the medians reported, so a shared machine's drift
cancels. Prints a table and writes bench/results/packing.json.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

from clusterserve.kernels import AttentionSpec
from clusterserve.models.timing import alternated_seconds

from ..common import LICENSE_DIR, print_table, run_conditions, write_results
from .short_texts import sentences

CHUNK_TARGETS = (1000, 200, 700, 300, 900, 150, 500, 800, 250, 600, 1000, 350, 450, 120, 650, 400, 550, 300)
EXACT = AttentionSpec(method="full")
TARGET = 0.98  # the server's default target_fidelity


def chunk_texts(count_tokens: Callable[[list[str]], list[int]]) -> list[str]:
    """GPL-3 then Apache-2.0 cut at paragraph breaks into len(CHUNK_TARGETS) chunks, chunk i
    closed before it would pass CHUNK_TARGETS[i] tokens."""
    text = "\n\n".join((LICENSE_DIR / name).read_text(errors="replace") for name in ("GPL-3", "Apache-2.0"))
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    chunks: list[str] = []
    current: list[str] = []
    tokens = 0
    for paragraph, n in zip(paragraphs, count_tokens(paragraphs)):
        if current and tokens + n > CHUNK_TARGETS[len(chunks)]:
            chunks.append("\n\n".join(current))
            current, tokens = [], 0
            if len(chunks) == len(CHUNK_TARGETS):
                break
        current.append(paragraph)
        tokens += n
    return chunks


def long_document(count_tokens: Callable[[list[str]], list[int]], tokens: int) -> str:
    """Real prose cut to about `tokens` tokens (special tokens included)."""
    files = sorted(p for p in LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink())
    text = "\n\n".join(p.read_text(errors="replace") for p in files)
    while count_tokens([text])[0] < tokens:
        text = text + "\n\n" + text
    low, high = 0, len(text)
    while low < high:  # the longest prefix within `tokens`
        middle = (low + high + 1) // 2
        low, high = (middle, high) if count_tokens([text[:middle]])[0] <= tokens else (low, middle - 1)
    return text[:low]


def summarise(workload: str, where: str, times: dict[str, list[float]], base: str) -> list[dict]:
    """One row per variant: median seconds and the median of its per-round ratio to `base`."""
    return [
        {
            "workload": workload,
            "where": where,
            "variant": name,
            "median_s": statistics.median(seconds),
            "vs_base": statistics.median(s / b for s, b in zip(seconds, times[base])),
            "base": base,
        }
        for name, seconds in times.items()
    ]


def workloads(count_tokens: Callable[[list[str]], list[int]]) -> dict[str, object]:
    chunks = chunk_texts(count_tokens)
    return {
        "chunks": chunks,
        "joined": "\n\n".join(chunks),
        "document": long_document(count_tokens, 16384),
        "shorts": sentences(63),
        "short64": sentences(64),
    }


def in_process(repeats: int) -> tuple[list[dict], dict]:
    from clusterserve.models import load_encoder

    encoder = load_encoder(None)
    texts = workloads(encoder.count_tokens)
    chunks, document, shorts = texts["chunks"], texts["document"], texts["shorts"]

    def auto(inputs: list[str]) -> object:
        return encoder.embed(inputs, AttentionSpec(method="auto"), target_fidelity=TARGET)

    rows = summarise("chunks", "python", alternated_seconds({
        "together": lambda: encoder.embed(chunks, EXACT),
        "one by one": lambda: [encoder.embed([chunk], EXACT) for chunk in chunks],
        "one sequence": lambda: encoder.embed([texts["joined"]], EXACT),
    }, repeats), base="one by one")  # fmt: skip
    rows += summarise("mixed", "python", alternated_seconds({
        "together": lambda: auto([document, *shorts]),
        "apart": lambda: (auto([document]), auto(shorts)),
    }, repeats), base="apart")  # fmt: skip
    rows += summarise("short", "python", alternated_seconds({"64 texts": lambda: auto(texts["short64"])}, repeats), "64 texts")
    tokens = {name: encoder.count_tokens(value if isinstance(value, list) else [value]) for name, value in texts.items()}
    return rows, tokens


def over_http(url: str | None, repeats: int) -> list[dict]:
    import httpx

    from .http_latency import serving

    with serving(url) as base_url, httpx.Client(base_url=base_url, timeout=3600) as http:
        per_request = http.get("/info").json()["limits"]["max_client_batch_size"]

        def count(inputs: list[str]) -> list[int]:
            counts = []
            for start in range(0, len(inputs), per_request):
                response = http.post("/tokenize", json={"inputs": inputs[start : start + per_request]})
                response.raise_for_status()
                counts += [len(t) for t in response.json()]
            return counts

        texts = workloads(count)

        def post(inputs: list[str], attention: dict | None = None) -> None:
            body = {"input": inputs} if attention is None else {"input": inputs, "attention": attention}
            response = http.post("/v1/embeddings", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"POST /v1/embeddings: {response.status_code} {response.text[:500]}")

        full = {"method": "full"}
        chunks, document, shorts = texts["chunks"], texts["document"], texts["shorts"]
        rows = summarise("chunks", "http", alternated_seconds({
            "together": lambda: post(chunks, full),
            "one by one": lambda: [post([chunk], full) for chunk in chunks],
            "one sequence": lambda: post([texts["joined"]], full),
        }, repeats), base="one by one")  # fmt: skip
        rows += summarise("mixed", "http", alternated_seconds({
            "together": lambda: post([document, *shorts]),
            "apart": lambda: (post([document]), post(shorts)),
        }, repeats), base="apart")  # fmt: skip
        rows += summarise("short", "http", alternated_seconds({"64 texts": lambda: post(texts["short64"])}, repeats), "64 texts")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--url", help="a running server for the HTTP half; default: start one")
    args = parser.parse_args()

    rows, tokens = in_process(args.repeats)
    if not args.skip_http:
        rows += over_http(args.url, args.repeats)
    print(
        f"chunks: {len(tokens['chunks'])}, {sum(tokens['chunks'])} tokens, longest {max(tokens['chunks'])}; "
        f"document {tokens['document'][0]} tokens; short texts {min(tokens['short64'])}-{max(tokens['short64'])} tokens"
    )
    print_table(rows, ["workload", "where", "variant", "median_s", "vs_base", "base"])
    meta = run_conditions(tokens=tokens, repeats=args.repeats)
    print(f"\nwrote {write_results('packing', rows, meta)}")


if __name__ == "__main__":
    main()
