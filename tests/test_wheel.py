"""The wheel, installed as users install it: into a fresh virtual environment beside
transformers, sentence-transformers and Hugging Face's `kernels`, where it must own one import
name (`clusterserve`) and break none of them.

The wheel is built from a copy of the checkout's files (what a clean clone holds). The fresh
venv installs the wheel, transformers, sentence-transformers and `kernels` into its own
site-packages, the one folder where a second top-level `kernels` would collide; everything they
depend on (torch first) comes from this test venv as a read-only layer on sys.path, so the
install takes seconds instead of unpacking torch again. A control runs the same transformers
check with the checkout's root first on sys.path, and must fail: the check can see shadowing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "clusterserve"
# Installed into the fresh venv's own site-packages; the rest of what they need is layered in.
BESIDE = ("transformers", "sentence-transformers", "kernels")
TIMEOUT_S = 540

# Run by the fresh venv's python, from a folder outside the checkout.
TRANSFORMERS_CHECK = """
import json, sys, tempfile
import torch
import kernels, sentence_transformers, transformers
from transformers import AutoModel, BertConfig, BertModel
folder = tempfile.mkdtemp()
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
BertModel(config).save_pretrained(folder)
model = AutoModel.from_pretrained(folder).eval()
with torch.no_grad():
    hidden = model(input_ids=torch.tensor([[1, 5, 9, 2]])).last_hidden_state
print(json.dumps({"kernels": kernels.__file__, "transformers": transformers.__version__, "shape": list(hidden.shape)}))
"""

CLUSTERSERVE_CHECK = """
import json
import torch
import clusterserve
from clusterserve.kernels import AttentionSpec, attention
from clusterserve.models import load_encoder
q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
exact = attention(q, k, v, AttentionSpec(method="full"))
reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
one_cluster_each = attention(q, k, v, AttentionSpec(method="i-clustered", clusters=64, topk=64))
vectors = load_encoder("minilm").embed(["a short text", "another one"], AttentionSpec(method="full"))
print(json.dumps({
    "package": clusterserve.__file__, "version": clusterserve.__version__,
    "exact_error": (exact - reference).abs().max().item(),
    "i_clustered_error": (one_cluster_each - reference).abs().max().item(),
    "vectors": list(vectors.shape),
}))
"""


def top_level_names(wheel: Path) -> set[str]:
    """The importable top-level names a wheel writes into site-packages (its metadata and
    .data folders are not importable)."""
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    return {re.sub(r"\.(py|so|pyd)$|\..*\.so$", "", top) for top in tops if not re.search(r"\.(dist-info|data)$", top)}


def test_top_level_names_sees_every_module_a_wheel_writes(tmp_path):
    wheel = tmp_path / "bad-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("clusterserve/__init__.py", "kernels/__init__.py", "models.py", "_native.cpython-311-x86_64-linux-gnu.so",
                     "bad-0.1.dist-info/RECORD", "bad-0.1.data/scripts/tool"):
            archive.writestr(name, "")
    assert top_level_names(wheel) == {"clusterserve", "kernels", "models", "_native"}


def checkout_copy(destination: Path) -> Path:
    """The files a clean clone holds (tracked, plus new files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    for name in listed:
        source = ROOT / name
        if source.is_file() and not name.startswith("bench/results/"):
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def layer_of_this_venv(folder: Path, leave_out: set[str]) -> Path:
    """Links to every distribution installed here except `leave_out` (and this project), in one
    folder: what the packages under test import without installing it again."""
    folder.mkdir()
    skip = {canonical(name) for name in leave_out} | {NAME, "pip"}
    for dist in metadata.distributions():
        if canonical(dist.metadata["Name"]) in skip or not dist.files:
            continue
        for top in {file.parts[0] for file in dist.files if file.parts[0] not in ("..", "bin")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists() and not top.endswith(".pth"):
                (folder / top).symlink_to(source)
    return folder


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the fresh venv's python, its site-packages) with the wheel installed beside BESIDE."""
    if not all(shutil.which(tool) for tool in ("git",)):
        pytest.skip("git is needed to list the checkout's files")
    work = tmp_path_factory.mktemp("wheel")
    source = checkout_copy(work / "source")
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                 "--wheel-dir", str(work / "dist"), str(source)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (work / "dist").glob(f"{NAME}-*.whl")

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    layer = layer_of_this_venv(work / "layer", set(BESIDE))
    (site / "zz-layer.pth").write_text(f"{layer}\n")  # after site-packages on sys.path
    pins = [f"{name}=={metadata.version(name)}" for name in BESIDE]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-warn-script-location",
                   str(wheel), *pins], env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    return wheel, python, site


def test_the_wheel_owns_one_top_level_name(installed):
    wheel, _, site = installed
    assert top_level_names(wheel) == {NAME}
    owners = [path.name for path in site.iterdir() if not path.name.endswith((".dist-info", ".pth", "__pycache__"))]
    assert "kernels" in owners and "transformers" in owners and NAME in owners, owners


def test_transformers_loads_and_runs_a_bert_beside_it(installed, tmp_path):
    _, python, site = installed
    checked = run([str(python), "-c", TRANSFORMERS_CHECK], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-3000:]
    found = json.loads(checked.stdout.strip().splitlines()[-1])
    assert Path(found["kernels"]).resolve() == (site / "kernels" / "__init__.py").resolve()
    assert found["transformers"] == metadata.version("transformers")
    assert found["shape"] == [1, 4, 32]


def test_the_check_fails_where_the_checkout_shadows_kernels(installed, tmp_path):
    """The control: with the repository's root first on sys.path (what `python -m` from the root
    did), its kernels/ folder stands in for Hugging Face's and the same check must fail."""
    _, python, _ = installed
    shadowed = run([str(python), "-c", TRANSFORMERS_CHECK], cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert shadowed.returncode != 0
    assert "kernels" in shadowed.stderr


def test_clusterserve_works_beside_them(installed, tmp_path):
    _, python, site = installed
    checked = run([str(python), "-c", CLUSTERSERVE_CHECK], cwd=tmp_path, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert checked.returncode == 0, checked.stderr[-3000:]
    found = json.loads(checked.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).resolve().parent == (site / NAME).resolve()
    assert found["version"] == metadata.version(NAME)
    assert found["exact_error"] < 1e-5
    assert found["i_clustered_error"] < 1e-4  # one query a cluster and top-k = every key: exact
    assert found["vectors"] == [2, 384]
