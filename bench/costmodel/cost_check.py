"""The work estimate (models.planning.cost) against calibration tables' measured times.

    python -m clusterserve.bench.costmodel.cost_check [--table PATH ...] [--rows] [--fit [--write]]

For every configuration of every bucket of a table: the estimated work over exact attention's,
divided by the measured time over exact attention's. 1.0 is a perfect estimate; both sides
are ratios within one bucket, so the table's device speed cancels. The estimate is the one
for the table's model (its "model" field, loaded by name), dtype and device kind (its "dtype"
and "device"), of each configuration as the server runs it (one that is exact by its knobs at
the bucket's length as exact attention, as the table measured it). Without --table, every
table shipped in models/calibrations/. Prints, per table, the lowest and highest ratio and
where they are (--rows: every configuration).

--fit fits models.planning.cost.WEIGHTS to the tables (`fit`) and prints the fitted weights and
the ratios they give; --write also puts them into models/planning/cost.py, in place of its
WEIGHTS assignment (`write_weights`: the block from its marker comment to `}  # fmt: skip`,
nothing else of the file). The shipped weights were fitted this way to the shipped CPU tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path

import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.spec import exact_by_knobs
from clusterserve.models import load_encoder
from clusterserve.models.planning import cost as cost_module
from clusterserve.models.planning.calibration import Calibration, load_calibration, shipped_tables
from clusterserve.models.planning.cost import WEIGHTS, CostModel

from ..common import print_table

EXACT = AttentionSpec(method="full")
# The steps whose code depends on the dtype get a weight per dtype in the fit (models.planning.cost's
# docstring says why); every other step one weight for all dtypes.
PER_DTYPE = ("dense", "exact", "centroid", "banded")
# How hard each fitted log-weight is pulled toward its current value: steps the tables cannot
# tell apart keep their weights instead of trading them off against each other.
RIDGE = 0.3
# The file whose WEIGHTS --write replaces, and the block it replaces: the marker comment (once
# written), the assignment, its closing line.
COST_FILE = Path(cost_module.__file__)
MARKER = "# Written by `python -m clusterserve.bench.costmodel.cost_check --fit --write`, which replaces this assignment."
BLOCK = re.compile(r"^(?:" + re.escape(MARKER) + r"\n)?WEIGHTS: dict\[str, dict\[str, float\]\] = \{\n.*?^\}  # fmt: skip\n",
                   re.M | re.S)
LINE = 110  # the weights' lines wrap before this many characters


def as_run(spec: AttentionSpec, tokens: int) -> AttentionSpec:
    """What the server runs for `spec` at `tokens` tokens: exact attention where the spec is
    exact by its knobs (kernels.spec.exact_by_knobs), else the spec itself."""
    return EXACT if exact_by_knobs(spec, tokens) else spec


def table_cost(table: Calibration, shapes: CostModel | None = None) -> CostModel:
    """The cost model of the table's model in the table's dtype and device kind. `shapes`: that
    model's cost model in any dtype, when the caller has the model loaded already."""
    if shapes is None:
        shapes = load_encoder(table.model).cost
    return dataclasses.replace(shapes, dtype=table.dtype, device=table.device)


def ratios(cost: CostModel, table: Calibration, weights: dict[str, float] | None = None) -> list[dict]:
    """Per measured configuration of `table`: estimated and measured cost relative to exact
    attention in the same bucket, and their ratio (estimate / measurement). `weights`: step
    weights to estimate with instead of the cost model's own."""
    weights = weights or cost.weights

    def work(tokens: int, spec: AttentionSpec) -> float:
        return sum(weights[step] * count for step, count in cost.operations(tokens, as_run(spec, tokens)).items())

    rows = []
    for bucket in table.buckets:
        exact = work(bucket.tokens, EXACT)
        for measured in bucket.configs:
            estimate = work(bucket.tokens, measured.spec) / exact
            rows.append({
                "tokens": bucket.tokens,
                "attention": measured.spec.to_json(),
                "estimated_vs_exact": estimate,
                "measured_vs_exact": measured.ms / bucket.exact_ms,
                "ratio": estimate / (measured.ms / bucket.exact_ms),
            })  # fmt: skip
    return rows


def fit(
    tables: list[tuple[CostModel, Calibration]], per_dtype: tuple[str, ...] = PER_DTYPE, ridge: float = RIDGE
) -> dict[str, dict[str, float]]:
    """clusterserve.models.planning.cost.WEIGHTS fitted to measured times: (cost model in the table's dtype, table) pairs.

    Least squares of log(estimated / measured time) over every configuration of every bucket
    and every bucket's exact pass, each table with its own free scale (its device's speed and
    load), each log-weight pulled toward its current value by `ridge`. The steps of
    `per_dtype` get one weight per dtype, the others one for every dtype; float32's dense
    weight stays 1, the unit. Dtypes without a table keep their weights."""
    dtypes = sorted({cost.dtype for cost, _ in tables})
    steps = list(WEIGHTS["float32"])
    keys = [(dtype, step) for step in steps for dtype in (dtypes if step in per_dtype else ["*"])]
    keys = [key for key in keys if key != ("float32", "dense")]
    prior = torch.tensor([math.log(WEIGHTS.get(d if d != "*" else "float32", WEIGHTS["float32"])[s]) for d, s in keys])
    rows, measured, table_of = [], [], []
    for t, (cost, table) in enumerate(tables):
        for bucket in table.buckets:
            for spec, ms in [(EXACT, bucket.exact_ms)] + [(m.spec, m.ms) for m in bucket.configs]:
                operations = cost.operations(bucket.tokens, as_run(spec, bucket.tokens))
                rows.append([
                    operations.get(s, 0.0) if d in ("*", cost.dtype) else 0.0 for d, s in keys
                ] + [operations.get("dense", 0.0) if cost.dtype == "float32" else 0.0])  # fmt: skip
                measured.append(ms)
                table_of.append(t)
    operations = torch.tensor(rows, dtype=torch.float64)
    log_ms, table_of = torch.tensor(measured, dtype=torch.float64).log(), torch.tensor(table_of)
    log_weights = prior.clone().double().requires_grad_(True)
    start = (operations[:, :-1] @ prior.double().exp() + operations[:, -1]).log()
    log_scales = torch.stack([(log_ms - start)[table_of == t].median() for t in range(len(tables))]).requires_grad_(True)
    optimizer = torch.optim.LBFGS([log_weights, log_scales], max_iter=2000, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        estimate = (operations[:, :-1] @ log_weights.exp() + operations[:, -1]).log() + log_scales[table_of]
        value = ((estimate - log_ms) ** 2).sum() + ridge**2 * ((log_weights - prior) ** 2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    fitted = {dtype: dict(weights) for dtype, weights in WEIGHTS.items()}
    for dtype in dtypes:
        fitted.setdefault(dtype, dict(WEIGHTS["float32"]))
        for (d, step), value in zip(keys, log_weights.detach().exp().tolist()):
            if d in ("*", dtype):
                fitted[dtype][step] = float(f"{value:.2g}")
    return fitted


def weights_block(weights: dict[str, dict[str, float]]) -> str:
    """models/planning/cost.py's WEIGHTS assignment for `weights`, marker first: per dtype, the
    steps weighted by dtype (PER_DTYPE) on one line, the others wrapped before LINE characters."""
    lines = [MARKER, "WEIGHTS: dict[str, dict[str, float]] = {"]
    for dtype, row in weights.items():
        lines.append(f'    "{dtype}": {{')
        cells = [f'"{step}": {value!r},' for step, value in row.items()]
        first = [cell for step, cell in zip(row, cells) if step in PER_DTYPE]
        rest = [cell for step, cell in zip(row, cells) if step not in PER_DTYPE]
        if first:
            lines.append("        " + " ".join(first))
        line = ""
        for cell in rest:
            if line and 8 + len(line) + 1 + len(cell) >= LINE:
                lines.append("        " + line)
                line = ""
            line = f"{line} {cell}" if line else cell
        if line:
            lines.append("        " + line)
        lines.append("    },")
    lines.append("}  # fmt: skip")
    return "\n".join(lines) + "\n"


def write_weights(weights: dict[str, dict[str, float]], path: Path = COST_FILE) -> bool:
    """Replace the WEIGHTS block of `path` (models/planning/cost.py) by `weights`' and nothing
    else; True if the file changed. A file without exactly one such block is left alone."""
    text = path.read_text()
    found = BLOCK.findall(text)
    if len(found) != 1:
        raise ValueError(f"{path}: expected one WEIGHTS block (ending '}}  # fmt: skip'), found {len(found)}")
    new = BLOCK.sub(lambda _: weights_block(weights), text)
    if new != text:
        path.write_text(new)
    return new != text


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--table", nargs="+", help="calibration tables (default: every shipped one)")
    parser.add_argument("--rows", action="store_true", help="print every configuration's ratio")
    parser.add_argument("--fit", action="store_true", help="fit the step weights to the tables and use them")
    parser.add_argument("--write", action="store_true", help="with --fit: write the fitted weights into models/planning/cost.py")
    args = parser.parse_args()
    if args.write and not args.fit:
        parser.error("--write writes the fitted weights: give --fit too")
    paths = [Path(p) for p in args.table] if args.table else shipped_tables()
    shapes: dict[str, CostModel] = {}
    tables = []
    for path in paths:
        table = load_calibration(path)
        if table.model not in shapes:
            shapes[table.model] = load_encoder(table.model).cost
        tables.append((table_cost(table, shapes[table.model]), table))
    weights = fit(tables) if args.fit else WEIGHTS
    if args.fit:
        print(weights_block(weights))
    if args.write:
        changed = write_weights(weights)
        print(f"{'wrote' if changed else 'unchanged:'} {COST_FILE}'s WEIGHTS")
    summary = []
    for path, (cost, table) in zip(paths, tables):
        rows = ratios(cost, table, weights.get(cost.dtype, weights["float32"]) if cost.device == "cpu" else None)
        if args.rows:
            print(f"\n{path.name}")
            print_table(rows, ["tokens", "attention", "estimated_vs_exact", "measured_vs_exact", "ratio"])
        low, high = min(rows, key=lambda r: r["ratio"]), max(rows, key=lambda r: r["ratio"])
        summary.append({
            "table": path.name, "model": table.model, "dtype": table.dtype, "device": table.device,
            "configs": len(rows), "tokens": f"{table.buckets[0].tokens}-{table.buckets[-1].tokens}",
            "lowest": low["ratio"], "highest": high["ratio"], "extremes": (low, high),
        })  # fmt: skip
    print()
    print_table(summary, ["model", "dtype", "device", "configs", "tokens", "lowest", "highest"])
    for row in summary:
        low, high = row["extremes"]
        print(
            f"{row['table']}: lowest {low['ratio']:.2f} at {low['tokens']} tokens {low['attention']}; "
            f"highest {high['ratio']:.2f} at {high['tokens']} tokens {high['attention']}"
        )


if __name__ == "__main__":
    main()
