"""Latency through HTTP: one document of 4k and of 16k tokens per attention method, as a client sees it.

    python -m clusterserve.bench.cpu.http_latency [--url http://127.0.0.1:8000] [--lengths 4096 16384] [--repeats 3]

Without --url it starts `clusterserve serve` on a free loopback port and stops it afterwards.
Documents are real prose (Debian's licence texts), cut so the model sees exactly N tokens,
sent as text to POST /v1/embeddings with `{"attention": {"method": ...}}` and the server's
default knobs; "default" sends no attention object, so the server's default runs (`auto` at
its target fidelity, from the calibration table). The client's wall time is reported with the server's own split
(x-queue-time-ms, x-inference-time-ms) and its x-peak-memory-bytes. Per length, each method
runs once untimed, then `repeats` rounds over the methods in turn; medians are reported,
with the 1-minute load average, since a shared machine's other work shows in the times.
Prints a table, writes bench/results/http_latency.json and bench/results/http_latency.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from ..common import LICENSE_DIR, RESULTS_DIR, print_table, write_results

METHODS = ("full", "default", "clustered", "i-clustered", "smyrf")
ROOT = Path(__file__).resolve().parents[2]  # the checkout


def corpus() -> str:
    files = sorted(p for p in LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no texts under {LICENSE_DIR}; install Debian's base-files")
    return "\n\n".join(p.read_text(errors="replace") for p in files)


def document(http: httpx.Client, text: str, tokens: int) -> str:
    """The prefix of `text` that the server tokenizes to `tokens` tokens, special tokens included."""
    while True:
        pieces = http.post("/tokenize", json={"inputs": text, "add_special_tokens": False}).json()[0]
        if len(pieces) >= tokens - 2:
            break
        text = text + "\n\n" + text  # more than the corpus holds: repeat it
    return text[: pieces[tokens - 3]["stop"]]


def start_server(port: int, log_path: Path, extra_flags: list[str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERSERVE_")}
    command = [sys.executable, "-m", "clusterserve.service", "--host", "127.0.0.1", "--port", str(port),
               "--request-timeout-s", "3600", "--log-level", "warning", *(extra_flags or [])]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def serving(url: str | None, extra_flags: list[str] | None = None) -> Iterator[str]:
    """The base URL of a ready server: `url` as given, or a `clusterserve serve` started on a
    free loopback port (with `extra_flags`) for the block and stopped after it."""
    process = None
    if url is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        process = start_server(port, Path("/tmp") / f"clusterserve-bench-{port}.log", extra_flags)
        url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        yield url
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def post(http: httpx.Client, text: str, method: str) -> dict:
    """One timed request: the client's wall time and the server's own figures."""
    body = {"input": text, "encoding_format": "base64"}
    if method != "default":
        body["attention"] = {"method": method}
    start = time.perf_counter()
    response = http.post("/v1/embeddings", json=body)
    wall = time.perf_counter() - start
    response.raise_for_status()
    return {
        "wall_s": wall,
        "queue_s": float(response.headers["x-queue-time-ms"]) / 1e3,
        "inference_s": float(response.headers["x-inference-time-ms"]) / 1e3,
        "peak_bytes": int(response.headers.get("x-peak-memory-bytes", 0)),
        "tokens": int(response.headers["x-input-tokens"]),
        "attention": response.json()["attention"],
    }


def measure(http: httpx.Client, text: str, methods: list[str], repeats: int) -> list[dict]:
    """Each method once untimed, then `repeats` rounds over all methods in turn: on a shared
    machine, load that comes and goes then hits every method alike."""
    for method in methods:
        post(http, text, method)
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for _ in range(repeats):
        for method in methods:
            runs[method].append(post(http, text, method))
    rows = []
    for method, samples in runs.items():
        rows.append({
            "method": method,
            "tokens": samples[0]["tokens"],
            "latency_s": statistics.median(s["wall_s"] for s in samples),
            "min_s": min(s["wall_s"] for s in samples),
            "inference_s": statistics.median(s["inference_s"] for s in samples),
            "queue_s": statistics.median(s["queue_s"] for s in samples),
            "peak_mib": max(s["peak_bytes"] for s in samples) / 2**20,
            "attention": samples[0]["attention"],
        })
    return rows


def _git_describe() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        points = sorted((r["tokens"], r["latency_s"]) for r in rows if r["method"] == method)
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel("HTTP latency (s, median)")
    ax.set_title("POST /v1/embeddings, one document")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start one on a free loopback port")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="http_latency")
    args = parser.parse_args()

    with serving(args.url) as url:
        rows = []
        with httpx.Client(base_url=url, timeout=3600) as http:
            info = http.get("/info").json()
            text = corpus()
            for tokens in args.lengths:
                doc = document(http, text, tokens)
                load = os.getloadavg()[0]
                measured = [{"length": tokens, **row} for row in measure(http, doc, args.methods, args.repeats)]
                for row in measured:
                    row["load_before"], row["load_after"] = load, os.getloadavg()[0]
                print_table(measured, ["length", "method", "tokens", "latency_s", "inference_s", "load_after"])
                rows.extend(measured)
        for row in rows:  # the ratio to exact attention at the same length, same run
            full = [r for r in rows if r["length"] == row["length"] and r["method"] == "full"]
            row["vs_full"] = row["latency_s"] / full[0]["latency_s"] if full else None
        print()
        columns = ["length", "method", "tokens", "latency_s", "min_s", "inference_s", "queue_s", "peak_mib", "vs_full"]
        print_table(rows, columns + ["load_before", "load_after"])
        meta = {
            "url": url if args.url else "spawned clusterserve serve",
            "model": info["model"],
            "device": info["device"],
            "backend": info["backend"],
            "cpu_count": os.cpu_count(),
            "repeats": args.repeats,
            "peak_memory": "x-peak-memory-bytes: CPU = server process peak RSS during the batch",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": _git_describe(),
        }
        path = write_results(args.name, rows, meta)
        plot(rows, path.with_suffix(".png"))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
