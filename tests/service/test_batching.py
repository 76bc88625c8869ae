"""The scheduler: packed batches under the token budget (specs mixed, adapters apart), timings,
liveness while busy."""

from __future__ import annotations

import threading

import anyio
import pytest
from service_helpers import FakeEncoder, fake_app, running

pytestmark = pytest.mark.anyio


async def hold_worker(http, encoder, tasks, responses):
    """Start a request that occupies the worker until the encoder's gate opens."""

    async def post():
        responses["blocker"] = await http.post("/v1/embeddings", json={"input": "blocker"})

    tasks.start_soon(post)
    with anyio.fail_after(120):
        while not encoder.calls:
            await anyio.sleep(0.005)


async def wait_queued(app, items: int) -> None:
    with anyio.fail_after(120):
        while app.state.service.scheduler.snapshot()["pending_items"] < items:
            await anyio.sleep(0.005)


async def test_queued_inputs_batch_together_whatever_their_specs():
    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate))
    responses = {}
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            await hold_worker(http, encoder, tasks, responses)

            async def post(name, body):
                responses[name] = await http.post("/v1/embeddings", json=body)

            # cluster_size 1: SMYRF stays approximate for inputs this short
            smyrf = {"method": "smyrf", "cluster_size": 1}
            tasks.start_soon(post, "a", {"input": ["alpha", "beta"], "attention": {**smyrf, "seed": 1}})
            await wait_queued(app, 2)
            tasks.start_soon(post, "b", {"input": "gamma", "attention": {**smyrf, "seed": 2}})
            await wait_queued(app, 3)
            tasks.start_soon(post, "c", {"input": "delta", "attention": {**smyrf, "seed": 1}})
            await wait_queued(app, 4)
            gate.set()
    assert all(r.status_code == 200 for r in responses.values())
    batches = [[(spec.method, spec.seed) for spec in call["specs"]] for call in encoder.calls]
    # Queued behind the blocker: one packed batch, each input with its own request's spec.
    assert batches == [[("full", 0)], [("smyrf", 1), ("smyrf", 1), ("smyrf", 2), ("smyrf", 1)]]
    # They waited for the blocker: the queue time says so and the total covers it.
    queued = float(responses["a"].headers["x-queue-time-ms"])
    assert queued > 0
    assert float(responses["a"].headers["x-total-time-ms"]) >= queued


async def test_token_budget_splits_batches():
    gate = threading.Event()
    # Each input below is 5 tokens; a budget of 10 tokens fits two of them.
    app, encoder = fake_app(FakeEncoder(gate=gate), max_batch_tokens=10)
    responses = {}
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            await hold_worker(http, encoder, tasks, responses)

            async def post():
                responses["five"] = await http.post("/embed", json={"inputs": ["one two three"] * 5})

            tasks.start_soon(post)
            await wait_queued(app, 5)
            gate.set()
    assert responses["five"].status_code == 200
    assert [len(call["inputs"]) for call in encoder.calls[1:]] == [2, 2, 1]
    assert all(len(ids) == 5 for call in encoder.calls[1:] for ids in call["inputs"])


async def test_liveness_and_metrics_answer_while_the_worker_is_busy():
    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate))
    responses = {}
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            await hold_worker(http, encoder, tasks, responses)
            # The worker stays held until the gate opens below: a route that waited for it
            # would never answer, and the generous bound turns that hang into a failure.
            with anyio.fail_after(120):
                for path in ("/health/live", "/health/ready", "/metrics", "/info"):
                    assert (await http.get(path)).status_code == 200
            queued = (await http.get("/metrics")).text
            assert "clusterserve_inflight_requests 1.0" in queued
            gate.set()
    assert responses["blocker"].status_code == 200
    assert float(responses["blocker"].headers["x-inference-time-ms"]) > 0


async def test_shutdown_finishes_queued_work():
    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate))
    responses = {}
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            await hold_worker(http, encoder, tasks, responses)

            async def post():
                responses["queued"] = await http.post("/embed", json={"inputs": "queued"})

            tasks.start_soon(post)
            await wait_queued(app, 1)
            threading.Timer(0.2, gate.set).start()
    # Lifespan exit (drain) ran after both answered; nothing was dropped.
    assert responses["blocker"].status_code == responses["queued"].status_code == 200
    assert app.state.service.draining and not app.state.service.ready
