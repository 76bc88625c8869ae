"""deploy/compose.yaml and its CPU override: they parse (and pass the Compose specification's
own checks where the `compose-spec` parser is installed), and every file, service name, port
and setting they refer to exists. Prometheus' own `promtool` checks its config."""

from __future__ import annotations

import shutil
import subprocess
from urllib.parse import urlparse

import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    PROMETHEUS_CONFIG,
    ROOT,
    Tagged,
    dockerfile_commands,
    drain_seconds,
    load_yaml,
    settings_from_env,
)

COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_CPU = DEPLOY / "compose.cpu.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


def bind_mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to deploy/) of the service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = source
    return mounts


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_CPU], ids=lambda p: p.name)
def test_compose_file_passes_the_compose_specification(path):
    compose_spec = pytest.importorskip(
        "compose_spec", reason="the Compose parser (test extra `compose-spec`, Linux x86-64 wheels) is not installed"
    )
    compose_spec.PyCompose.from_yaml(path.read_text())  # raises on an unknown key or a bad value


def test_service_builds_from_the_repository_dockerfile(compose):
    build = compose["services"]["clusterserve"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).is_file()


def test_service_publishes_the_image_port_and_reserves_a_gpu(compose):
    service = compose["services"]["clusterserve"]
    exposed = next(c.value[0] for c in dockerfile_commands() if c.cmd == "EXPOSE")
    assert any(port.split(":")[-1] == exposed for port in service["ports"])
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]


def test_cpu_variant_drops_the_gpu_reservation():
    override = load_yaml(COMPOSE_CPU)["services"]
    base = load_yaml(COMPOSE)["services"]
    assert set(override) <= set(base), "an override service that the base lacks would be a new, unbuilt service"
    deploy = override["clusterserve"]["deploy"]
    assert isinstance(deploy, Tagged) and deploy.tag == "!reset"
    assert override["clusterserve"]["environment"]["CLUSTERSERVE_DEVICE"] == "cpu"


def test_environment_is_valid_server_settings(compose):
    env = {k: str(v) for k, v in compose["services"]["clusterserve"]["environment"].items()}
    env.update(load_yaml(COMPOSE_CPU)["services"]["clusterserve"]["environment"])
    settings = settings_from_env(env)
    stop = compose["services"]["clusterserve"]["stop_grace_period"]
    assert stop.endswith("s") and float(stop[:-1]) > drain_seconds(settings.request_timeout_s)


def test_prometheus_mounts_the_config_it_is_told_to_read(compose):
    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_in_container = flag.split("=", 1)[1]
    assert (DEPLOY / mounts[config_in_container]).resolve() == PROMETHEUS_CONFIG


def test_prometheus_config_scrapes_the_compose_service(compose):
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    (target,) = static["targets"]
    host, port = target.split(":")
    assert host in compose["services"]
    assert port == next(c.value[0] for c in dockerfile_commands() if c.cmd == "EXPOSE")
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian package `prometheus`, installed by .ci/run)")
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    url = urlparse(datasource["url"])
    assert datasource["type"] == "prometheus" and url.hostname in compose["services"]
    assert str(url.port) in {p.split(":")[-1] for p in compose["services"][url.hostname]["ports"]}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "clusterserve.yaml").read_text())["providers"]
    dashboards_folder = provider["options"]["path"]
    assert dashboards_folder in mounts, "the dashboard provider reads a folder compose does not mount"
    host_folder = DEPLOY / mounts[dashboards_folder]
    assert (host_folder / "clusterserve.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_folder + "/") and (host_folder / home.rsplit("/", 1)[1]).is_file()
