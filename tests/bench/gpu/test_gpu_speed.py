"""`python -m clusterserve.bench.gpu.speed --dry-run`: the whole GPU benchmark script, run on CPU through Triton's
interpreter at tiny sizes and knobs in a subprocess, writes complete, sane rows. It measures
nothing; it proves the script runs end to end before a GPU session spends time on it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from clusterserve.kernels.stages import CLUSTERED_STAGES, SMYRF_STAGES

ROOT = Path(__file__).resolve().parents[3]
# Each subprocess below runs the interpreter for minutes (~120-180 s on a loaded 2-core machine);
# its limit stays under pytest-timeout's 600 s so that a hang fails with the output.
SUBPROCESS_TIMEOUT_S = 540
FIELDS = {"method", "seq_len", "batch", "heads", "head_dim", "dtype", "ms", "speedup_vs_full", "peak_bytes",
          "rel_err", "device"}
METHODS = {"full", "clustered", "i-clustered (paper)", "i-clustered", "smyrf", "banded", "clustered (default)",
           "i-clustered (default)"}
# The backend's own stage lists (kernels/stages.py), less what a method's knobs skip; the
# triton backend runs hash (or seed, with bits 0: none of these), cluster, refine and centroids
# as one, "cluster" (cluster_means).
FUSED = set(CLUSTERED_STAGES) - {"hash", "seed", "refine", "centroids"}
STAGES = {
    "full": {"sdpa"},
    "clustered": FUSED - {"sparse"},
    "i-clustered (paper)": FUSED - {"broadcast"},
    "i-clustered": FUSED - {"broadcast"},
    "smyrf": set(SMYRF_STAGES),
    "banded": {"pool", "select", "attend"},
    "clustered (default)": FUSED - {"sparse"},
    "i-clustered (default)": FUSED - {"broadcast"},
}


def dry_run(out: Path, *args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "clusterserve.bench.gpu.speed", "--dry-run", "--out", str(out), "--name", "dry", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_dry_run_writes_every_field_with_sane_values(tmp_path):
    stdout = dry_run(tmp_path, "--head-dims", "64", "--profile-lengths", "64", "65536")
    assert "do not reproduce the backend" not in stdout

    rows = json.loads((tmp_path / "dry.json").read_text())
    assert isinstance(rows, list)
    attention_rows = [r for r in rows if r["kind"] == "attention"]
    embed_rows = [r for r in rows if r["kind"] == "embed"]
    assert {r["method"] for r in attention_rows} == METHODS == {r["method"] for r in embed_rows}
    for row in rows:
        assert FIELDS <= row.keys(), FIELDS - row.keys()
        assert (row["seq_len"], row["batch"], row["dtype"]) == (64, 1, "bfloat16")
        # embed rows run the default model, nomic-embed-text-v1.5: 12 heads of 64
        assert (row["heads"], row["head_dim"]) == ((2, 64) if row["kind"] == "attention" else (12, 64))
        assert row["device"].startswith("cpu")
        assert math.isfinite(row["ms"]) and row["ms"] > 0
        assert math.isfinite(row["speedup_vs_full"]) and row["speedup_vs_full"] > 0
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] >= 0
        assert math.isfinite(row["rel_err"]) and 0 <= row["rel_err"] < 3
        if row["method"] == "full":
            assert row["speedup_vs_full"] == 1
            # bfloat16 SDPA against float32 attention; the exact embedding against itself
            assert row["rel_err"] < 0.02 if row["kind"] == "attention" else row["rel_err"] == 0
        else:
            assert row["rel_err"] > 0  # 4 clusters for 64 tokens: approximate, never exact

    stages = json.loads((tmp_path / "dry-stages.json").read_text())
    for method, names in STAGES.items():
        got = [s for s in stages if s["method"] == method]
        assert {s["stage"] for s in got} == names | {"sum of stages"}
        for s in got:
            assert s["ms"] >= 0 and s["torch_ops"] >= 0 and s["triton_launches"] >= 0
        total = next(s for s in got if s["stage"] == "sum of stages")
        assert total["triton_launches"] >= (0 if method == "full" else 1)
    assert (tmp_path / "dry.png").stat().st_size > 10_000
    # bench.costmodel.gpu_validation finds a call's kernels by these titles; a profile length not run has none
    profiles = (tmp_path / "dry-profile.txt").read_text()
    assert "== smyrf, 64 tokens ==" in profiles and "65536 tokens" not in profiles


def test_gpu_acceptance_module_runs_on_the_interpreter():
    """tests/gpu, which skips without CUDA, run on CPU through the interpreter at 64 tokens:
    every case it has for a CPU passes, and the CUDA-only ones skip."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "GPU_TEST_DRY_RUN": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    # acceptance: 3 methods x (plain, padded, N_q != N_k, head dims 32 and 128, exact), less
    # banded's N_q != N_k (self-attention: skipped), 3 x 2 CUDA-only; stages: 2 settings x
    # (Hamming x 2 batches, refinement, the rest x 2 batches), SMYRF hashes, 3 methods x (same
    # bits, ragged batch); and test_cuda_graphs.py, test_fused_layers.py and test_rotary.py,
    # which skip whole without CUDA
    assert summary.startswith("34 passed, 10 skipped"), result.stdout[-4000:]
