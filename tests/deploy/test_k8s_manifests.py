"""The Kubernetes manifests: schema validation (kubernetes-validate's offline schemas, strict, so
an unknown field fails), kustomize rendering (`kubectl kustomize` where installed, a file-level
check everywhere), and the cross-references a schema cannot see: probes on real routes,
selectors that select, the HPA metric that prometheus-adapter serves, the drain budget."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from deploy_helpers import (
    ADAPTER_VALUES,
    K8S,
    dockerfile_user,
    drain_seconds,
    get_routes,
    load_yaml_documents,
    read_env_file,
    settings_from_env,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="test extra `kubernetes-validate` is not installed")

# The oldest Kubernetes still common in managed clusters, and the newest the package knows.
KUBE_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# Custom resources: no schema ships with kubernetes-validate; checked field by field below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
OVERLAYS = {
    "base": {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"},
    "with-monitoring": {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                        "ServiceMonitor"},
}
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))


def documents(path):
    return load_yaml_documents(path)


def one(kind: str, folder: str = "base") -> dict:
    found = [d for p in sorted((K8S / folder).glob("*.yaml")) for d in documents(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {folder}, found {len(found)}"
    return found[0]


def validate(resource: dict) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            name = f"{resource['kind']}/{resource['metadata']['name']}"
            pytest.fail(f"{name} invalid for Kubernetes {version}: {path}: {exc.message}")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schemas(path):
    docs = documents(path)
    assert docs, f"{path} holds no object"
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            validate(doc)


def test_only_known_custom_resources_skip_schema_validation():
    kinds = {(d["apiVersion"], d["kind"]) for p in MANIFESTS for d in documents(p)}
    # Everything else has a schema; a new CRD here needs a structural test like the ServiceMonitor's.
    assert kinds & CUSTOM_KINDS == CUSTOM_KINDS
    for api_version, kind in kinds - CUSTOM_KINDS:
        assert "." not in api_version.split("/")[0] or api_version.split("/")[0].endswith(".k8s.io"), (
            f"{kind} ({api_version}) looks like a custom resource"
        )


# --------------------------------------------------------------------------------------------- kustomize


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.parent.relative_to(K8S)))
def test_kustomization_references_files_that_exist_and_parse(path):
    folder = path.parent
    spec = yaml.safe_load(path.read_text())
    assert spec["apiVersion"].startswith("kustomize.config.k8s.io/")
    assert spec["kind"] in ("Kustomization", "Component")
    known = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "images", "labels",
             "namespace", "patches", "namePrefix", "commonAnnotations"}
    assert set(spec) <= known, f"unexpected keys {set(spec) - known}"
    listed = set()
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{entry}: a folder without kustomization.yaml"
        else:
            assert target.is_file(), f"resource {entry} does not exist"
            assert documents(target), f"resource {entry} is empty"
            listed.add(target)
    for entry in spec.get("components", []):
        component = yaml.safe_load((folder / entry / "kustomization.yaml").read_text())
        assert component["kind"] == "Component", f"{entry} is not a kustomize Component"
    for generator in spec.get("configMapGenerator", []):
        for env_file in generator.get("envs", []):
            read_env_file(folder / env_file)  # exists and is KEY=VALUE lines
    # No manifest lies in a folder without being applied.
    assert set(folder.glob("*.yaml")) - {path} == listed


def kustomize(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: kustomize rendering is not run (the file-level check above still is)")
    result = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kustomize_renders_valid_objects_that_reference_each_other(overlay):
    rendered = kustomize(overlay)
    assert {d["kind"] for d in rendered} == OVERLAYS[overlay]
    for doc in rendered:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            validate(doc)
    by_kind = {d["kind"]: d for d in rendered}
    config_map = by_kind["ConfigMap"]["metadata"]["name"]
    assert re.fullmatch(r"clusterserve-settings-[a-z0-9]{10}", config_map), "generated name carries a content hash"
    container = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"][0]["configMapRef"]["name"] == config_map
    assert container["image"] == "clusterserve:0.1.0"


# --------------------------------------------------------------------------------------------- settings


def settings_env() -> dict[str, str]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    (env_file,) = generator["envs"]
    return read_env_file(K8S / "base" / env_file)


def test_configmap_settings_are_valid_server_settings():
    from clusterserve.service.settings import Settings

    env = settings_env()
    assert env
    for name in env:
        assert name.startswith("CLUSTERSERVE_") and name.removeprefix("CLUSTERSERVE_").lower() in Settings.model_fields, name
    settings = settings_from_env(env)  # raises ValidationError on a bad value
    assert settings.device == "cuda"


# --------------------------------------------------------------------------------------------- Deployment


@pytest.fixture(scope="module")
def deployment() -> dict:
    return one("Deployment")


def pod_spec(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


def container(deployment) -> dict:
    (only,) = pod_spec(deployment)["containers"]
    return only


def test_deployment_requests_one_gpu_and_sized_resources(deployment):
    resources = container(deployment)["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"].get("nvidia.com/gpu", "1")) == "1"  # extended resources: requests == limits
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_probes_hit_real_health_routes_on_the_named_port(deployment):
    from deploy_helpers import dockerfile_commands

    routes = get_routes()
    main = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    exposed = {int(p) for c in dockerfile_commands() if c.cmd == "EXPOSE" for p in c.value}
    assert set(ports.values()) == exposed
    expected = {"startupProbe": "/health/live", "livenessProbe": "/health/live", "readinessProbe": "/health/ready"}
    for probe, path in expected.items():
        get = main[probe]["httpGet"]
        assert get["path"] == path and ("GET", path) in routes
        assert get["port"] in ports
    # The startup probe gives a slow start (imports, CUDA init) minutes before liveness counts.
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_runs_as_the_image_user_without_privileges(deployment):
    uid, gid = dockerfile_user()
    pod = pod_spec(deployment)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert (pod["runAsUser"], pod["runAsGroup"]) == (uid, gid)
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    main = container(deployment)["securityContext"]
    assert main["allowPrivilegeEscalation"] is False
    assert main["capabilities"]["drop"] == ["ALL"]
    if main.get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp (Triton's cache)"


def test_settings_come_from_the_generated_configmap(deployment):
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    refs = [e["configMapRef"]["name"] for e in container(deployment)["envFrom"]]
    assert refs == [generator["name"]]


def test_termination_grace_outlasts_the_drain(deployment):
    from clusterserve.service.settings import Settings

    pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    timeout = settings_env().get("CLUSTERSERVE_REQUEST_TIMEOUT_S", Settings.model_fields["request_timeout_s"].default)
    budget = float(pre_stop[1]) + drain_seconds(float(timeout))
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > budget


# --------------------------------------------------------------------------------------------- Service, PDB, HPA


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_service_selects_the_pods_and_targets_the_named_port(deployment):
    service = one("Service")
    assert selects(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert selects(deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    names = {p["name"] for p in container(deployment)["ports"]}
    assert all(p["targetPort"] in names for p in service["spec"]["ports"])


def test_pdb_selects_the_pods_and_allows_drains(deployment):
    pdb = one("PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    # minAvailable with a single replica would block every node drain.
    assert pdb["spec"].get("maxUnavailable", 0) >= 1


def adapter_rules() -> list[dict]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def adapter_metric_name(rule: dict, series: str) -> str | None:
    """The name prometheus-adapter serves `series` under (`name.matches` / `name.as`, Go regex)."""
    match = re.search(rule["name"]["matches"], series)
    if match is None:
        return None
    return re.sub(r"\$\{(\d+)\}", lambda m: match.group(int(m.group(1))), rule["name"].get("as", "${0}"))


def test_hpa_scales_the_deployment_on_a_per_pod_metric_the_adapter_serves(deployment, exported):
    hpa = one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    served = {}
    for rule in adapter_rules():
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
        assert series in exported, f"the adapter rule asks for {series}, which the server does not export"
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]
        served[adapter_metric_name(rule, series)] = series
    assert metric["pods"]["metric"]["name"] in served
    # The target stays below the admission limit, or the HPA would wait for 429s.
    limit = int(settings_env()["CLUSTERSERVE_MAX_CONCURRENT_REQUESTS"])
    assert 0 < float(metric["pods"]["target"]["averageValue"]) < limit


def test_servicemonitor_scrapes_the_service_metrics_port():
    """No CRD schema here: check the fields the Prometheus Operator reads, and only those."""
    monitor = one("ServiceMonitor", "components/monitoring")
    service = one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels"}
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                                 "metricRelabelings", "honorLabels"}
        assert endpoint["port"] in port_names
        assert ("GET", endpoint["path"]) in get_routes()
        seconds = {k: int(re.fullmatch(r"(\d+)s", endpoint[k]).group(1)) for k in ("interval", "scrapeTimeout")}
        assert seconds["scrapeTimeout"] <= seconds["interval"]
