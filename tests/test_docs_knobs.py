"""The knob tables of README.md and docs/methods.md say what kernels.spec enforces: every knob
of AttentionSpec listed once, with its default (by method, where it follows the method) and
its range (auto_method: the methods it accepts); docs/http.md names every field of the
`attention` object."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from clusterserve.kernels.spec import APPROXIMATE_METHODS, KNOB_RANGES, METHODS, START_KNOBS, AttentionSpec
from clusterserve.service.schemas import AttentionRequest

ROOT = Path(__file__).resolve().parents[1]
SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")


def knob_rows(path: Path) -> dict[str, tuple[str, str]]:
    """The rows of the table headed `| knob | default | range | ...`: knob -> (default, range)."""
    lines = path.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if re.match(r"\| knob \| default \| range \|", line)]
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        knob, default, allowed = (cell.strip() for cell in line.strip("|").split("|")[:3])
        assert knob not in rows, f"{path.name}: {knob} listed twice"
        rows[knob] = (default, allowed)
    return rows


def number(text: str) -> int:
    """A bound as the docs write it: 4096, 2²⁰, 2⁵³−1."""
    text = text.replace("−", "-")
    match = re.fullmatch(r"2([⁰¹²³⁴⁵⁶⁷⁸⁹]+)(-1)?", text)
    if match:
        return 2 ** int(match.group(1).translate(SUPERSCRIPTS)) - (1 if match.group(2) else 0)
    return int(text)


@pytest.mark.parametrize("page", ["README.md", "docs/methods.md"])
def test_knob_table_matches_the_spec(page):
    rows = knob_rows(ROOT / page)
    defaults = AttentionSpec()
    knobs = {f.name for f in dataclasses.fields(AttentionSpec) if f.init} - {"method"}
    assert knobs <= rows.keys(), f"{page} lacks {sorted(knobs - rows.keys())}"
    for knob, (low, high) in KNOB_RANGES.items():
        default, allowed = rows[knob]
        if knob in START_KNOBS:  # "0 (i-clustered), 63 (clustered)": the default follows the method
            by_method = ", ".join(f"{getattr(AttentionSpec(method=m), knob)} ({m})" for m in ("i-clustered", "clustered"))
            assert default == by_method, (page, knob, default)
        else:
            assert number(default) == getattr(defaults, knob), (page, knob, default)
        first, last = allowed.split("–")
        assert (number(first), number(last)) == (low, high), (page, knob, allowed)
    default, allowed = rows["auto_method"]
    assert default == defaults.auto_method
    assert tuple(m.strip() for m in allowed.split(",")) == APPROXIMATE_METHODS, (page, allowed)


def test_http_page_names_every_attention_field():
    """docs/http.md's section on the `attention` object names every field a request may send
    and every method."""
    text = (ROOT / "docs/http.md").read_text()
    section = text.split("## The `attention` object", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_-]+)`", section))
    fields = set(AttentionRequest.model_fields)
    assert fields <= named, f"docs/http.md's attention section lacks {sorted(fields - named)}"
    assert set(METHODS) <= named, f"docs/http.md's attention section lacks {sorted(set(METHODS) - named)}"
