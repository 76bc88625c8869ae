"""The scheduler: embedding requests queue here and one worker thread runs them in batches.

The pipeline (service.pipeline) plans a request (models.plan: tokens, each input's attention
spec) and submits a `Job`. The job's inputs enter a FIFO queue as `Item`s. The worker takes
the oldest item and joins to it every queued item with the same batch key (the task adapter)
while the batch's real tokens stay within the token budget (`models.plan.fits`, the rule
`Encoder.embed` batches by), and runs that batch as one packed forward pass (`encoder.run`:
each input attends by its own spec, no padding is computed). Each job gets its pooled
rows when its last item is done. Each input returns what its job asks (`Job.outputs`,
models.pooling.Output): its pooled vector, the means over token spans of a late-chunking
window, or every token's state; the batch's pass gives each its own (`encoder.encode`), so
inputs asking for different things share batches. Inference never runs on the event loop, so
health checks and metrics answer while a 30k-token batch is running.

Per request the worker records:
- queue time: arrival in the queue -> start of the first batch holding one of its inputs;
- inference time: that start -> end of the last batch holding one of its inputs;
- peak memory: the largest peak of those batches (see `metrics.PeakMemory`).

Admission is `Batcher.submit`'s check of `max_concurrent_requests`; a job carries its
deadline, and the worker drops expired or cancelled jobs before it runs them;
`_run_or_split` is the one place that catches out-of-memory: it frees what the attempt held
and retries each half of the batch, down to single inputs, so one input too big for memory
fails alone (503 naming its token count) and its batch-mates still get their vectors;
`stop` drains the queue before the worker exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kernels import AttentionSpec
from models import Encoder
from models.plan import fits
from models.pooling import POOLED, Output

from . import errors
from .metrics import Metrics, PeakMemory

log = logging.getLogger("clusterserve")


@dataclass(frozen=True)
class BatchKey:
    """Inputs batch together only when one forward pass can run them: the same task adapter
    (the weights). A request's exact re-runs ("fidelity": true) form batches of their own, so
    that its approximate passes are timed alone. Specs may differ: each sequence of a packed
    batch attends by its own."""

    adapter: str | None = None
    exact_rerun: bool = False


@dataclass
class Job:
    """One client request: its inputs (token ids, already within the length limit) and specs."""

    request_id: str
    inputs: list[list[int]]
    specs: list[AttentionSpec]  # resolved per input (models.plan): never "auto"
    adapter: str | None = None  # the task adapter every input runs with (None: the base weights)
    exact_reruns: int = 0  # the last this many inputs are exact re-runs of others ("fidelity": true)
    outputs: list[Output] | None = None  # per input, what it returns (None: each its pooled vector)
    deadline: float = float("inf")  # time.monotonic() by which it must be answered
    timeout_s: float = float("inf")  # the deadline's length, for the 504 message

    # Filled in by the scheduler.
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float = 0.0
    peak_memory: int | None = None
    vectors: list[Tensor | None] = field(default_factory=list)
    spans: list[tuple[float, float] | None] = field(default_factory=list)  # per input: its batch's run
    remaining: int = 0
    cancelled: bool = False  # set by the event loop; the worker skips the job's items
    future: asyncio.Future[JobResult] | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(frozen=True)
class JobResult:
    # Every input's rows, input after input: (sum of k_i, dim) float32 on the CPU, not
    # normalised (models.encoder.finish); k_i = Job.outputs[i].rows(tokens), 1 for a pooled input.
    vectors: Tensor
    queue_s: float
    inference_s: float
    peak_memory: int | None
    spans: tuple[tuple[float, float], ...] = ()  # per input: (start, end) of the forward pass that ran it

    def run_seconds(self, indices: list[int]) -> float:
        """Seconds of the forward passes that ran these inputs (a pass shared by several counts once)."""
        return sum(end - start for start, end in {self.spans[i] for i in indices})


@dataclass(frozen=True)
class Item:
    job: Job
    index: int
    key: BatchKey

    @property
    def tokens(self) -> int:
        return len(self.job.inputs[self.index])

    @property
    def spec(self) -> AttentionSpec:
        return self.job.specs[self.index]

    @property
    def output(self) -> Output:
        return self.job.outputs[self.index] if self.job.outputs is not None else POOLED


class Batcher:
    """Queue + one worker thread. `submit` is called on the event loop; the rest runs on the worker."""

    def __init__(
        self,
        encoder: Encoder,
        metrics: Metrics,
        max_batch_tokens: int,
        max_concurrent_requests: int,
    ) -> None:
        self.encoder = encoder
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_concurrent_requests = max_concurrent_requests
        self._pending: deque[Item] = deque()
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
        if time.monotonic() >= job.deadline:  # expired while tokenizing: never queued, never run
            raise errors.deadline_exceeded(job.timeout_s)
        loop = asyncio.get_running_loop()
        job.loop, job.future = loop, loop.create_future()
        job.vectors = [None] * len(job.inputs)
        job.spans = [None] * len(job.inputs)
        job.remaining = len(job.inputs)
        job.enqueued_at = time.monotonic()
        self._admitted += 1
        self.metrics.inflight.set(self._admitted)
        with self._cond:
            self._waiting_jobs += 1
            self.metrics.queue_depth.set(self._waiting_jobs)
            first_rerun = len(job.inputs) - job.exact_reruns
            for index in range(len(job.inputs)):
                self._pending.append(Item(job, index, BatchKey(job.adapter, index >= first_rerun)))
            self._cond.notify()
        try:
            remaining = job.deadline - time.monotonic()
            return await asyncio.wait_for(asyncio.shield(job.future), timeout=max(remaining, 0.0))
        except TimeoutError:
            raise errors.deadline_exceeded(job.timeout_s) from None
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
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            except Exception as exc:  # a bug must fail its requests, not kill the worker
                log.exception("batch failed")
                for job in {id(item.job): item.job for item in batch}.values():
                    self._fail(job, exc)

    def _next_batch(self) -> list[Item] | None:
        """Block for work; return the next batch, or None once stopping with nothing queued."""
        with self._cond:
            while True:
                self._drop_dead_items()
                if self._pending:
                    break
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._pending[0]
            batch, used, keep = [], 0, deque()
            for item in self._pending:
                if item.key == first.key and fits(used, item.tokens, self.max_batch_tokens):
                    batch.append(item)
                    used += item.tokens
                else:
                    keep.append(item)
            self._pending = keep
            return batch

    def _drop_dead_items(self) -> None:
        """Remove items of cancelled jobs; fail and remove jobs whose deadline has passed."""
        now = time.monotonic()
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

    def _run_batch(self, batch: list[Item]) -> None:
        started = time.monotonic()
        with self._cond:
            for item in batch:
                if item.job.started_at is None:
                    item.job.started_at = started
                    self._job_left_queue()
        for item in batch:
            self.metrics.queue_duration.labels(method=item.spec.method).observe(started - item.job.enqueued_at)
            self.metrics.input_tokens.labels(method=item.spec.method).observe(item.tokens)
        self._run_or_split(batch)

    def _run_or_split(self, batch: list[Item]) -> None:
        """Embed `batch`; on out-of-memory, free what the attempt held and retry each half,
        down to single inputs. An input that does not fit alone fails its job with 503."""
        batch = [item for item in batch if not item.job.cancelled]  # a failed sibling, a gone client
        if not batch:
            return
        started = time.monotonic()
        self._peak.reset()
        vectors = self._embed(batch)
        if vectors is None:
            self._split_after_out_of_memory(batch)
            return
        self._deliver(batch, vectors, started, time.monotonic(), self._peak.read())

    def _embed(self, batch: list[Item]) -> list[Tensor] | None:
        """One forward pass over the batch as formed here -> per item its (k, dim) float32 rows
        on the CPU (its `output`), or None when it ran out of memory (what the attempt held is
        freed first)."""
        try:
            return self.encoder.encode(
                [item.job.inputs[item.index] for item in batch],
                [item.spec for item in batch],
                [item.output for item in batch],
                batch[0].key.adapter,
            )
        except (torch.OutOfMemoryError, MemoryError):
            pass  # handled outside the except: its traceback pins the batch's tensors
        self._free_memory()
        return None

    def _split_after_out_of_memory(self, batch: list[Item]) -> None:
        if len(batch) == 1:
            item = batch[0]
            log.warning("out of memory on a single input of %d tokens (request %s)", item.tokens, item.job.request_id)
            self._fail(item.job, errors.out_of_memory(item.tokens))
            return
        tokens = sum(item.tokens for item in batch)
        log.warning("out of memory in a batch of %d inputs, %d tokens: retrying in halves", len(batch), tokens)
        half = len(batch) // 2
        self._run_or_split(batch[:half])
        self._run_or_split(batch[half:])

    def _deliver(self, batch: list[Item], vectors: list[Tensor], started: float, finished: float, peak: int | None) -> None:
        """Record the batch's metrics and hand each item its vector; finish jobs now complete."""
        method = dominant_method(batch)
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
            return {"pending_items": len(self._pending), "waiting_jobs": self._waiting_jobs, "admitted": self._admitted}


def dominant_method(batch: list[Item]) -> str:
    """The attention method that a batch's per-batch metrics are labelled with: the one that
    runs the most of its tokens (a packed batch may mix methods)."""
    tokens: dict[str, int] = {}
    for item in batch:
        tokens[item.spec.method] = tokens.get(item.spec.method, 0) + item.tokens
    return max(tokens, key=lambda method: tokens[method])
