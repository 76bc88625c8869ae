"""The most any attention method can save on this machine: one text of N tokens through the
served model with exact attention, against the same pass where each query attends only its
own block of `--blocks` tokens (banded with band 0, no sinks, no far blocks). The block-local
pass does what every layer outside attention does, and at most N x block attention scores:
its time bounds from below what a method that looks at least as far can take, so exact's time
over it bounds any such method's speed-up from above.

    python -m clusterserve.bench.cpu.ceiling [--model nomic] [--lengths 2048 4096 8192] [--blocks 512 64]
        [--dtype auto] [--repeats 2] [--name ceiling-nomic-cpu]

Texts: Debian's license texts (bench.common.long_text_ids), framed as the server frames a
document. Times: the least of `--repeats` rounds, the variants in turn. Writes
bench/results/<name>.json.
"""

from __future__ import annotations

import argparse

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder
from clusterserve.models.planning.calibration import EXACT
from clusterserve.models.runtime.precision import DTYPE_SETTINGS
from clusterserve.models.timing import alternated_seconds

from ..common import long_text_ids, print_table, run_conditions, write_results


def block_local(block: int) -> AttentionSpec:
    """Each query attends its own block of `block` tokens, nothing else."""
    return AttentionSpec(method="banded", band=0, block=block, sinks=0, far_blocks=0)


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a name, folder or GGUF file (default: the served default)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 64])
    parser.add_argument("--dtype", default="auto", choices=DTYPE_SETTINGS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="ceiling-nomic-cpu")
    args = parser.parse_args()

    encoder = load_encoder(args.model, dtype=args.dtype)
    rows = []
    for tokens in args.lengths:
        ids = long_text_ids(encoder, tokens)
        variants = {"exact": EXACT, **{f"block-local {b}": block_local(b) for b in args.blocks}}
        runs = {name: lambda s=spec: encoder.embed([ids], s) for name, spec in variants.items()}
        times = alternated_seconds(runs, args.repeats)
        exact = min(times["exact"])
        for name in variants:
            seconds = min(times[name])
            rows.append(dict(tokens=tokens, variant=name, seconds=seconds, ceiling=exact / seconds))
    print_table(rows, ["tokens", "variant", "seconds", "ceiling"])
    meta = run_conditions(model=encoder.name, dtype=str(encoder.dtype).removeprefix("torch."), args=vars(args))
    print(f"wrote {write_results(args.name, rows, meta)}")


if __name__ == "__main__":
    main()
