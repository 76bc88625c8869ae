"""The real server as users start it (`clusterserve serve`), on a free loopback port, for the
tests that need a process rather than an in-process app."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
COMMAND = Path(sys.executable).with_name("clusterserve")  # the console script of this venv's install


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerFailed(AssertionError):
    """The server exited, or was not ready in time; the message holds its log."""


@contextlib.contextmanager
def running_server(
    log_path: Path, *flags: str, env: dict[str, str] | None = None, ready_timeout_s: float = 240,
    model: str | None = "all-MiniLM-L6-v2",
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `clusterserve serve` on 127.0.0.1 with `flags`, wait until /health/ready answers
    200, yield (base URL, process); on exit stop it (SIGTERM, then SIGKILL after 15 s).

    model: the --model flag, unless `flags` name one: the small plumbing model by default;
    None serves the server's own default (nomic-embed-text-v1.5).

    The server's settings come from the flags alone: CLUSTERSERVE_* variables of the calling
    environment are dropped; `env` adds variables on top.
    """
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERSERVE_")} | (env or {})
    if model is not None and "--model" not in flags:
        flags = (*flags, "--model", model)
    command = [str(COMMAND), "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(base):
            if process.poll() is not None:
                raise ServerFailed(f"server exited with {process.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"server not ready after {ready_timeout_s:.0f} s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield base, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
