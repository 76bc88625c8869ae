"""The scheduler: jobs queue here and one worker thread runs them, a layer at a time.

A caller plans a request into a `Job` of `Run`s (engine.jobs) and submits it. Each run enters
the queue as an `Item`. The worker forms packed batches (engine.batches: like work, one key,
within the token budget) and runs each as a packed forward pass (`Encoder.start`): each input
attends by its own spec, no padding is computed. Each sequence returns what its run asks
(`Run.output`, models.pooling.Output), so inputs asking for different things share batches.

Batches run one layer at a time (`Forward.step`). Between layers the worker chooses what runs
next, among the running batches and the batch the queue would form next: the one with the
least estimated remaining work, minus the seconds it has waited. A short request therefore
waits for at most about one layer of a long one, and a long one still advances while short
ones keep coming, once it has waited as long as its remaining work. At most `max_running`
batches are in progress at once.

Between layers, and between the attention stages of a layer, the worker also drops work
nobody waits for: inputs of a job that passed its deadline or was withdrawn leave their batch
(`Forward.keep`); a batch left with none stops. Each job gets its rows when its last input is
done; inference never runs on the event loop.

Per job the worker records queue time (arrival in the queue -> start of the first batch
holding one of its inputs), inference time (that start -> end of the last batch holding one
of its inputs) and peak memory (the largest of those batches', engine.memory); what it counts
goes to an `Observer` (engine.observer). Failures are engine.errors: 429-like `Overloaded` at
admission, `DeadlineExceeded`, `OutOfMemory` for an input that does not fit even alone (its
batch is retried in halves first, so its batch-mates still get their rows), `Cancelled` for a
withdrawn job, `ShuttingDown` once `stop` began (which drains the queue before the worker exits).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, Callable

import torch

from clusterserve.models.planning.cost import Throughput

from .batches import Abandoned, Batch, next_batch
from .errors import Cancelled, DeadlineExceeded, OutOfMemory, Overloaded, ShuttingDown
from .jobs import BatchKey, Item, Job, JobResult, dominant_method, jobs_of
from .memory import PeakMemory, free_memory
from .observer import Observer, Unobserved

log = logging.getLogger("clusterserve")


class Scheduler:
    """Queue + one worker thread. `submit` is called on the event loop; the rest runs on the worker.

    encoder: what runs the batches (`start`, `float32`, `device`, `graphs`); max_batch_tokens:
    real tokens per batch; max_concurrent_requests: jobs admitted at once; throughput: this
    device's work units per second (None: one unit a nanosecond); clock: seconds, for
    deadlines, waiting and timings (tests pass a clock they move themselves)."""

    def __init__(
        self,
        encoder: Any,
        max_batch_tokens: int,
        max_concurrent_requests: int,
        throughput: Throughput | None = None,
        observer: Observer | None = None,
        max_running: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.encoder = encoder
        self.max_batch_tokens = max_batch_tokens
        self.max_concurrent_requests = max_concurrent_requests
        self.throughput = throughput or Throughput(1e9)
        self.observer = observer or Unobserved()
        self.max_running = max_running
        self.clock = clock
        self._pending: deque[Item] = deque()
        self._running: list[Batch] = []
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
        """Queue `job` and wait for its rows. Raises ShuttingDown, Overloaded or DeadlineExceeded;
        cancelling the call withdraws the job."""
        if self._stopping:
            raise ShuttingDown()
        if self._admitted >= self.max_concurrent_requests:
            raise Overloaded(self.max_concurrent_requests)
        if self.clock() >= job.deadline:  # expired before it was submitted: never queued, never run
            raise DeadlineExceeded(job.timeout_s)
        self._enqueue(job, asyncio.get_running_loop())
        try:
            remaining = job.deadline - self.clock()
            return await asyncio.wait_for(asyncio.shield(job.future), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:
            job.gone_because = "deadline"
            raise DeadlineExceeded(job.timeout_s) from None
        except asyncio.CancelledError:
            job.gone_because = job.gone_because or "disconnected"
            raise
        finally:
            # Covers timeouts and withdrawn jobs: the worker drops the job's queued items, and a
            # result or failure it still delivers lands on a cancelled future, unread.
            job.cancelled = True
            job.future.cancel()
            self._admitted -= 1
            self.observer.admitted(self._admitted)

    async def submit_unless(self, job: Job, gone: Awaitable[Any]) -> JobResult:
        """`submit(job)`, withdrawn if `gone` (the client went away) completes first: its queued
        inputs are dropped unrun and its running ones stop; raises Cancelled then."""
        submitted = asyncio.ensure_future(self.submit(job))
        watch = asyncio.ensure_future(gone)
        done: set[asyncio.Future[Any]] = set()
        try:
            done, _ = await asyncio.wait({submitted, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not submitted.done():
                submitted.cancel()  # submit's own clean-up marks the job cancelled for the worker
                await asyncio.wait({submitted})
        if submitted in done:
            return submitted.result()
        raise Cancelled()

    def _enqueue(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        job.loop, job.future = loop, loop.create_future()
        job.vectors = [None] * len(job.runs)
        job.spans = [None] * len(job.runs)
        job.remaining = len(job.runs)
        job.enqueued_at = self.clock()
        self._admitted += 1
        self.observer.admitted(self._admitted)
        with self._cond:
            self._waiting_jobs += 1
            self.observer.waiting(self._waiting_jobs)
            for index, run in enumerate(job.runs):
                self._pending.append(Item(job, index, BatchKey(job.adapter, run.exact_rerun)))
            self._cond.notify()

    def snapshot(self) -> dict[str, Any]:
        """Queue state for debugging and tests."""
        with self._cond:
            return {
                "pending_items": len(self._pending),
                "running_batches": len(self._running),
                "waiting_jobs": self._waiting_jobs,
                "admitted": self._admitted,
            }

    # --- the worker thread -------------------------------------------------------------

    def _work(self) -> None:
        while True:
            batch = self._next()
            if batch is None:
                return
            try:
                self._advance(batch)
            except Exception as exc:  # a bug must fail its jobs, not kill the worker
                log.exception("batch failed")
                self._forget(batch)
                for job in jobs_of(batch.items):
                    self._fail(job, exc)

    def _next(self) -> Batch | None:
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
            fresh = None
            if len(self._running) < self.max_running:
                fresh = next_batch(self._pending, self.throughput, self.max_batch_tokens, now)
            best = min(self._running, key=lambda b: b.score(self.throughput, now), default=None)
            if fresh is not None and (best is None or fresh.score(self.throughput, now) < best.score(self.throughput, now)):
                taken = {id(item) for item in fresh.items}
                self._pending = deque(item for item in self._pending if id(item) not in taken)
                self._running.append(fresh)
                best = fresh
            self.observer.running(len(self._running))
            return best

    def _drop_dead_items(self) -> None:
        """Remove queued items of cancelled jobs; fail and remove jobs whose deadline has passed."""
        now = self.clock()
        alive: deque[Item] = deque()
        for item in self._pending:
            job = item.job
            if not job.cancelled and now >= job.deadline:
                self._fail(job, DeadlineExceeded(job.timeout_s))
            if job.cancelled:
                if job.started_at is None and item.index == 0:
                    self._job_left_queue()
                continue
            alive.append(item)
        self._pending = alive

    def _job_left_queue(self) -> None:
        self._waiting_jobs -= 1
        self.observer.waiting(self._waiting_jobs)

    def _advance(self, batch: Batch) -> None:
        """Start `batch` or run its next layer, dropping inputs nobody waits for; deliver it
        when its last layer is done."""
        if not self._keep_wanted(batch):
            return
        try:
            if batch.forward is None:
                self._start(batch)
            else:
                batch.forward.step()
                self.observer.layer()
        except Abandoned:
            self._fail_past_deadline(batch.items)
            self._stopped(batch.items, batch)
            self._forget(batch)
            return
        except (torch.OutOfMemoryError, MemoryError):
            pass  # handled outside the except: its traceback pins the batch's tensors
        else:
            batch.waiting_since = self.clock()
            if batch.forward.finished:
                self._finish_batch(batch)
            return
        self._oom(batch)

    def _keep_wanted(self, batch: Batch) -> bool:
        """Drop the batch's inputs whose job is gone or past its deadline (failing the latter);
        False when none is left and the batch is forgotten."""
        wanted = batch.wanted(self.clock())
        if len(wanted) == len(batch.items):
            return True
        gone = [item for i, item in enumerate(batch.items) if i not in wanted]
        self._fail_past_deadline(gone)
        self._stopped(gone, batch)
        if not wanted:
            self._forget(batch)
            return False
        if batch.forward is not None:
            batch.forward.keep(wanted)
        batch.items = [batch.items[i] for i in wanted]
        return True

    def _fail_past_deadline(self, items: list[Item]) -> None:
        for job in jobs_of(item for item in items if not item.job.cancelled):
            job.gone_because = "deadline"
            self._fail(job, DeadlineExceeded(job.timeout_s))

    def _start(self, batch: Batch) -> None:
        started = self.clock()
        with self._cond:
            for item in batch.items:
                if item.job.started_at is None:
                    item.job.started_at = started
                    self._job_left_queue()
        for item in batch.items:
            self.observer.started(item.spec.method, started - item.job.enqueued_at, item.tokens)
        batch.started_at = started
        self._peak.reset()

        def check() -> None:
            if not batch.wanted(self.clock()):
                raise Abandoned

        # Exact re-runs (engine.fidelity) compare against exact attention in float32.
        key = batch.items[0].key
        encoder = self.encoder.float32() if key.exact_rerun else self.encoder
        batch.forward = encoder.start(
            [item.run.ids for item in batch.items], [item.spec for item in batch.items], key.adapter, check=check
        )

    def _finish_batch(self, batch: Batch) -> None:
        vectors = batch.forward.outputs([item.run.output for item in batch.items])
        self._forget(batch)
        self._deliver(batch.items, vectors, batch.started_at, self.clock(), self._peak.read())

    def _forget(self, batch: Batch) -> None:
        """Take a batch off the running list (its forward pass and tensors go with it)."""
        with self._cond:
            if batch in self._running:
                self._running.remove(batch)
            self.observer.running(len(self._running))
        batch.forward = None

    def _stopped(self, items: list[Item], batch: Batch) -> None:
        """Count inputs whose work stopped because their job is gone."""
        if batch.forward is None:
            return  # never started: nothing was computed for them
        for item in items:
            self.observer.stopped(item.job.gone_because or "deadline", 1)
        log.info(
            "stopped %d input(s) after %d of %d layers: their requests are gone",
            len(items), batch.forward.done, batch.forward.layers,
        )  # fmt: skip

    def _oom(self, batch: Batch) -> None:
        """Out of memory: free what the attempt held and queue each half of the batch anew, down
        to single inputs. An input that does not fit alone fails its job with OutOfMemory."""
        self._forget(batch)
        free_memory(self.encoder)
        items = [item for item in batch.items if not item.job.cancelled]
        if not items:
            return
        if len(items) == 1:
            item = items[0]
            log.warning("out of memory on a single input of %d tokens (request %s)", item.tokens, item.job.request_id)
            self._fail(item.job, OutOfMemory(item.tokens))
            return
        tokens = sum(item.tokens for item in items)
        log.warning("out of memory in a batch of %d inputs, %d tokens: retrying in halves", len(items), tokens)
        half = len(items) // 2
        with self._cond:
            for part in (items[:half], items[half:]):
                self._running.append(Batch.of(part, batch.waiting_since))

    def _deliver(self, items: list[Item], vectors: list[torch.Tensor], started: float, finished: float,
                 peak: int | None) -> None:
        """Report the batch and hand each item its rows; finish jobs now complete."""
        method = dominant_method((item.spec.method, item.tokens) for item in items)
        self.observer.finished(method, finished - started, len(items), sum(item.tokens for item in items), peak)
        for item, vector in zip(items, vectors):
            job = item.job
            job.vectors[item.index] = vector
            job.spans[item.index] = (started, finished)
            job.remaining -= 1
            job.finished_at = finished
            if peak is not None:
                job.peak_memory = max(job.peak_memory or 0, peak)
            if job.remaining == 0:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        started = job.started_at if job.started_at is not None else job.enqueued_at
        result = JobResult(
            vectors=torch.cat(job.vectors),  # type: ignore[arg-type]
            queue_s=started - job.enqueued_at,
            inference_s=job.finished_at - started,
            peak_memory=job.peak_memory,
            spans=tuple(job.spans),  # type: ignore[arg-type]
        )
        _resolve(job, result, None)

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.cancelled = True
        _resolve(job, None, exc)


def _resolve(job: Job, result: JobResult | None, exc: BaseException | None) -> None:
    """Hand the job's result or failure to its future, on its event loop."""
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
