"""The work estimate (models.cost) against a calibration table's measured times.

    python -m bench.cost_check [--table PATH]

For every configuration of every bucket: the estimated work over exact attention's, divided
by the measured time over exact attention's. 1.0 is a perfect estimate; both sides are
ratios within one bucket, so the table's device speed cancels. Prints a table and the worst
ratios. The weights of models.cost were chosen against the shipped CPU table this way.
"""

from __future__ import annotations

import argparse

from kernels import AttentionSpec
from models import load_encoder
from models.calibration import SHIPPED_DIR, load_calibration, table_name

from .common import print_table


def ratios(encoder, table) -> list[dict]:
    rows = []
    for bucket in table.buckets:
        exact = encoder.cost.work(bucket.tokens, AttentionSpec(method="full"))
        for measured in bucket.configs:
            estimate = encoder.cost.work(bucket.tokens, measured.spec) / exact
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
    parser.add_argument("--table", default=str(SHIPPED_DIR / table_name("all-MiniLM-L6-v2", "cpu")))
    args = parser.parse_args()
    encoder = load_encoder(None)
    rows = ratios(encoder, load_calibration(args.table))
    print_table(rows, ["tokens", "attention", "estimated_vs_exact", "measured_vs_exact", "ratio"])
    worst = sorted(row["ratio"] for row in rows)
    print(f"\nratio of estimate to measurement: {worst[0]:.2f} to {worst[-1]:.2f} over {len(rows)} configurations")


if __name__ == "__main__":
    main()
