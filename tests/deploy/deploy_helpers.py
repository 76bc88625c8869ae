"""Helpers of the deployment tests: paths, YAML with Compose's tags, the names a PromQL
expression refers to, and the routes and settings of the real app."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "clusterserve.json"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"


class ComposeLoader(yaml.SafeLoader):
    """SafeLoader that keeps Compose's merge tags (`!reset`, `!override`) as `Tagged` values."""


class Tagged:
    def __init__(self, tag: str, value: Any):
        self.tag, self.value = tag, value

    def __repr__(self) -> str:
        return f"{self.tag} {self.value!r}"


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        value: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return Tagged("!" + suffix, value)


ComposeLoader.add_multi_constructor("!", _construct_tagged)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def get_routes() -> set[tuple[str, str]]:
    """(HTTP method, path) of every route of the real app, read from its OpenAPI schema
    (building the app loads no model)."""
    from clusterserve.service.app import create_app
    from clusterserve.service.settings import Settings

    paths = create_app(Settings(warmup=False)).openapi()["paths"]
    return {(method.upper(), path) for path, operations in paths.items() for method in operations}


# ---------------------------------------------------------------------------------------------
# PromQL: which metrics, functions and labels an expression names. A tokenizer, not a parser:
# it strips strings and ranges, collects grouping and matcher labels, and reads what is left.

PROMQL_FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
    clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month
    deg delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate
    label_join label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar
    sgn sin sinh sort sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time
    timestamp vector year""".split()
)
PROMQL_AGGREGATIONS = frozenset(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio".split()
)
_GROUPING_KEYWORDS = ("by", "without", "on", "ignoring", "group_left", "group_right")
_KEYWORDS = frozenset((*_GROUPING_KEYWORDS, "and", "or", "unless", "offset", "bool", "atan2", "inf", "nan"))
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(" + "|".join(_GROUPING_KEYWORDS) + r")\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_TOKEN = re.compile(r"(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)|([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def promql_names(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, function and aggregation names, label names) that `expr` refers to."""
    labels: set[str] = set()
    text = _STRING.sub('""', expr)
    text = _RANGE.sub("", text)

    def grouping(match: re.Match[str]) -> str:
        labels.update(name.strip() for name in match.group(2).split(",") if name.strip())
        return match.group(1)

    def matchers(match: re.Match[str]) -> str:
        labels.update(_MATCHER_LABEL.findall(match.group(1)))
        return " "

    text = _GROUPING.sub(grouping, text)
    text = _MATCHERS.sub(matchers, text)
    metrics: set[str] = set()
    functions: set[str] = set()
    for number, name, call in _TOKEN.findall(text):
        if number or not name or name in _KEYWORDS:
            continue
        if call or name in PROMQL_AGGREGATIONS:  # `sum by (x) (...)`: no parenthesis after `sum`
            functions.add(name)
        else:
            metrics.add(name)
    return metrics, functions, labels


# ---------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore.


def dockerfile_commands() -> list[Any]:
    """The Dockerfile's instructions, parsed by BuildKit's own parser (package `dockerfile`)."""
    import dockerfile

    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def dockerfile_user() -> tuple[int, int]:
    """(uid, gid) of the last USER instruction, which must be numeric."""
    users = [c.value[0] for c in dockerfile_commands() if c.cmd == "USER"]
    uid, _, gid = users[-1].partition(":")
    return int(uid), int(gid or uid)


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go's filepath.Match plus `**`) as a regex on slash paths."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def dockerignored(relative_path: str) -> bool:
    """Whether .dockerignore keeps `relative_path` out of the build context.

    As Docker decides it: the last matching line wins, `!` lines re-include, and a pattern that
    matches a directory excludes everything below it.
    """
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    parts = relative_path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        regex = _dockerignore_regex(body.strip().lstrip("/").rstrip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


# ---------------------------------------------------------------------------------------------
# Server settings as the deployment sets them.


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as kustomize's configMapGenerator `envs` reads them (# comments)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
            values[key.strip()] = value
    return values


def settings_from_env(env: dict[str, str]) -> Any:
    """The server's `Settings` built from CLUSTERSERVE_* variables only (ValidationError if bad)."""
    import os
    from unittest import mock

    from clusterserve.service.settings import Settings

    with mock.patch.dict(os.environ, env):  # restores the environment on exit
        for name in [n for n in os.environ if n.startswith("CLUSTERSERVE_") and n not in env]:
            del os.environ[name]
        return Settings()


def drain_seconds(request_timeout_s: float) -> float:
    """The longest a SIGTERM'd server can take to exit, past any preStop hook.

    uvicorn first waits for open requests, which the request deadline bounds, then the lifespan
    stops the scheduler, which waits for its worker (`Scheduler.stop`'s timeout, or a
    `drain_timeout_s` setting if the service has one).
    """
    import inspect

    from clusterserve.engine import Scheduler
    from clusterserve.service.settings import Settings

    field = Settings.model_fields.get("drain_timeout_s")
    scheduler = field.default if field is not None else inspect.signature(Scheduler.stop).parameters["timeout_s"].default
    return request_timeout_s + float(scheduler)
