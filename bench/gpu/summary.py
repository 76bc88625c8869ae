"""A device session as one JSON record: what bench/gpu/h100_session.sh (and the calls beside it:
bench.gpu.ncu, bench.gpu.shapes, bench.gpu.stress) wrote, summarised into the file that is
committed, the raw logs, profiles and plots left out of the tree.

    python -m clusterserve.bench.gpu.summary SOURCE ... --stem 2026-11-27-h100-2 [--out PATH]

SOURCE: folders or .tar.gz archives holding the session's files, each named <stem>...: the
console log, <stem>.json (bench.gpu.speed's attention rows), -stages.json, -profile.txt,
-nomic-e2e.json (the default model end to end), -nomic-e2e-profile.txt, -shapes.json, -ncu.json,
-tests.xml or -tests.log, -stress.log. Writes (default) bench/results/h100-<date>[-n].json:

    session, date, device (name, driver, max SM clock, memory), torch, triton   where known
    steps            the session script's step exit codes
    attention        bench.gpu.speed's attention rows (one device, named once above)
    embed            every row of the end-to-end run
    stages           the stage breakdown rows
    profiles         per profiled call (kind attention or embed, method, tokens): the device's
                     total (torch.profiler's "Self CUDA time total"), each device kernel's time in
                     all and launches with its category, the time of the kernels the table left
                     out (it lists 25 rows), and the ATen ops' own device time
    vs_model         bench.costmodel.gpu_validation's comparison of the attention profiles with
                     gpu_model.json (rewritten there when the model changes)
    shapes, ncu      bench.gpu.shapes' and bench.gpu.ncu's rows
    tests, stress    the GPU tests' counts and failures; bench.gpu.stress's cases
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from ..common import RESULTS_DIR, rounded, rows_json
from ..costmodel.gpu_validation import session_comparison
from .profiles import profile_tables


def console_facts(text: str) -> dict:
    """The device (nvidia-smi's CSV line), torch and Triton versions, and each step's exit code."""
    facts: dict = {}
    device = re.search(r"^(.+?), ([\d.]+), (\d+) MHz, (\d+) MiB$", text, flags=re.M)
    if device:
        facts["device"] = dict(name=device.group(1), driver=device.group(2), max_sm_clock_mhz=int(device.group(3)),
                               memory_mib=int(device.group(4)))
    versions = re.search(r"^torch (\S+) triton (\S+)$", text, flags=re.M)
    if versions:
        facts.update(torch=versions.group(1), triton=versions.group(2))
    facts["steps"] = {step: int(rc) for step, rc in re.findall(r"^([\w ]+): rc=(\d+)$", text, flags=re.M)}
    return facts


def test_counts(xml: str | None, log: str | None) -> dict:
    """The GPU tests' counts, seconds and failed tests (JUnit XML), and pytest's last line."""
    counts: dict = {}
    if xml:
        suite = ElementTree.fromstring(xml)
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
        counts["seconds"] = round(float(suite.get("time")), 1)
        counts["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                            if case.find("failure") is not None or case.find("error") is not None]
    if log:
        last = re.findall(r"^=*\s*(\d+ (?:passed|failed).*? in [\d.]+s.*?)\s*=*$", log, flags=re.M)
        if last:
            counts["summary"] = last[-1]
    return counts


def stress_cases(log: str) -> dict:
    """bench.gpu.stress's printed cases: dtype, method, case, fused-against-staged differences,
    the worst changes over the repeats and seconds; and the count of changed cases."""
    cases = []
    for dtype, method, case, diff, of, repeats, worst, seconds in re.findall(
            r"^(\w+)\s+([\w-]+)\s+(.+?)\s+fused-vs-staged assign diff (\d+) of (\d+); worst over (\d+) repeats: "
            r"(\{.*\})\s+([\d.]+) s$", log, flags=re.M):
        cases.append(dict(dtype=dtype, method=method, case=case, fused_vs_staged=int(diff), of=int(of),
                          repeats=int(repeats), worst=json.loads(worst.replace("'", '"')), seconds=float(seconds)))
    changed = re.search(r"^changed cases: (\d+)$", log, flags=re.M)
    return dict(cases=cases, changed_cases=int(changed.group(1)) if changed else None)


def session_files(sources: list[Path]) -> dict[str, Path]:
    """Every file of the sources by name: folders as they are, .tar.gz archives unpacked."""
    files: dict[str, Path] = {}
    for source in sources:
        if source.is_dir():
            files.update({p.name: p for p in source.iterdir() if p.is_file()})
        elif source.name.endswith(".tar.gz"):
            folder = Path(tempfile.mkdtemp(prefix="session-"))
            with tarfile.open(source) as archive:
                archive.extractall(folder, filter="data")
            files.update({p.name: p for p in folder.rglob("*") if p.is_file()})
        else:
            files[source.name] = source
    return files


def summarise(files: dict[str, Path], stem: str, model: dict | None) -> dict:
    """The session's record from its files (`model`: gpu_model.json, for `vs_model`)."""
    def text(suffix: str) -> str | None:
        path = files.get(stem + suffix)
        return path.read_text(errors="replace") if path else None

    def rows(suffix: str) -> list[dict]:
        found = text(suffix)
        return [{k: v for k, v in row.items() if k != "device"} for row in json.loads(found)] if found else []

    date = re.match(r"\d{4}-\d{2}-\d{2}", stem)
    record: dict = dict(session=stem, date=date.group(0) if date else None)
    record.update(console_facts(text("-console.log") or ""))
    attention, embed = rows(".json"), rows("-nomic-e2e.json")
    if "device" not in record:  # no console log: the rows name the device
        named = [json.loads(text(s))[0]["device"] for s in (".json", "-shapes.json") if text(s)]
        record["device"] = dict(name=named[0]) if named else None
    record.update(attention=[r for r in attention if r.get("kind") == "attention"],
                  embed=embed + [r for r in attention if r.get("kind") == "embed"], stages=rows("-stages.json"))
    profiles = profile_tables((text("-profile.txt") or "") + "\n" + (text("-nomic-e2e-profile.txt") or ""))
    record.update(profiles=profiles, shapes=rows("-shapes.json"), ncu=rows("-ncu.json"),
                  tests=test_counts(text("-tests.xml"), text("-tests.log")),
                  stress=stress_cases(text("-stress.log")) if text("-stress.log") else None)
    record = rounded(record)  # the profiles' cells have fewer digits than that, and stay as printed
    record["profiles"] = profiles
    if model is not None and record["attention"]:
        record["vs_model"] = session_comparison(record, model)
    return {k: v for k, v in record.items() if v not in (None, [], {})}


def record_name(stem: str) -> str:
    """2026-11-27-h100-2 -> h100-2026-11-27-2: the record of a device session, by device and date."""
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2})-(\w+?)(-\d+)?", stem)
    return f"{match.group(2)}-{match.group(1)}{match.group(3) or ''}" if match else stem


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("sources", type=Path, nargs="+", help="folders or .tar.gz archives of the session's files")
    parser.add_argument("--stem", required=True, help="the files' stem, as the session script named them")
    parser.add_argument("--model", type=Path, default=RESULTS_DIR / "gpu_model.json",
                        help="the cost model's report, for vs_model")
    parser.add_argument("--out", type=Path, help="default: bench/results/<device>-<date>[-n].json")
    args = parser.parse_args(argv)
    files = session_files(args.sources)
    if not any(name.startswith(args.stem) for name in files):
        raise SystemExit(f"no file named {args.stem}* in {[str(s) for s in args.sources]}")
    model = json.loads(args.model.read_text()) if args.model.is_file() else None
    record = summarise(files, args.stem, model)
    out = args.out or RESULTS_DIR / f"{record_name(args.stem)}.json"
    out.write_text(rows_json(record) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB): " + ", ".join(k for k in record))


if __name__ == "__main__":
    main()
