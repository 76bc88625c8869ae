"""The engine between the models and HTTP: a scheduler that queues planned jobs and runs them
in packed batches, a layer at a time, with typed errors and the fidelity re-run. It imports
neither FastAPI nor Prometheus; what it counts goes to an injected Observer.

    from clusterserve.engine import Job, Run, Scheduler
    scheduler = Scheduler(encoder, max_batch_tokens=16384, max_concurrent_requests=64)
    scheduler.start()
    result = await scheduler.submit(Job("request-1", [Run(ids, spec)]))   # result.vectors
"""

from clusterserve.engine.errors import Cancelled, DeadlineExceeded, EngineError, OutOfMemory, Overloaded, ShuttingDown
from clusterserve.engine.jobs import BatchKey, Job, JobResult, Run, dominant_method
from clusterserve.engine.observer import Observer
from clusterserve.engine.scheduler import Scheduler

__all__ = [
    "BatchKey", "Cancelled", "DeadlineExceeded", "EngineError", "Job", "JobResult", "Observer", "OutOfMemory",
    "Overloaded", "Run", "Scheduler", "ShuttingDown", "dominant_method",
]
