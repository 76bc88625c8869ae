"""The scheduler a layer at a time: short work runs between the layers of long work, work whose
request is gone stops within a layer, and the rest of its batch goes on unchanged. Layers
are counted, never timed: the scheduler runs on a clock the tests move themselves."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from fake_encoder import FakeEncoder, ManualClock, until

from clusterserve.engine import Job, Run, Scheduler
from clusterserve.engine.observer import Unobserved
from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.cost import Throughput

pytestmark = pytest.mark.anyio


class Stops(Unobserved):
    """An observer that counts stopped inputs by reason."""

    def __init__(self) -> None:
        self.inputs: dict[str, int] = {}

    def stopped(self, reason: str, inputs: int) -> None:
        self.inputs[reason] = self.inputs.get(reason, 0) + inputs
FULL = AttentionSpec(method="full")


def make_batcher(encoder: FakeEncoder, clock: ManualClock | None = None) -> Scheduler:
    # One work unit a second: the jobs' `work` is their estimated seconds.
    batcher = Scheduler(
        encoder, max_batch_tokens=1000, max_concurrent_requests=8, throughput=Throughput(1.0),
        observer=Stops(), clock=clock or ManualClock(),
    )  # fmt: skip
    batcher.start()
    return batcher


def job(name: int, tokens: int, work: float) -> Job:
    return Job(request_id=str(name), runs=[Run([name] * tokens, FULL, work=work)])


def layers_of(encoder: FakeEncoder) -> list[int]:
    """The request (first token id) of each layer step, in the order they ran."""
    return [step[0][0] if len(step) == 1 else tuple(s[0] for s in step) for step in encoder.layers_run]


async def test_a_short_request_waits_for_at_most_one_layer_of_a_long_one():
    gate = threading.Semaphore(0)
    encoder = FakeEncoder(layers=6, layer_gate=gate)
    batcher = make_batcher(encoder)
    try:
        long = asyncio.ensure_future(batcher.submit(job(7, 50, work=600.0)))
        gate.release(2)
        await until(lambda: len(encoder.layers_run) == 2, "two layers of the long request")
        short = asyncio.ensure_future(batcher.submit(job(3, 4, work=1.0)))
        await until(lambda: batcher.snapshot()["pending_items"] == 1, "the short request queued")
        gate.release(20)
        results = await asyncio.gather(long, short)
    finally:
        batcher.stop()
    # The long request's third layer was under way when the short one came; the short one ran
    # whole before the long one's fourth.
    assert layers_of(encoder) == [7, 7, 7, 3, 3, 3, 3, 3, 3, 7, 7, 7]
    assert results[1].vectors[0, 0].item() == 4.0 and results[0].vectors[0, 0].item() == 50.0


async def test_a_long_request_still_advances_once_it_has_waited_its_remaining_work():
    gate = threading.Semaphore(0)
    encoder = FakeEncoder(layers=2, layer_gate=gate)
    clock = ManualClock()
    batcher = make_batcher(encoder, clock)
    try:
        # Remaining work 0.01 s: ageing lets it run before a short request that has just come.
        long = asyncio.ensure_future(batcher.submit(job(7, 50, work=0.02)))
        gate.release(1)
        await until(lambda: len(encoder.layers_run) == 1, "one layer of the first request")
        clock.now += 0.05  # it has now waited longer than its remaining work
        short = asyncio.ensure_future(batcher.submit(job(3, 4, work=0.005)))
        await until(lambda: batcher.snapshot()["pending_items"] == 1, "the second request queued")
        gate.release(10)
        await asyncio.gather(long, short)
    finally:
        batcher.stop()
    assert layers_of(encoder) == [7, 7, 3, 3]


async def test_a_cancelled_request_stops_within_one_layer_and_the_next_is_unchanged():
    gate = threading.Semaphore(0)
    encoder = FakeEncoder(layers=6, layer_gate=gate)
    batcher = make_batcher(encoder)
    try:
        alone = await _run_released(batcher, gate, job(5, 8, work=1.0))
        heavy = asyncio.ensure_future(batcher.submit(job(7, 50, work=600.0)))
        gate.release(2)
        await until(lambda: layers_of(encoder).count(7) == 2, "two layers of the heavy request")
        heavy.cancel()  # the client went away while its third layer waits to run
        with pytest.raises(asyncio.CancelledError):
            await heavy
        gate.release(10)
        await until(lambda: batcher.snapshot()["running_batches"] == 0, "the heavy batch dropped")
        assert layers_of(encoder).count(7) == 2  # the third layer's check stopped it before it ran
        again = await _run_released(batcher, gate, job(5, 8, work=1.0))
    finally:
        batcher.stop()
    torch.testing.assert_close(again.vectors, alone.vectors)
    sample = batcher.observer.inputs.get("disconnected", 0)
    assert sample == 1.0


async def test_a_request_past_its_deadline_leaves_its_batch_and_the_others_go_on():
    gate = threading.Semaphore(0)
    encoder = FakeEncoder(layers=4, layer_gate=gate)
    clock = ManualClock()
    batcher = make_batcher(encoder, clock)
    try:
        blocker = asyncio.ensure_future(batcher.submit(job(1, 2, work=1e-6)))
        await until(lambda: batcher.snapshot()["running_batches"] == 1, "the blocker running")
        leaving = job(7, 10, work=10.0)
        leaving.deadline, leaving.timeout_s = clock.now + 3600, 3600
        staying = job(3, 6, work=10.0)
        first = asyncio.ensure_future(batcher.submit(leaving))
        second = asyncio.ensure_future(batcher.submit(staying))
        await until(lambda: batcher.snapshot()["pending_items"] == 2, "both queued behind the blocker")
        gate.release(5)  # the blocker's four layers, then the first layer of the shared batch
        await until(lambda: len(encoder.layers_run) == 5, "one layer of the shared batch")
        await blocker
        assert layers_of(encoder) == [1, 1, 1, 1, (7, 3)]
        # Its deadline passes while the batch's second layer waits to run: it leaves after it.
        clock.now = leaving.deadline
        gate.release(10)
        with pytest.raises(Exception, match="deadline"):
            await first
        result = await second
    finally:
        batcher.stop()
    assert layers_of(encoder)[4:] == [(7, 3), (7, 3), 3, 3]  # request 7 left within one layer
    assert result.vectors[0, 0].item() == 6.0
    assert batcher.observer.inputs.get("deadline", 0) == 1


async def _run_released(batcher: Scheduler, gate: threading.Semaphore, one: Job):
    task = asyncio.ensure_future(batcher.submit(one))
    gate.release(100)
    result = await task
    while gate.acquire(blocking=False):  # take back what the run did not use
        pass
    return result


async def test_inputs_of_unlike_work_never_share_a_batch():
    gate = threading.Semaphore(0)
    encoder = FakeEncoder(layers=2, layer_gate=gate)
    batcher = make_batcher(encoder)
    try:
        blocker = asyncio.ensure_future(batcher.submit(job(1, 2, work=1e-6)))
        await until(lambda: batcher.snapshot()["running_batches"] == 1, "the blocker running")
        jobs = [job(7, 50, work=100.0), job(3, 4, work=1.0), job(4, 5, work=2.0)]
        tasks = [asyncio.ensure_future(batcher.submit(one)) for one in jobs]
        await until(lambda: batcher.snapshot()["pending_items"] == 3, "all queued behind the blocker")
        gate.release(100)
        await asyncio.gather(blocker, *tasks)
    finally:
        batcher.stop()
    # The two short ones (work within 4x of each other) together first, the long one alone.
    assert [call["inputs"][0][0] for call in encoder.calls] == [1, 3, 7]
    assert [len(call["inputs"]) for call in encoder.calls] == [1, 2, 1]
