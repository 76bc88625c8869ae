"""Log output: one line per request on the `clusterserve.access` logger, as text or JSON.

`configure(settings)` installs the root handler (`clusterserve serve` calls it). With
`log_format="json"` every log line is one JSON object (`ts`, `level`, `logger`, `message`,
plus the request's fields on access lines), which log shippers parse without a pattern.
The access line holds the request id, route, HTTP method, status, attention method, tokens
and timings; never a header's value, so an API key cannot reach the logs.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

access_log = logging.getLogger("clusterserve.access")
ACCESS_FIELD = "access"  # the LogRecord attribute holding an access line's fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, ACCESS_FIELD, {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(log_format: str, level: str) -> None:
    """Send every logger (uvicorn's included) to one stderr handler in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# Probes and scrapes arrive every few seconds: their lines are debug, not info.
_QUIET_ROUTES = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})


def log_request(fields: dict[str, Any]) -> None:
    """One access line: readable as text, every field separate in JSON."""
    level = logging.DEBUG if fields.get("route") in _QUIET_ROUTES else logging.INFO
    text = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
    access_log.log(level, text, extra={ACCESS_FIELD: fields})
