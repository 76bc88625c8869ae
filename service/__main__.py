"""`clusterserve serve [--host H] [--port P] [--model M [--model M2 ...]] [--<setting> VALUE ...]`.

Every field of `Settings` is a flag (`max_batch_tokens` -> `--max-batch-tokens`); flags win
over `CLUSTERSERVE_*` environment variables, which win over the defaults.
"""

from __future__ import annotations

import argparse
import signal
import sys
import typing
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from clusterserve.models.loader import resolve_model

from .logs import configure as configure_logging
from .settings import Settings


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="clusterserve serve", description="Serve long-document embeddings over HTTP.")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} (env CLUSTERSERVE_{name.upper()})"
        if _is_bool(field.annotation):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name == "model":  # more than once: the first is the default, the others more_models
            parser.add_argument(flag, dest=name, action="append", default=None, metavar="MODEL", help=help_text)
        elif name == "more_models":
            continue
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
    given = {name: value for name, value in vars(parser.parse_args(argv)).items() if value is not None}
    if "model" in given:
        given["model"], *more = given["model"]
        if more:
            given["more_models"] = more
    try:
        return Settings(**given)
    except ValidationError as exc:
        parser.error(_explain(exc))
        raise  # unreachable: parser.error exits


def _is_bool(annotation: object) -> bool:
    return annotation is bool or bool in typing.get_args(annotation)


def _explain(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    for model in settings.served_models():
        try:
            resolve_model(model)
        except FileNotFoundError as error:
            sys.exit(f"--model: {error}")
    configure_logging(settings.log_format, settings.log_level)
    from .app import create_app
    from .tracing import TracingConfigError

    try:
        app = create_app(settings)
    except TracingConfigError as error:
        sys.exit(f"tracing: {error}")
    # uvicorn drains on SIGTERM, then re-raises it under the handler it found at start-up.
    # Make that handler a clean exit, so an orchestrator's stop is exit status 0, not -15.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go through our handler, in our format
        access_log=False,  # the middleware writes one access line per request, with its id
        timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]  # a float works
    )


if __name__ == "__main__":
    main()
