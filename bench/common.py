"""Shared pieces of the benchmarks: real long text, real Q/K/V, exact attention and the error
to it, peak memory, output.

Benchmarks compare variants as ratios measured in the same run; absolute times depend on
the machine and say little on their own.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec, native
from clusterserve.kernels.reference.full import full_attention

LICENSE_DIR = Path("/usr/share/common-licenses")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# Calibration measures on the first set; tests check its choices on the held-back second set.
CALIBRATION_TEXTS = ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "CC0-1.0")
HELD_BACK_TEXTS = ("MPL-1.1", "MPL-2.0", "GFDL-1.3", "Artistic", "BSD")


def nomic_default() -> AttentionSpec:
    """What `auto` runs for the default model (nomic-embed-text-v1.5) at its 8,192-token context
    and the server's default target fidelity: the shipped calibration table's choice."""
    from clusterserve.models.planning.calibration import DEFAULT_TARGET_FIDELITY, SHIPPED_DIR, load_calibration, table_name

    table = load_calibration(SHIPPED_DIR / table_name("nomic-embed-text-v1.5", "cpu"))
    return table.choose(8192, DEFAULT_TARGET_FIDELITY).spec


# The benchmarks' methods: the paper's 10 Hamming iterations, SMYRF 4 x 64, and banded as auto
# serves the default model at 8k.
SPECS = {
    "full": AttentionSpec(method="full"),
    "clustered": AttentionSpec(method="clustered", clusters=100, bits=63, iterations=10),
    "i-clustered (paper)": AttentionSpec(method="i-clustered", clusters=100, topk=32, bits=63, iterations=10, refine=0),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=100, topk=32, bits=63, iterations=10, refine=3),
    "smyrf": AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
    "banded": nomic_default(),  # what auto serves the default model at 8k
}
# What bench.cpu.speed and bench.gpu.speed measure: SPECS (which every benchmark of the methods
# shares), and the clustered methods at the knobs a request that names only the method gets.
MEASURED = {
    **SPECS,
    "clustered (default)": AttentionSpec(method="clustered"),
    "i-clustered (default)": AttentionSpec(method="i-clustered"),
}


def long_text_ids(encoder, tokens: int, offset: int = 0, texts: tuple[str, ...] | None = None) -> list[int]:
    """Token ids of `tokens` tokens of real English prose (Debian's license texts, all of them
    or the named ones, repeated when more is asked than they hold), starting `offset` tokens
    in, framed as the encoder frames a text: [CLS], the model's default prompt's tokens (nomic's
    "search_document: "), the text, [SEP]."""
    if texts is None:
        files = sorted(p for p in LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink())
    else:
        files = [LICENSE_DIR / name for name in texts if (LICENSE_DIR / name).is_file()]
    if not files:
        raise FileNotFoundError(f"no texts under {LICENSE_DIR}; install Debian's base-files")
    corpus = "\n\n".join(p.read_text(errors="replace") for p in files)
    body = encoder.tokenize([corpus])[0].ids[1:-1]  # without the special tokens
    prompt = encoder.tokenize([encoder.prompts.text(None)])[0].ids[1:-1]
    need = offset + tokens - 2 - len(prompt)
    body = (body * (need // len(body) + 1))[offset:need]
    first, last = encoder.tokenize([""])[0].ids
    return [first, *prompt, *body, last]


@contextmanager
def eager_layers(encoder) -> Iterator[None]:
    """Every layer of `encoder` launched eagerly on unpadded batches inside, its CUDA graphs
    (if any) restored after."""
    graphs, encoder.graphs = encoder.graphs, None
    try:
        yield
    finally:
        encoder.graphs = graphs


def capture_qkv(encoder, ids: list[int], layer: int = 0) -> tuple[torch.Tensor, ...]:
    """The q, k, v (1, H, N, D) that the default BERT model's `layer` feeds its attention, on
    the encoder's device and in its dtype."""
    attn = encoder.model.layers[layer].attn
    captured: dict[str, torch.Tensor] = {}

    class Stop(Exception):
        pass

    def keep(name):
        def hook(_module, _inputs, output):
            n, c = output.shape  # packed: (T, C), one sequence
            captured[name] = output.view(1, n, attn.num_heads, -1).transpose(1, 2).contiguous()
            if len(captured) == 3:
                raise Stop

        return hook

    handles = [getattr(attn, name).register_forward_hook(keep(name)) for name in ("q", "k", "v")]
    try:
        with eager_layers(encoder):  # a replayed graph calls no hook
            encoder.run([ids], [AttentionSpec(method="full")])
    except Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured["q"], captured["k"], captured["v"]


def real_qkv(encoder, ids: list[int], head_dim: int, heads: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (1, heads, N, head_dim) in dtype from the model on real text. A head_dim that is a
    multiple of the model's concatenates head h of layers 0, 1, ... so that every coordinate is a
    real projection of the same tokens; one that divides the model's keeps each head's first
    head_dim coordinates of layer 0."""
    model_dim = encoder.model.config.head_dim
    if head_dim < model_dim and model_dim % head_dim == 0:
        q, k, v = capture_qkv(encoder, ids, 0)
        return tuple(t[:, :heads, :, :head_dim].to(dtype).contiguous() for t in (q, k, v))
    layers = head_dim // model_dim
    if head_dim % model_dim or not 1 <= layers <= encoder.model.config.num_layers:
        raise ValueError(
            f"head_dim: must divide the model's {model_dim} or be a multiple of it up to its layers, got {head_dim}"
        )
    parts = [capture_qkv(encoder, ids, layer) for layer in range(layers)]
    return tuple(torch.cat([p[i] for p in parts], dim=-1)[:, :heads].to(dtype).contiguous() for i in range(3))


def exact_attention(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float,
                    chunk: int = 2048) -> Tensor:
    """Exact attention in float32, `chunk` queries at a time so that no SDPA backend needs
    N x M memory (float32 may not take the flash path). Same masking as `full_attention`."""
    qf, kf, vf = q.float(), k.float(), v.float()
    n, m = q.shape[2], k.shape[2]
    out = torch.cat(
        [full_attention(qf[:, :, s : s + chunk], kf, vf, key_padding_mask, scale) for s in range(0, n, chunk)], dim=2
    )
    if key_padding_mask is not None and n == m:
        out = out * key_padding_mask[:, None, :, None]
    return out


def rel_err(out: Tensor, exact: Tensor) -> float:
    """|out - exact| / |exact|, Frobenius norms in float32."""
    return ((out.float() - exact).norm() / exact.norm().clamp(min=1e-30)).item()


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0, /proc/self/clear_refs = 5); False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_memory_during(fn: Callable[[], object]) -> int:
    """Bytes the process's RSS rose above its level before fn() (CPU), or the CUDA
    allocator's peak above the allocation before it (GPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    reset_peak_rss()
    before = current_rss_bytes()
    fn()
    return max(0, peak_rss_bytes() - before)


def cuda_or_interpreter() -> torch.device:
    """The device of a GPU script: CPU under TRITON_INTERPRET=1 (the script tested on the
    interpreter), else CUDA, which must be there."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or under TRITON_INTERPRET=1 to test the script")
    return torch.device("cuda")


def gpu_script_setup(model: str | None, lengths: list[int]):
    """(device, encoder, dtype) of a GPU script that feeds attention real projections: the
    device (cuda_or_interpreter), the encoder loaded in float32 for the longest of `lengths`,
    and the attention's dtype (bfloat16 on CUDA, float32 under the interpreter). Turns
    autograd off."""
    from clusterserve.models import load_encoder

    device = cuda_or_interpreter()
    torch.set_grad_enabled(False)
    encoder = load_encoder(model, max_input_tokens=max(max(lengths), 512), device=device, dtype=torch.float32)
    return device, encoder, torch.float32 if device.type == "cpu" else torch.bfloat16


def gpu_script_qkv(encoder, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """A GPU script's q, k, v: real_qkv of n tokens of real text at head dim 64, 12 heads on
    CUDA (the cost model's shape) and 2 under the interpreter."""
    heads = 2 if encoder.device.type == "cpu" else 12
    return real_qkv(encoder, long_text_ids(encoder, n), 64, heads, dtype)


def device_name() -> str:
    """The GPU's name, or the CPU's architecture, cores, native loops' level (AVX-512 or not:
    their float sums, and so clusters and cosines, differ between levels) and torch."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"native {native.level() or 'none'}, torch {torch.__version__}")


def write_results(name: str, rows: list[dict], meta: dict) -> Path:
    """Write rows and metadata as JSON under bench/results/; returns the path."""
    return write_report(name, {"meta": meta, "rows": rows})


def write_report(name: str, report: dict) -> Path:
    """Write a report of any shape as JSON under bench/results/; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def rows_json(tree, width: int = 150, indent: int = 0) -> str:
    """JSON of `tree` with a row a line: a dict or list of scalars (and of containers of
    scalars), or one whose one-line form fits in `width` characters, is written on one line, a
    larger one an item a line (small to commit, readable in a diff)."""
    flat = json.dumps(tree)
    if not isinstance(tree, (dict, list)) or len(flat) + indent <= width or _is_row(tree):
        return flat
    pad = " " * (indent + 1)
    if isinstance(tree, dict):
        items = [f"{pad}{json.dumps(key)}: {rows_json(value, width, indent + 1)}" for key, value in tree.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + rows_json(value, width, indent + 1) for value in tree]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _is_row(tree, depth: int = 2) -> bool:
    """A container of scalars, to `depth` levels of containers."""
    if not isinstance(tree, (dict, list)):
        return True
    values = tree.values() if isinstance(tree, dict) else tree
    return depth > 0 and all(_is_row(value, depth - 1) for value in values)


def rounded(tree, digits: int = 4):
    """Every float of `tree` to `digits` significant digits: what a measurement or an estimate
    is worth, and no more to commit."""
    if isinstance(tree, float):
        return float(f"{tree:.{digits}g}")
    if isinstance(tree, dict):
        return {k: rounded(v, digits) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [rounded(v, digits) for v in tree]
    return tree


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def run_conditions(**extra: object) -> dict:
    """What a result file says about the run: the machine, threads, load, date, and `extra`."""
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **extra,
    }
