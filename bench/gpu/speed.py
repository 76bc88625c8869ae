"""GPU benchmark: exact attention (SDPA) against clustered, improved clustered and
SMYRF attention through the Triton backend, from 1k to 64k tokens, with a per-stage breakdown
and end-to-end embedding times, as ratios measured in one run.

    python -m clusterserve.bench.gpu.speed [--lengths 1024 ... 65536] [--head-dims 64 32] [--repeats 10]
    python -m clusterserve.bench.gpu.speed --dry-run      # the same script on CPU under TRITON_INTERPRET=1, tiny sizes

Attention alone: B = 1, 12 heads, bfloat16, for each head dim. Q, K, V are the default
model's own projections of real text (Debian's license texts): at the model's head dim (32)
they are its layer 0 as is; at 64 each head concatenates that head's 32-dim projections from
layers 0 and 1 (so its logits are the sum of two real heads' logits, scaled by 1/sqrt(64)).
Times are medians of CUDA-event times after warm-up, each repeat from an idle GPU (the
latency a caller sees); `graph_ms` is the same call replayed from a CUDA graph (no launch
gaps). rel_err is |out - exact| / |exact| (Frobenius), exact = float32 attention on the same
bfloat16 inputs, so the `full` row shows bfloat16's own error. peak_bytes is the CUDA
allocator's peak above what was allocated before the call.

Stage breakdown: the backend's stage functions timed one by one (bench/gpu/stages.py), with the
torch ops and Triton launches each makes. End to end: one document of 512, 4k, 16k and 32k
tokens embedded by the default model on the GPU, per method: `ms` with every layer run
eagerly on the unpadded input, `graph_ms` with the layers replayed from the encoder's CUDA
graphs (models.runtime.graphs; after the eager warm-up and the capture call; None above
cuda_graph_max_length), and `graph_cosine`, the cosine between the two vectors.

Writes under --out (default bench/out/gpu/): <date>-<gpu>.json, a list of rows
{"method", "seq_len", "batch", "heads", "head_dim", "dtype", "ms", "speedup_vs_full",
"peak_bytes", "rel_err", "device"} (plus "kind": attention | embed, and extras);
<date>-<gpu>-stages.json; <date>-<gpu>.png (time and speed-up against length); with
--profile-lengths, <date>-<gpu>-profile.txt (one call per method at each of those lengths,
attention alone and end to end, eager). Prints the tables. The JSON is rewritten after
every length, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec, attention

from ..common import eager_layers, exact_attention, long_text_ids, peak_memory_during, real_qkv, rel_err
from ..timing import capture_graph, median_ms
from .output import dtype_name, plot, print_tables, progress, write_outputs
from .settings import Settings, parse_settings

# ---- attention alone -------------------------------------------------------------------------


def bench_attention(settings: Settings, encoder, n: int, rows: list, stage_rows: list, profile: list) -> None:
    """Every method on the model's q, k, v of n tokens of real text, per head dim: appends a
    row per method to `rows`, stage rows to `stage_rows`, profiler tables to `profile`."""
    ids = long_text_ids(encoder, n)
    for head_dim in settings.head_dims:
        q, k, v = real_qkv(encoder, ids, head_dim, settings.heads, settings.dtype)
        scale = 1.0 / math.sqrt(head_dim)
        exact = exact_attention(q, k, v, None, scale)
        group = []
        for label, spec in settings.specs.items():
            def call(spec=spec):
                return attention(q, k, v, spec, scale=scale, backend="triton")

            out = call()  # compiles, and the row's error
            row = dict(
                kind="attention", method=label, seq_len=n, batch=1, heads=settings.heads, head_dim=head_dim,
                dtype=dtype_name(settings.dtype), ms=_time(settings, call), graph_ms=_graph_ms(settings, call, out),
                speedup_vs_full=None, peak_bytes=int(peak_memory_during(call)), rel_err=rel_err(out, exact),
                device=settings.device_label, spec=spec.used_knobs(),
                backend="sdpa" if spec.method == "full" else "triton",
            )
            group.append(row)
            print(progress(row), flush=True)
            if settings.stages:
                stage_rows += _stage_rows(settings, q, k, v, spec, scale, out, row)
            if n in settings.profile_lengths and head_dim == settings.head_dims[0]:
                profile.append(_profile(settings, f"{label}, {n} tokens", call))
            del out
        _speedups(group)
        rows += group


def _time(settings: Settings, fn) -> float:
    return median_ms(fn, settings.device, settings.repeats, settings.warmup)


def _graph_ms(settings: Settings, fn, eager: Tensor) -> float | None:
    """Replay time of fn from a CUDA graph; None on CPU, with --no-graphs, or when capture
    fails (the failure is printed: it means a host sync or a capture-unsafe op)."""
    if settings.device.type != "cuda" or not settings.graphs:
        return None
    try:
        graph, out = capture_graph(fn, settings.device)
    except Exception as error:  # noqa: BLE001 - reported, and the eager time stands
        print(f"  CUDA graph capture failed: {type(error).__name__}: {error}", flush=True)
        return None
    ms = median_ms(graph.replay, settings.device, settings.repeats, settings.warmup)
    if not torch.equal(out, eager):
        print("  CUDA graph replay differs from the eager output", flush=True)
    del graph, out
    torch.cuda.empty_cache()
    return ms


def _stage_rows(settings: Settings, q, k, v, spec: AttentionSpec, scale: float, out: Tensor, row: dict) -> list[dict]:
    """Time and kernel counts of each stage of spec's method, plus their sum, as rows."""
    from .stages import count_stage_launches, same_as_backend, stage_plan, time_stages  # imports the Triton kernels

    plan = stage_plan(q, k, v, spec, scale)
    if not same_as_backend(plan, out):
        print(f"  WARNING: the stages of {row['method']} do not reproduce the backend's output", flush=True)
    times = time_stages(plan, lambda fn: _time(settings, fn))
    launches = count_stage_launches(plan)
    total = row["ms"]
    result = []
    for stage in plan.stages:
        ms = times[stage.name]
        result.append(dict(
            method=row["method"], seq_len=row["seq_len"], heads=row["heads"], head_dim=row["head_dim"],
            dtype=row["dtype"], stage=stage.name, ms=ms, share_of_call=ms / total if total > 0 else None,
            **launches[stage.name], device=row["device"],
        ))
    result.append(dict(
        method=row["method"], seq_len=row["seq_len"], heads=row["heads"], head_dim=row["head_dim"],
        dtype=row["dtype"], stage="sum of stages", ms=sum(times.values()),
        share_of_call=sum(times.values()) / total if total > 0 else None,
        torch_ops=sum(r["torch_ops"] for r in result), triton_launches=sum(r["triton_launches"] for r in result),
        device=row["device"],
    ))
    return result


def _profile(settings: Settings, label: str, fn) -> str:
    """torch.profiler's table of one call (kernels by device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = settings.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(settings.device)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return f"== {label} ==\n" + prof.key_averages().table(sort_by=sort_by, row_limit=25)


def _speedups(group: list[dict]) -> None:
    full = next((r["ms"] for r in group if r["method"] == "full"), None)
    for r in group:
        r["speedup_vs_full"] = full / r["ms"] if full and r["ms"] > 0 else None


# ---- end to end ------------------------------------------------------------------------------


def bench_embed(settings: Settings, encoder, n: int, rows: list, profile: list) -> None:
    """One document of n tokens embedded by `encoder` (weights in e2e_dtype) per method, and at
    the profile length a profile of one eager call per method.
    On CPU (dry run) the model's attention takes the torch reference, as `auto` does there."""
    ids = long_text_ids(encoder, n)
    group, exact = [], None
    for label, spec in settings.specs.items():
        def call(spec=spec):
            return encoder.embed([ids], spec, max_batch_tokens=n)

        with eager_layers(encoder):  # eager first: every layer launched
            vector = call()
            ms = median_ms(call, settings.device, settings.e2e_repeats, min(settings.warmup, 1))
            peak = int(peak_memory_during(call))
            if n in settings.profile_lengths:
                profile.append(_profile(settings, f"embed {label}, {n} tokens", call))
        graph_ms, graph_cosine = _embed_graph_ms(settings, encoder, call, len(ids), vector)
        exact = vector if spec.method == "full" else exact
        row = dict(
            kind="embed", method=label, seq_len=n, batch=1, heads=encoder.model.config.num_heads,
            head_dim=encoder.model.config.head_dim, dtype=dtype_name(settings.e2e_dtype), ms=ms,
            graph_ms=graph_ms, graph_cosine=graph_cosine, speedup_vs_full=None, peak_bytes=peak,
            rel_err=rel_err(vector, exact) if exact is not None else None,
            cosine=torch.nn.functional.cosine_similarity(vector, exact).item() if exact is not None else None,
            device=settings.device_label, spec=spec.used_knobs(), backend="sdpa" if spec.method == "full" else "auto",
        )
        group.append(row)
        print(progress(row), flush=True)
    _speedups(group)
    rows += group


def _embed_graph_ms(settings: Settings, encoder, call, tokens: int, eager: Tensor) -> tuple[float | None, float | None]:
    """Median ms of `call` with the encoder's layers replayed from CUDA graphs, and the cosine
    of its vector to the eager one; (None, None) without graphs (CPU, --no-graphs) or for an
    input longer than they take."""
    graphs = encoder.graphs
    if graphs is None or not settings.graphs or not graphs.takes([tokens]):
        return None, None
    captured = graphs.counts["captured"]
    call()  # this batch shape's eager warm-up
    vector = call()  # captured, then replayed
    if graphs.counts["captured"] == captured:
        print(f"  CUDA graphs: nothing captured for {tokens} tokens (failed: {graphs.counts['failed']})", flush=True)
    ms = median_ms(call, settings.device, settings.e2e_repeats, 0)
    return ms, torch.nn.functional.cosine_similarity(vector, eager).item()


def load_model(settings: Settings, dtype: torch.dtype):
    """The model (embedded default or --model) on the device, with positions for the longest
    length asked (a learned table is extended by copying)."""
    from clusterserve.models import load_encoder

    longest = max((*settings.lengths, *settings.e2e_lengths, 32768))
    graphs = {} if settings.graph_max_length is None else {"cuda_graph_max_length": settings.graph_max_length}
    return load_encoder(settings.model, max_input_tokens=longest, device=settings.device, dtype=dtype, **graphs)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    torch.set_grad_enabled(False)
    dry = "; DRY RUN: nothing here is a measurement" if settings.dry_run else ""
    print(f"{settings.device_label}; torch {torch.__version__}{dry}", flush=True)
    encoder = load_model(settings, torch.float32)  # float32 projections, cast per benchmark dtype
    embed_encoder = load_model(settings, settings.e2e_dtype) if settings.e2e_lengths else None
    rows, stage_rows, profile = [], [], []
    for n in settings.lengths:
        bench_attention(settings, encoder, n, rows, stage_rows, profile)
        write_outputs(settings, rows, stage_rows, profile)
    for n in settings.e2e_lengths:
        bench_embed(settings, embed_encoder, n, rows, profile)
        write_outputs(settings, rows, stage_rows, profile)
    paths = write_outputs(settings, rows, stage_rows, profile)
    print_tables(rows, stage_rows)
    png = settings.out / f"{settings.stem}.png"
    plot(rows, png)
    print("wrote " + ", ".join(str(p) for p in [*paths, png]))


if __name__ == "__main__":
    main()
