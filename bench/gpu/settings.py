"""What one run of bench.gpu.speed measures and where: the methods, sizes and repeats, read once
from its command line (`--dry-run`: the same script on CPU under TRITON_INTERPRET=1, tiny sizes
and knobs)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from clusterserve.kernels import AttentionSpec

from ..common import MEASURED, device_name

DESCRIPTION = "GPU benchmark: exact attention against the approximate methods through the Triton backend"
# The benchmarks' methods (the paper's 10 Hamming iterations), and the clustered methods as served.
SPECS = MEASURED

# The sizes measured; --dry-run swaps in DRY_RUN's.
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
E2E_LENGTHS = [512, 4096, 16384, 32768]
DRY_RUN = dict(lengths=[64], e2e_lengths=[64], heads=2, repeats=1, warmup=0, e2e_repeats=1)


def dry_run_spec(spec: AttentionSpec) -> AttentionSpec:
    """The knobs scaled down so that Triton's interpreter runs a method in well under a second
    (100 clusters would make 64 tokens one query per cluster, and take ~10 s)."""
    return dataclasses.replace(
        spec, clusters=4, topk=8, iterations=min(spec.iterations, 2), refine=min(spec.refine, 1), hash_rounds=2,
        cluster_size=16, band=min(spec.band, 1), block=8, sinks=min(spec.sinks, 2), far_blocks=min(spec.far_blocks, 2),
    )



@dataclass(frozen=True)
class Settings:
    """What one run measures and where; built once from the command line."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    head_dims: tuple[int, ...]
    lengths: tuple[int, ...]
    e2e_lengths: tuple[int, ...]
    e2e_dtype: torch.dtype
    repeats: int
    warmup: int
    e2e_repeats: int
    stages: bool
    graphs: bool
    graph_max_length: int | None  # the encoder's cuda_graph_max_length; None: the loader's default
    profile_lengths: tuple[int, ...]
    specs: dict[str, AttentionSpec]
    model: str | None
    out: Path
    stem: str
    dry_run: bool

    @property
    def device_label(self) -> str:
        return device_name()


def _parser() -> argparse.ArgumentParser:
    """The command line: what to measure, how often, where to write."""
    parser = argparse.ArgumentParser(prog="python -m clusterserve.bench.gpu.speed", description=DESCRIPTION)
    parser.add_argument("--lengths", type=int, nargs="*", help=f"attention lengths (default {LENGTHS})")
    parser.add_argument("--methods", nargs="+", choices=list(SPECS), default=list(SPECS),
                        help="methods to run (full always runs in the benchmark: speed-ups are over it)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 32], help="multiples of the model's 32")
    parser.add_argument("--heads", type=int, help="heads (default 12, the model's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed calls before them (default 3)")
    parser.add_argument("--e2e-lengths", type=int, nargs="*",
                        help=f"document lengths embedded end to end (default {E2E_LENGTHS}); none to skip")
    parser.add_argument("--e2e-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="model weights for end to end")
    parser.add_argument("--e2e-repeats", type=int, help="timed repeats end to end (default 3)")
    parser.add_argument("--no-stages", action="store_true", help="skip the stage breakdown")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay times")
    parser.add_argument("--graph-max-length", type=int,
                        help="end to end: the longest input replayed from CUDA graphs (default: the loader's 8192)")
    parser.add_argument("--profile-lengths", "--profile-length", type=int, nargs="*", default=[16384],
                        dest="profile_lengths",
                        help="torch.profiler table per method at each of these lengths, attention alone "
                             "and end to end (default 16384; none or 0: no profile)")
    parser.add_argument("--dry-run", "--interpret", action="store_true", dest="dry_run",
                        help="CPU, Triton's interpreter, tiny sizes and knobs: tests the script, measures nothing")
    parser.add_argument("--model", help="checkpoint folder (default: the default model, nomic-embed-text-v1.5)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu"),
                        help="folder for the results (a session's are summarised by bench.gpu.summary)")
    parser.add_argument("--name", help="file stem (default <date>-<gpu>)")
    return parser


def parse_settings(argv: list[str] | None = None) -> Settings:
    """The run's settings from the command line."""
    args = _parser().parse_args(argv)

    defaults = dict(lengths=LENGTHS, e2e_lengths=E2E_LENGTHS, heads=12, repeats=10,
                    warmup=3, e2e_repeats=3)
    if args.dry_run:
        defaults.update(DRY_RUN)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton first decorates a kernel
        if os.environ["TRITON_INTERPRET"] != "1" or "clusterserve.kernels.triton.clustered" in sys.modules:
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 before the kernels are imported")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run to test the script on CPU")
    else:
        device = torch.device("cuda")
    pick = {name: getattr(args, name) if getattr(args, name) is not None else value for name, value in defaults.items()}
    specs = {
        label: dry_run_spec(spec) if args.dry_run and spec.method != "full" else spec
        for label, spec in SPECS.items() if label in args.methods or spec.method == "full"
    }
    profile_lengths = tuple(n for n in args.profile_lengths if n > 0)
    if args.dry_run and profile_lengths and not set(profile_lengths) & set(pick["lengths"]):
        profile_lengths = (pick["lengths"][0],)  # so that the dry run goes through the profiler too
    machine = "cpu-interpret" if args.dry_run else device_name()
    stem = args.name or f"{datetime.date.today().isoformat()}-{slug(machine)}"
    settings = Settings(
        device=device, dtype=getattr(torch, args.dtype), heads=pick["heads"], head_dims=tuple(args.head_dims),
        lengths=tuple(pick["lengths"]), e2e_lengths=tuple(pick["e2e_lengths"]),
        e2e_dtype=getattr(torch, args.e2e_dtype),
        repeats=pick["repeats"], warmup=pick["warmup"], e2e_repeats=pick["e2e_repeats"],
        stages=not args.no_stages, graphs=not args.no_graphs,
        graph_max_length=args.graph_max_length, profile_lengths=profile_lengths,
        specs=specs, model=args.model, out=args.out, stem=stem, dry_run=args.dry_run,
    )
    return settings


def slug(text: str) -> str:
    """A file-name stem of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
