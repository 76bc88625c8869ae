"""What one app holds while it runs: settings, metrics, and once loaded the encoder and scheduler."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastapi import Request

from clusterserve.engine import Scheduler
from clusterserve.kernels import AttentionSpec
from clusterserve.models import Encoder
from clusterserve.models.planning.cost import Throughput

from . import errors
from .metrics import Metrics
from .settings import Settings


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    default_spec: AttentionSpec
    encoder: Encoder | None = None  # once loaded; the one holder of the model's facts (limits, table, backend)
    scheduler: Scheduler | None = None
    ready: bool = False  # loaded, warmed up and not draining
    ready_since: int = 0  # Unix seconds at which it turned ready (the `created` of /v1/models)
    draining: bool = False
    load_error: str | None = None
    work_budget: float = float("inf")  # estimated work units a request may take (models.planning.cost)
    throughput: Throughput = field(default_factory=lambda: Throughput(1e9))  # this device's work units per second
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the start/drain hand-over

    def require_ready(self) -> tuple[Encoder, Scheduler]:
        """The encoder and scheduler, or 503 while loading, after a failed load, or draining."""
        if self.draining:
            raise errors.not_ready("the server is shutting down")
        if self.load_error is not None:
            raise errors.not_ready(f"the model failed to load: {self.load_error}")
        if not self.ready or self.encoder is None or self.scheduler is None:
            raise errors.not_ready()
        return self.encoder, self.scheduler


def get_state(request: Request) -> ServiceState:
    return request.app.state.service
