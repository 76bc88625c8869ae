"""`make fuzz`'s run in small: schemathesis, every check, against a real server process serving
the default model, with the cross-field hooks (cross_field.py). A schema-valid request the
server refuses, a schema-invalid one it accepts, a 5xx or an undocumented answer fails the
suite, so a new rule cannot reach the server without reaching the schema or the hooks.

A few examples an operation (EXAMPLES) keep it to a couple of minutes; `make fuzz` runs 60.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from default_model import require_default_model
from server_process import running_server

HERE = Path(__file__).resolve().parent
EXAMPLES = 6
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


def test_schemathesis_finds_nothing_on_the_default_server(tmp_path):
    if not SCHEMATHESIS.is_file():
        pytest.skip("schemathesis is not installed (a test extra)")
    require_default_model()
    with running_server(tmp_path / "server.log", "--no-warmup", model=None) as (base, _):
        env = os.environ | {"SCHEMATHESIS_HOOKS": "cross_field", "PYTHONPATH": str(HERE)}
        run = subprocess.run(
            [str(SCHEMATHESIS), "--no-color", "run", f"{base}/openapi.json", "--checks", "all", "--generation-deterministic",
             "--max-examples", str(EXAMPLES)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540,
        )
    report = run.stdout + run.stderr
    generated = re.search(r"(\d+) generated", report)
    print(report[-1500:])
    assert run.returncode == 0, report[-6000:]
    assert generated and int(generated.group(1)) > 100, report[-2000:]
