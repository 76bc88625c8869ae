"""The scheduler's typed errors, raised where each failure happens, and the service's one table
that answers each with its HTTP status."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from fake_encoder import FakeEncoder, until

from clusterserve.engine import Cancelled, DeadlineExceeded, Job, OutOfMemory, Overloaded, Run, Scheduler, ShuttingDown
from clusterserve.kernels import AttentionSpec
from clusterserve.service import errors

pytestmark = pytest.mark.anyio
FULL = AttentionSpec(method="full")


def job(tokens: int = 4, **fields) -> Job:
    return Job(request_id="r", runs=[Run([7] * tokens, FULL, work=1.0)], **fields)


def scheduler(encoder: FakeEncoder, **limits) -> Scheduler:
    built = Scheduler(encoder, max_batch_tokens=limits.get("tokens", 1000), max_concurrent_requests=limits.get("jobs", 4))
    built.start()
    return built


async def test_a_job_runs_to_its_rows():
    running = scheduler(FakeEncoder())
    try:
        result = await running.submit(job(5))
    finally:
        running.stop()
    assert result.vectors.tolist() == [[5.0, 7.0, 7.0, 1.0]]


async def test_admission_past_the_limit_is_overloaded():
    gate = threading.Event()
    running = scheduler(FakeEncoder(gate=gate), jobs=1)
    try:
        held = asyncio.ensure_future(running.submit(job()))
        await until(lambda: running.snapshot()["admitted"] >= 1, "the first job's admission")
        with pytest.raises(Overloaded) as raised:
            await running.submit(job())
        assert raised.value.limit == 1
        gate.set()
        await held
    finally:
        gate.set()
        running.stop()


async def test_a_job_past_its_deadline_is_refused_and_a_stopped_scheduler_admits_nothing():
    running = scheduler(FakeEncoder())
    with pytest.raises(DeadlineExceeded) as raised:
        await running.submit(job(deadline=0.0, timeout_s=2.5))
    assert raised.value.timeout_s == 2.5
    running.stop()
    with pytest.raises(ShuttingDown):
        await running.submit(job())


async def test_a_withdrawn_job_is_cancelled_and_leaves_the_queue():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    running = scheduler(encoder)
    gone = asyncio.get_running_loop().create_future()
    try:
        # The first job's batch holds the worker at its start, so the second waits in the queue.
        first = asyncio.ensure_future(running.submit(job()))
        await until(lambda: len(encoder.calls) >= 1, "the first batch's start")
        withdrawn = asyncio.ensure_future(running.submit_unless(job(), gone))
        await until(lambda: running.snapshot()["pending_items"] >= 1, "the second job in the queue")
        gone.set_result(None)
        with pytest.raises(Cancelled):
            await withdrawn
        assert running.snapshot()["admitted"] == 1
        gate.set()
        await first
        # The worker drops the withdrawn job's item when it next looks at the queue, unrun.
        await until(lambda: running.snapshot()["pending_items"] == 0, "the withdrawn item dropped")
        assert len(encoder.calls) == 1
    finally:
        gate.set()
        running.stop()


async def test_an_input_too_big_for_memory_alone_fails_and_its_batch_mates_do_not():
    encoder = FakeEncoder(fail=torch.OutOfMemoryError("out of memory"), fail_above_tokens=10)
    running = scheduler(encoder)
    big = Job(request_id="big", runs=[Run([7] * 12, FULL, work=1.0)])
    small = Job(request_id="small", runs=[Run([7] * 4, FULL, work=1.0), Run([7] * 5, FULL, work=1.0)])
    try:
        outcomes = await asyncio.gather(running.submit(big), running.submit(small), return_exceptions=True)
    finally:
        running.stop()
    assert isinstance(outcomes[0], OutOfMemory) and outcomes[0].tokens == 12
    assert outcomes[1].vectors[:, 0].tolist() == [4.0, 5.0]


@pytest.mark.parametrize(
    "error, status, reason",
    [
        (ShuttingDown(), 503, "not_ready"),
        (Overloaded(3), 429, "overloaded"),
        (DeadlineExceeded(1.5), 504, "deadline"),
        (OutOfMemory(9000), 503, "out_of_memory"),
        (Cancelled(), 499, "disconnected"),
    ],
)
def test_the_service_answers_each_engine_error_by_its_table(error, status, reason):
    answered = errors.from_engine_error(error)
    assert (answered.status, answered.reason) == (status, reason)
