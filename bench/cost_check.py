"""The work estimate (models.cost) against calibration tables' measured times.

    python -m bench.cost_check [--table PATH ...] [--rows]

For every configuration of every bucket of a table: the estimated work over exact attention's,
divided by the measured time over exact attention's. 1.0 is a perfect estimate; both sides
are ratios within one bucket, so the table's device speed cancels. The estimate is the one
for the table's model (its "model" field, loaded by name), dtype and device kind (its "dtype"
and "device"), of each configuration as the server runs it (one that is exact by its knobs at
the bucket's length as exact attention, as the table measured it). Without --table, every
table shipped in models/calibrations/. Prints, per table, the lowest and highest ratio and
where they are (--rows: every configuration). The weights of models.cost were fitted against
the shipped CPU tables and are checked this way.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kernels import AttentionSpec
from kernels.spec import exact_by_knobs
from models import load_encoder
from models.calibration import SHIPPED_DIR, Calibration, load_calibration
from models.cost import CostModel

from .common import print_table

EXACT = AttentionSpec(method="full")


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


def ratios(cost: CostModel, table: Calibration) -> list[dict]:
    """Per measured configuration of `table`: estimated and measured cost relative to exact
    attention in the same bucket, and their ratio (estimate / measurement)."""
    rows = []
    for bucket in table.buckets:
        exact = cost.work(bucket.tokens, EXACT)
        for measured in bucket.configs:
            estimate = cost.work(bucket.tokens, as_run(measured.spec, bucket.tokens)) / exact
            rows.append({
                "tokens": bucket.tokens,
                "attention": measured.spec.to_json(),
                "estimated_vs_exact": estimate,
                "measured_vs_exact": measured.ms / bucket.exact_ms,
                "ratio": estimate / (measured.ms / bucket.exact_ms),
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", nargs="+", help="calibration tables (default: every shipped one)")
    parser.add_argument("--rows", action="store_true", help="print every configuration's ratio")
    args = parser.parse_args()
    paths = [Path(p) for p in args.table] if args.table else sorted(SHIPPED_DIR.glob("*.json"))
    shapes: dict[str, CostModel] = {}
    summary = []
    for path in paths:
        table = load_calibration(path)
        if table.model not in shapes:
            shapes[table.model] = load_encoder(table.model).cost
        rows = ratios(table_cost(table, shapes[table.model]), table)
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
