"""What one app holds while it runs: settings, metrics, and once loaded every served model with
its scheduler, work budget and throughput.

One model or several (`--model` more than once): the first is the default, which a request
that names no model gets. With one model served, a request's `model` is accepted and ignored
(OpenAI's clients send their own names); with several it picks one by name (`pick`), and a
name no served model answers to is a 404 naming `model`.
"""

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
from .names import answers_to
from .settings import Settings


@dataclass(frozen=True)
class Served:
    """One served model: its encoder (the one holder of the model's facts: limits, calibration
    table, backend), its scheduler, the work a request may take and this device's throughput."""

    encoder: Encoder
    scheduler: Scheduler
    work_budget: float  # estimated work units a request may take (models.planning.cost)
    throughput: Throughput  # this device's work units per second, measured on this model
    weight_bytes: int  # its weights (and a float32 fidelity reference's), in the shared memory budget

    @property
    def name(self) -> str:
        return self.encoder.name


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    default_spec: AttentionSpec
    models: dict[str, Served] = field(default_factory=dict)  # by name, the default first; set once all are warm
    ready: bool = False  # loaded, warmed up and not draining
    ready_since: int = 0  # Unix seconds at which it turned ready (the `created` of /v1/models)
    draining: bool = False
    load_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the start/drain hand-over

    @property
    def default(self) -> Served | None:
        return next(iter(self.models.values()), None)

    @property
    def encoder(self) -> Encoder | None:
        """The default model's encoder, once loaded."""
        default = self.default
        return default.encoder if default is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        """The default model's scheduler, once loaded."""
        default = self.default
        return default.scheduler if default is not None else None

    def require_ready(self) -> tuple[Encoder, Scheduler]:
        """The default model's encoder and scheduler, or 503 (see `pick`)."""
        served = self.pick(None)
        return served.encoder, served.scheduler

    def pick(self, model: str | None) -> Served:
        """The model a request asks for (module docstring), or 503 while loading, after a failed
        load, or draining; 404 naming `model` for a name no served model answers to."""
        if self.draining:
            raise errors.not_ready("the server is shutting down")
        if self.load_error is not None:
            raise errors.not_ready(f"the model failed to load: {self.load_error}")
        if not self.ready or not self.models:
            raise errors.not_ready()
        served = list(self.models.values())
        if model is None or len(served) == 1:
            return served[0]
        return self.named(model)

    def named(self, model: str, listed: str | None = None) -> Served:
        """The served model that answers to the name `model`, however many are served; else 404
        naming `model`, saying where the names are (`listed`; default: the names themselves)."""
        found = self.find(model)
        if found is None:
            where = listed or f"the served models: {', '.join(self.models)}"
            raise errors.ServiceError(404, "not_found", f"model {model!r} is not served here; {where}", "model")
        return found

    def find(self, model: str) -> Served | None:
        """The served model that answers to the name `model` (names.answers_to), if any."""
        return next((one for one in self.models.values() if answers_to(one.name, model)), None)

    def served(self, encoder: Encoder) -> Served:
        """The served entry of one of the served encoders."""
        return self.models[encoder.name]


def get_state(request: Request) -> ServiceState:
    return request.app.state.service
