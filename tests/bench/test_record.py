"""bench/results is a record (bench/README.md): every file in it is named by a doc (docs/*.md,
README.md, bench/README.md), a test or a module, the docs name no file under bench/results that
is not there, and the whole stays under 1 MB. The files are the ones git would commit (tracked,
and new ones it does not ignore: the plots the runs draw are ignored)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
LIMIT_BYTES = 1_000_000
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_FOLDERS = ("clusterserve", "kernels", "models", "service", "bench", "tests")


def record_files() -> list[Path]:
    """The files of bench/results that git would commit; every file there outside a checkout."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "bench/results"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return sorted(p for p in RESULTS.iterdir() if p.is_file())
    return sorted(ROOT / name for name in listed.stdout.split() if (ROOT / name).is_file())


def naming_texts() -> dict[str, str]:
    """The docs, tests and modules that may name a report, by path (this file's examples aside)."""
    this = Path(__file__).resolve()
    code = [p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py") if p.resolve() != this]
    paths = [*DOCS, *code, *(ROOT / "bench").rglob("*.sh")]
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in paths}


def named(name: str, text: str) -> bool:
    """`name` appears in `text` as a whole file name (not inside a longer one: cpu.json is not
    calibration.cpu.json's, gpu_static.json not gpu_static-triton-3.4.json's)."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None


def orphans(files: list[Path], texts: dict[str, str]) -> list[str]:
    return [p.name for p in files if not any(named(p.name, text) for text in texts.values())]


def test_every_file_in_the_record_is_named_by_a_doc_test_or_module():
    files = record_files()
    assert files, "bench/results holds no file"
    missing = orphans(files, naming_texts())
    assert not missing, (f"bench/results files that no doc, test or module names: {missing}; cite each in the doc "
                         "that reports it (bench/README.md lists the benchmarks' files) or delete it")


def test_the_docs_name_only_files_in_the_record():
    present = {p.name for p in record_files()}
    cited = {name: str(doc.relative_to(ROOT)) for doc in DOCS
             for name in re.findall(r"bench/results/([\w.+-]+\.(?:json|png|txt|log|xml|gz))", doc.read_text())}
    stale = {name: doc for name, doc in cited.items() if name not in present}
    assert not stale, f"docs name files that bench/results does not hold: {stale}"


def test_the_record_stays_under_a_megabyte():
    sizes = {p.name: p.stat().st_size for p in record_files()}
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert sum(sizes.values()) < LIMIT_BYTES, (f"bench/results holds {sum(sizes.values())} bytes (limit {LIMIT_BYTES}); "
                                               f"largest: {largest}")


@pytest.mark.parametrize("name, text, expected", [
    ("cpu.json", "bench/results/cpu.json has the rows", True),
    ("cpu.json", "the table models/calibrations/x.calibration.cpu.json", False),
    ("gpu_static.json", "its twin gpu_static-triton-3.4.json", False),
    ("h100-2026-11-27.json", "`h100-2026-11-27-2.json`", False),
    ("h100-2026-11-27.json", "(`h100-2026-11-27.json`'s `stress`)", True),
])
def test_a_name_counts_only_as_a_whole_file_name(name, text, expected):
    assert named(name, text) is expected


def test_an_unnamed_file_is_an_orphan(tmp_path):
    kept, stray = tmp_path / "cited.json", tmp_path / "stray.json"
    assert orphans([kept, stray], {"docs/x.md": "see `bench/results/cited.json`"}) == ["stray.json"]
