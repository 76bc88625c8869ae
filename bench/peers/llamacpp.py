"""This server against llama.cpp on the same GGUF, over HTTP as users call them.

    python -m clusterserve.bench.peers.llamacpp [--repeats 3] [--threads 2] [--model FILE.gguf] [--server-args ...]
                             [--workloads NAME ...] [--name llamacpp]

Starts `clusterserve serve` with its defaults (the default model; `auto` at the server's
target fidelity, bfloat16 where the CPU is fast at it) and llama-cpp-python's server
(`python -m llama_cpp.server`, an OpenAI-style /v1/embeddings) on the same GGUF file, both
with the same threads, and posts the same workloads to each, the two in turn each round (so
the machine's drift falls on both alike): one short query (a search engine's every query;
timed QUERY_CALLS times a round, the median kept), 64 short texts in one request, 6
paragraphs of ~460 tokens in one request, one ~2k-token document, one ~8k-token document.
Texts carry nomic's "search_query: " or "search_document: " themselves, which this server then
leaves as they are, so both embed the same tokens. Past nomic's 2,048 trained positions this server applies the published
dynamic NTK scaling; llama.cpp is given the same (the rotary base that scaling gives at the
8k document's length) by a second llama.cpp server for that workload.

Reports per workload each server's median seconds, the ratio, and the least cosine between
the two servers' vectors; writes bench/results/<name>.json (`--workloads` runs only those named).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from clusterserve.models.fetch import default_model_path
from clusterserve.models.networks.rotary import rotary_base

from ..common import LICENSE_DIR, print_table, run_conditions, write_results
from ..cpu.short_texts import sentences

PROMPT = "search_document: "
QUERY = "search_query: what may I distribute under these terms?"
QUERY_CALLS = 10  # timed calls a round of the one-query workload: one call is ~0.1 s
ROOT = Path(__file__).resolve().parents[2]  # the checkout


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _server(command: list[str], ready_path: str, log: Path, timeout_s: float = 600):
    port = _free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([*command, "--port", str(port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[2]} exited with {process.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + ready_path, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[2]} not ready after {timeout_s} s")
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def _embed(http: httpx.Client, base: str, texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    response = http.post(base + "/v1/embeddings", json={"input": texts, "model": "nomic-embed-text-v1.5",
                                                      "encoding_format": "float"})
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    rows = sorted(response.json()["data"], key=lambda d: d["index"])
    vectors = np.array([row["embedding"] for row in rows], dtype=np.float64)
    return elapsed, vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def workloads(tokenizer) -> dict[str, list[str]]:
    """name -> the texts of one request, prompt included."""
    prose = "\n\n".join((LICENSE_DIR / name).read_text() for name in ("GPL-3", "Apache-2.0", "GPL-2", "LGPL-2.1"))
    words = prose.split()

    def of_tokens(target: int, start: int = 0) -> str:
        low, high = 1, len(words) - start
        while low < high:  # the longest run of words whose text is within `target` tokens
            middle = (low + high + 1) // 2
            if tokenizer(PROMPT + " ".join(words[start : start + middle])) <= target:
                low = middle
            else:
                high = middle - 1
        return PROMPT + " ".join(words[start : start + low])

    return {
        "one short query": [QUERY],
        "64 short texts": [PROMPT + s for s in sentences(64)],
        "6 paragraphs of ~460 tokens": [of_tokens(460, 400 * i) for i in range(6)],
        "one 2k-token document": [of_tokens(2040)],
        "one 8k-token document": [of_tokens(8150)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--server-args", nargs="*", default=[], help="extra flags for clusterserve serve")
    parser.add_argument("--workloads", nargs="*", default=None, help="run only these (names as printed)")
    parser.add_argument("--name", default="llamacpp", help="results file: bench/results/<name>.json")
    args = parser.parse_args()

    from clusterserve.models import load_encoder

    model = args.model or default_model_path()
    encoder = load_encoder(model)
    tokenizer = encoder.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode([text])[0].ids)

    loads = workloads(count)
    unknown = set(args.workloads or ()) - set(loads)
    if unknown:
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {list(loads)}")
    long_tokens = count(loads["one 8k-token document"][0])
    loads = {name: texts for name, texts in loads.items() if not args.workloads or name in args.workloads}
    config = encoder.model.config
    scaled_base = rotary_base(long_tokens, config.head_dim, config.rope_theta, config.rope_type, config.rope_factor,
                              config.rope_original_positions)
    del encoder

    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    ours = [sys.executable, "-m", "clusterserve.service", "--model", str(model), "--host", "127.0.0.1", *args.server_args]
    llama = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--embedding", "true", "--n_ctx", "8192",
             "--n_batch", "8192", "--n_ubatch", "8192", "--n_threads", str(args.threads),
             "--n_threads_batch", str(args.threads), "--host", "127.0.0.1"]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    with (
        _server(ours, "/health/ready", logs / "ours.log") as ours_url,
        _server(llama, "/v1/models", logs / "llama.log") as llama_url,
        _server([*llama, "--rope_freq_base", f"{scaled_base:.6f}"], "/v1/models", logs / "llama-8k.log") as llama_8k_url,
        httpx.Client(timeout=1800) as http,
    ):
        rows = [compare_workload(http, ours_url, llama_8k_url if name.startswith("one 8k") else llama_url, name, texts,
                                 args.repeats, count) for name, texts in loads.items()]
        info = http.get(ours_url + "/info").json()
    print_table(rows, ["workload", "tokens", "clusterserve_s", "llama_cpp_s", "speedup", "min_cosine", "attention"])
    meta = run_conditions(model=str(model), repeats=args.repeats, threads=args.threads, served_dtype=info.get("dtype"),
                          backend=info.get("backend"), llama_cpp_rope_freq_base_8k=scaled_base)
    print(f"wrote {write_results(args.name, rows, meta)}")


def compare_workload(http: httpx.Client, ours_url: str, peer_url: str, name: str, texts: list[str], repeats: int,
                     count) -> dict:
    """One workload posted to both servers in turn, `repeats` rounds after an untimed one: the
    median seconds of each, their ratio, the least cosine between their vectors and what this
    server ran (its x-attention)."""
    _embed(http, ours_url, texts)  # untimed: first-request costs on both
    _embed(http, peer_url, texts)
    times = {"clusterserve": [], "llama.cpp": []}
    for _ in range(repeats * (QUERY_CALLS if texts == [QUERY] else 1)):
        ours_s, ours_vectors = _embed(http, ours_url, texts)
        peer_s, peer_vectors = _embed(http, peer_url, texts)
        times["clusterserve"].append(ours_s)
        times["llama.cpp"].append(peer_s)
    ours_s, peer_s = (statistics.median(times[k]) for k in ("clusterserve", "llama.cpp"))
    ran = http.post(ours_url + "/v1/embeddings", json={"input": texts[:1]}).headers.get("x-attention")
    print(f"{name}: clusterserve {ours_s:.3f} s, llama.cpp {peer_s:.3f} s", flush=True)
    return {
        "workload": name,
        "tokens": sum(count(t) for t in texts),
        "clusterserve_s": ours_s,
        "llama_cpp_s": peer_s,
        "speedup": peer_s / ours_s,
        "min_cosine": float((ours_vectors * peer_vectors).sum(axis=1).min()),
        "attention": ran,
    }


if __name__ == "__main__":
    main()
