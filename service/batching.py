"""The scheduler: embedding requests queue here and one worker thread runs them, a layer at a time.

The pipeline (service.pipeline) plans a request (service.planning: each sequence's tokens,
attention spec, output and estimated work) and submits a `Job` of those `Run`s. Each run
enters a queue as an `Item`.
The worker forms packed batches (the oldest-waiting, least-work item first, then queued items
of any request with the same batch key while the batch's real tokens stay within the token
budget: `models.planning.plan.fits`, the rule `Encoder.embed` batches by) and runs each as a packed
forward pass (`Encoder.start`): each input attends by its own spec, no padding is computed.
Each sequence returns what its run asks (`Run.output`, models.pooling.Output): its pooled
vector, the means over token spans of a late-chunking window, or every token's state; the
batch's pass gives each its own (`Forward.outputs`), so inputs asking for different things
share batches.

Batches run one layer at a time (`models.runtime.encoder.Forward.step`). Between layers the worker
chooses what runs next, among the running batches and the batch the queue would form next:
the one with the least estimated remaining work, minus the seconds it has waited (shortest
remaining work first, with ageing). A short request therefore waits for at most about one
layer of a long one, and a long one still advances while short ones keep coming, once it has
waited as long as its remaining work. At most `max_running` batches are in progress at once.

Between layers, and between the attention stages of a layer, the worker also drops work
nobody waits for: inputs of a request that passed its deadline or whose client went away
leave their batch (`Forward.keep`); a batch left with none stops. Each job gets its pooled
vectors when its last input is done; inference never runs on the event loop, so health
checks and metrics answer while a 30k-token batch is running.

Per request the worker records:
- queue time: arrival in the queue -> start of the first batch holding one of its inputs;
- inference time: that start -> end of the last batch holding one of its inputs (other
  batches' layers may run in between);
- peak memory: the largest peak of those batches (see `metrics.PeakMemory`).

Admission is `Batcher.submit`'s check of `max_concurrent_requests`; the budget of work per
request is the pipeline's. `_oom` is the one place that handles out-of-memory: it frees
what the attempt held and queues each half of the batch anew, down to single inputs, so one
input too big for memory fails alone (503 naming its token count) and its batch-mates still
get their vectors; `stop` drains the queue before the worker exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.models import Encoder
from clusterserve.models.planning.cost import Throughput
from clusterserve.models.planning.plan import fits
from clusterserve.models.pooling import POOLED, Output

from . import errors
from .metrics import Metrics, PeakMemory, dominant_method

log = logging.getLogger("clusterserve")

# Inputs share a batch only when their estimated work is within this factor of each other.
SIMILAR_WORK = 4.0


@dataclass(frozen=True)
class BatchKey:
    """Inputs batch together only when one forward pass can run them: the same task adapter
    (the weights). A request's exact re-runs ("fidelity": true) form batches of their own, so
    that its approximate passes are timed alone. Specs may differ: each sequence of a packed
    batch attends by its own."""

    adapter: str | None = None
    exact_rerun: bool = False


@dataclass(frozen=True)
class Run:
    """One sequence of a job: its token ids (within the length limit), its resolved attention
    (never "auto"), what it returns, its estimated work units (models.planning.cost), and whether it is
    an exact re-run of another ("fidelity": true)."""

    ids: list[int]
    spec: AttentionSpec
    output: Output = POOLED
    work: float = 0.0
    exact_rerun: bool = False


@dataclass
class Job:
    """One client request: its sequences, in the order its rows come back."""

    request_id: str
    runs: list[Run]
    adapter: str | None = None  # the task adapter every sequence runs with (None: the base weights)
    deadline: float = float("inf")  # the scheduler's clock (time.monotonic) by which it must be answered
    timeout_s: float = float("inf")  # the deadline's length, for the 504 message

    # Filled in by the scheduler.
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float = 0.0
    peak_memory: int | None = None
    vectors: list[Tensor | None] = field(default_factory=list)
    spans: list[tuple[float, float] | None] = field(default_factory=list)  # per input: its batch's run
    remaining: int = 0
    cancelled: bool = False  # set by the event loop; the worker drops the job's items, queued or running
    gone_because: str = ""  # why it was cancelled: "deadline" or "disconnected" (set with `cancelled`)
    future: asyncio.Future[JobResult] | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(frozen=True)
class JobResult:
    # Every sequence's rows, in order: (sum of k_i, dim) float32 on the CPU, not normalised
    # (models.runtime.encoder.finish); k_i = Job.runs[i].output.rows(tokens), 1 for a pooled sequence.
    vectors: Tensor
    queue_s: float
    inference_s: float
    peak_memory: int | None
    spans: tuple[tuple[float, float], ...] = ()  # per sequence: (start, end) of the forward pass that ran it

    def run_seconds(self, indices: list[int]) -> float:
        """Seconds of the forward passes that ran these sequences (a pass shared by several counts once)."""
        return sum(end - start for start, end in {self.spans[i] for i in indices})


@dataclass(frozen=True)
class Item:
    job: Job
    index: int
    key: BatchKey

    @property
    def run(self) -> Run:
        return self.job.runs[self.index]

    @property
    def tokens(self) -> int:
        return len(self.run.ids)

    @property
    def spec(self) -> AttentionSpec:
        return self.run.spec

    @property
    def work(self) -> float:
        return self.run.work


class Abandoned(Exception):
    """Raised inside a batch's step when none of its inputs is wanted any more."""


@dataclass
class Running:
    """A batch the worker has formed: not started until `forward` is set."""

    items: list[Item]
    work: float  # estimated work units of the whole batch
    waiting_since: float  # when it last ran a layer, or its oldest item was queued
    forward: Any = None  # models.runtime.encoder.Forward once started
    started_at: float = 0.0
    peak_memory: int | None = None

    def remaining(self) -> float:
        """Estimated work units left."""
        if self.forward is None:
            return self.work
        return self.work * (1.0 - self.forward.done / max(self.forward.layers, 1))

    def wanted(self, now: float) -> list[int]:
        """Indices of the items whose request still waits for them at `now`: not cancelled,
        not past its deadline."""
        return [i for i, item in enumerate(self.items) if not item.job.cancelled and now < item.job.deadline]


class Batcher:
    """Queue + one worker thread. `submit` is called on the event loop; the rest runs on the worker."""

    def __init__(
        self,
        encoder: Encoder,
        metrics: Metrics,
        max_batch_tokens: int,
        max_concurrent_requests: int,
        throughput: Throughput | None = None,
        max_running: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.encoder = encoder
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_concurrent_requests = max_concurrent_requests
        # Without a measured rate, work units are compared as they are (one unit a nanosecond).
        self.throughput = throughput or Throughput(1e9)
        self.max_running = max_running
        # Seconds, for deadlines, waiting and timings; tests pass a clock they move themselves.
        self.clock = clock
        self._pending: deque[Item] = deque()
        self._running: list[Running] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._admitted = 0  # jobs between submit and answer; touched on the event loop only
        self._waiting_jobs = 0  # jobs whose first batch has not started
        self._peak = PeakMemory(encoder.device)
        self._thread = threading.Thread(target=self._work, name="clusterserve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop admitting, let the worker finish what is queued, and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("worker still busy %.0f s after shutdown began", timeout_s)

    async def submit(self, job: Job) -> JobResult:
        """Queue `job` and wait for its vectors. Raises ServiceError 429, 503 or 504."""
        if self._stopping:
            raise errors.not_ready("the server is shutting down")
        if self._admitted >= self.max_concurrent_requests:
            raise errors.overloaded(self.max_concurrent_requests)
        if self.clock() >= job.deadline:  # expired while tokenizing: never queued, never run
            raise errors.deadline_exceeded(job.timeout_s)
        loop = asyncio.get_running_loop()
        job.loop, job.future = loop, loop.create_future()
        job.vectors = [None] * len(job.runs)
        job.spans = [None] * len(job.runs)
        job.remaining = len(job.runs)
        job.enqueued_at = self.clock()
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)
        with self._cond:
            self._waiting_jobs += 1
            self.metrics.queue_depth.set(self._waiting_jobs)
            for index, run in enumerate(job.runs):
                self._pending.append(Item(job, index, BatchKey(job.adapter, run.exact_rerun)))
            self._cond.notify()
        try:
            remaining = job.deadline - self.clock()
            return await asyncio.wait_for(asyncio.shield(job.future), timeout=max(remaining, 0.0))
        except TimeoutError:
            job.gone_because = "deadline"
            raise errors.deadline_exceeded(job.timeout_s) from None
        except asyncio.CancelledError:
            job.gone_because = job.gone_because or "disconnected"
            raise
        finally:
            # Covers timeouts and cancelled clients: the worker drops the job's queued items,
            # and a result or failure it still delivers lands on a cancelled future, unread.
            job.cancelled = True
            job.future.cancel()
            self._admitted -= 1
            self.metrics.inflight.set(self._admitted)

    # --- the worker thread -------------------------------------------------------------

    def _work(self) -> None:
        while True:
            running = self._next()
            if running is None:
                return
            try:
                self._advance(running)
            except Exception as exc:  # a bug must fail its requests, not kill the worker
                log.exception("batch failed")
                self._forget(running)
                for job in {id(item.job): item.job for item in running.items}.values():
                    self._fail(job, exc)

    def _next(self) -> Running | None:
        """Block for work; return what runs a layer next, or None once stopping with nothing left."""
        with self._cond:
            while True:
                self._drop_dead_items()
                if self._pending or self._running:
                    break
                if self._stopping:
                    return None
                self._cond.wait()
            now = self.clock()
            candidate = self._candidate(now) if len(self._running) < self.max_running else None
            best = min(self._running, key=lambda r: self._score(r, now), default=None)
            if candidate is not None and (best is None or self._score(candidate, now) < self._score(best, now)):
                taken = {id(item) for item in candidate.items}
                self._pending = deque(item for item in self._pending if id(item) not in taken)
                self._running.append(candidate)
                best = candidate
            self.metrics.running_batches.set(len(self._running))
            return best

    def _score(self, running: Running, now: float) -> float:
        """Shortest remaining work first, with ageing: estimated seconds left minus seconds waited."""
        return self.throughput.seconds(running.remaining()) - (now - running.waiting_since)

    def _candidate(self, now: float) -> Running | None:
        """The batch the queue would start next: the item of least work minus wait first, then
        queued items with its key and of like work (within SIMILAR_WORK either way, so a short
        input never waits inside a long one's batch) while the batch's real tokens fit."""
        if not self._pending:
            return None
        first = min(self._pending, key=lambda item: self.throughput.seconds(item.work) - (now - item.job.enqueued_at))
        batch, used = [first], first.tokens
        for item in self._pending:
            alike = first.work / SIMILAR_WORK <= item.work <= first.work * SIMILAR_WORK
            if item is not first and item.key == first.key and alike and fits(used, item.tokens, self.max_batch_tokens):
                batch.append(item)
                used += item.tokens
        oldest = min(item.job.enqueued_at for item in batch)
        return Running(batch, sum(item.work for item in batch), oldest)

    def _drop_dead_items(self) -> None:
        """Remove queued items of cancelled jobs; fail and remove jobs whose deadline has passed."""
        now = self.clock()
        alive: deque[Item] = deque()
        for item in self._pending:
            job = item.job
            if not job.cancelled and now >= job.deadline:
                self._fail(job, errors.deadline_exceeded(job.timeout_s))
            if job.cancelled:
                if job.started_at is None and item.index == 0:
                    self._job_left_queue()
                continue
            alive.append(item)
        self._pending = alive

    def _job_left_queue(self) -> None:
        self._waiting_jobs -= 1
        self.metrics.queue_depth.set(self._waiting_jobs)

    def _advance(self, running: Running) -> None:
        """Start `running` or run its next layer, dropping inputs nobody waits for; deliver it
        when its last layer is done."""
        wanted = running.wanted(self.clock())
        if len(wanted) < len(running.items):
            gone = [item for i, item in enumerate(running.items) if i not in wanted]
            for job in {id(item.job): item.job for item in gone if not item.job.cancelled}.values():
                job.gone_because = "deadline"
                self._fail(job, errors.deadline_exceeded(job.timeout_s))
            self._stopped(gone, running)
            if not wanted:
                self._forget(running)
                return
            if running.forward is not None:
                running.forward.keep(wanted)
            running.items = [running.items[i] for i in wanted]
        try:
            if running.forward is None:
                self._start(running)
            else:
                running.forward.step()
                self.metrics.layers.inc()
        except Abandoned:
            for job in {id(item.job): item.job for item in running.items if not item.job.cancelled}.values():
                job.gone_because = "deadline"
                self._fail(job, errors.deadline_exceeded(job.timeout_s))
            self._stopped(running.items, running)
            self._forget(running)
            return
        except (torch.OutOfMemoryError, MemoryError):
            pass  # handled outside the except: its traceback pins the batch's tensors
        else:
            running.waiting_since = self.clock()
            if running.forward.finished:
                self._finish_batch(running)
            return
        self._oom(running)

    def _start(self, running: Running) -> None:
        started = self.clock()
        with self._cond:
            for item in running.items:
                if item.job.started_at is None:
                    item.job.started_at = started
                    self._job_left_queue()
        for item in running.items:
            self.metrics.queue_duration.labels(method=item.spec.method).observe(started - item.job.enqueued_at)
            self.metrics.input_tokens.labels(method=item.spec.method).observe(item.tokens)
        running.started_at = started
        self._peak.reset()

        def check() -> None:
            if not running.wanted(self.clock()):
                raise Abandoned

        # Fidelity's exact re-runs compare against exact attention in float32.
        encoder = self.encoder.float32() if running.items[0].key.exact_rerun else self.encoder
        running.forward = encoder.start(
            [item.run.ids for item in running.items],
            [item.spec for item in running.items],
            running.items[0].key.adapter,
            check=check,
        )

    def _finish_batch(self, running: Running) -> None:
        vectors = running.forward.outputs([item.run.output for item in running.items])
        self._forget(running)
        self._deliver(running.items, vectors, running.started_at, self.clock(), self._peak.read())

    def _forget(self, running: Running) -> None:
        """Take a batch off the running list (its forward pass and tensors go with it)."""
        with self._cond:
            if running in self._running:
                self._running.remove(running)
            self.metrics.running_batches.set(len(self._running))
        running.forward = None

    def _stopped(self, items: list[Item], running: Running) -> None:
        """Count inputs whose work stopped because their request is gone."""
        if running.forward is None:
            return  # never started: nothing was computed for them
        for item in items:
            self.metrics.stopped_inputs.labels(reason=item.job.gone_because or "deadline").inc()
        log.info(
            "stopped %d input(s) after %d of %d layers: their requests are gone",
            len(items), running.forward.done, running.forward.layers,
        )  # fmt: skip

    def _oom(self, running: Running) -> None:
        """Out of memory: free what the attempt held and queue each half of the batch anew, down
        to single inputs. An input that does not fit alone fails its job with 503."""
        self._forget(running)
        self._free_memory()
        items = [item for item in running.items if not item.job.cancelled]
        if not items:
            return
        if len(items) == 1:
            item = items[0]
            log.warning("out of memory on a single input of %d tokens (request %s)", item.tokens, item.job.request_id)
            self._fail(item.job, errors.out_of_memory(item.tokens))
            return
        tokens = sum(item.tokens for item in items)
        log.warning("out of memory in a batch of %d inputs, %d tokens: retrying in halves", len(items), tokens)
        half = len(items) // 2
        with self._cond:
            for part in (items[:half], items[half:]):
                self._running.append(Running(part, sum(item.work for item in part), running.waiting_since))

    def _deliver(self, batch: list[Item], vectors: list[Tensor], started: float, finished: float, peak: int | None) -> None:
        """Record the batch's metrics and hand each item its vector; finish jobs now complete."""
        method = dominant_method((item.spec.method, item.tokens) for item in batch)
        self.metrics.inference_duration.labels(method=method).observe(finished - started)
        self.metrics.batch_size.labels(method=method).observe(len(batch))
        self.metrics.batch_tokens.labels(method=method).observe(sum(item.tokens for item in batch))
        if peak is not None:
            self.metrics.peak_memory.labels(method=method).observe(peak)
        for item, vector in zip(batch, vectors):
            job = item.job
            job.vectors[item.index] = vector
            job.spans[item.index] = (started, finished)
            job.remaining -= 1
            job.finished_at = finished
            if peak is not None:
                job.peak_memory = max(job.peak_memory or 0, peak)
            if job.remaining == 0:
                self._finish(job)

    def _free_memory(self) -> None:
        """Give back what a failed forward pass held, so the retry (and later batches) can use it."""
        gc.collect()
        if self.encoder.graphs is not None:
            self.encoder.graphs.clear()  # each captured batch shape holds a memory pool
        if self.encoder.device.type == "cuda":
            torch.cuda.empty_cache()

    def _finish(self, job: Job) -> None:
        started = job.started_at if job.started_at is not None else job.enqueued_at
        result = JobResult(
            vectors=torch.cat(job.vectors),  # type: ignore[arg-type]
            queue_s=started - job.enqueued_at,
            inference_s=job.finished_at - started,
            peak_memory=job.peak_memory,
            spans=tuple(job.spans),  # type: ignore[arg-type]
        )
        self._resolve(job, result, None)

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.cancelled = True
        self._resolve(job, None, exc)

    @staticmethod
    def _resolve(job: Job, result: JobResult | None, exc: BaseException | None) -> None:
        future, loop = job.future, job.loop
        if future is None or loop is None:
            return

        def deliver() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop closed under us during shutdown
            pass

    def snapshot(self) -> dict[str, Any]:
        """Queue state for debugging and tests."""
        with self._cond:
            return {
                "pending_items": len(self._pending),
                "running_batches": len(self._running),
                "waiting_jobs": self._waiting_jobs,
                "admitted": self._admitted,
            }

