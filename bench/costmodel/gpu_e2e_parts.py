"""The parts of bench.costmodel.gpu_e2e_model: one forward pass of nomic-embed-text-v1.5
(bfloat16) on an H100 SXM as dense products, attention, row-wise ops and host time, and the
calibration that reads their constants off the measured session
bench/results/h100-2026-11-27-2.json and the attention estimates of bench/results/gpu_model.json.
Every figure here is an estimate; the module docstring of gpu_e2e_model explains the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from clusterserve.models.loader import DEFAULT_CUDA_GRAPH_MAX_LENGTH
from clusterserve.models.networks.rows import ROWS

from ..common import RESULTS_DIR
from .gpu_model import HOST_GRAPH_REPLAY_US
from .launch_cost import HBM_BYTES_PER_S

SESSION = RESULTS_DIR / "h100-2026-11-27-2.json"
ATTENTION_ESTIMATES = RESULTS_DIR / "gpu_model.json"
# Dense bf16 GEMM and cuDNN's flash SDPA on that H100, measured (609 TF/s in that session; the
# session's exact 16k profile: 12 aten::_cudnn_attention_forward calls, 20.05 ms, 4 H N^2 d each).
DENSE_FLOPS_PER_S = 609e12
SDPA_FLOPS_PER_S = 493e12
PROFILED_TOKENS = 16384  # the session's end-to-end profiles: one document of this many tokens, eager
FIT_TOKENS = (2048, 16384)  # the exact rows the host constants are solved from (8192 is left to validate)
ATTENTION_LAUNCH_FIT_TOKENS = 4096  # attention-alone eager calls there are host-bound: fit the launch cost
# Torch ops a pass makes outside its layers: word and token-type lookups, their add, the
# embeddings' LayerNorm, mean pooling and normalisation (counted, not measured).
REQUEST_OPS = 8
# The row-wise ops of the code as measured and the profile entry that times each.
ROW_OPS = {"layernorm": "aten::native_layer_norm", "swiglu multiply": "aten::mul", "silu": "aten::silu",
           "rotary": "_rotary_kernel", "residual add": "aten::add", "ffn cat": "aten::cat"}
# Pipelines whose (B, H, N, D) output Packed.attend's reshape copies back to (T, H, D): one
# strided copy a layer (12 `elementwise_kernel<128, 4>` launches in their 16k profiles, none in
# exact's or banded's).
OUTPUT_COPY_METHODS = ("clustered", "i-clustered", "smyrf")
# The code priced: "measured", as it ran on 2026-11-27 (what the constants are fitted to), or
# "current", this checkout's GPU path (models.networks.rotary_bert.fuse_projections): one q/k/v
# and one gate/up product a layer, q and k rotated in one launch, fused residual + LayerNorm and
# SiLU x up kernels, the FFN unchunked, exact attention with no key mask (varlen flash attention
# where a group is padded), token-id checks in C.
CODES = ("measured", "current")
# No row-wise kernel of the current code has been timed on a GPU: each is priced at the measured
# effective rate of the op of the measured code that moves the same streams (the residual add:
# two reads, one write, like add + LayerNorm; SiLU: streaming reads of an activation too large
# for L2, like SiLU x up's; the rotary kernel itself).
FUSED_RATES = {"add + layernorm": "residual add", "embeddings layernorm": "layernorm", "gated": "silu",
               "rotary": "rotary"}
# Host work a token: the token-id check of models.planning.inputs, a Python loop in the measured
# code, C passes in the current one: 5.40 and 0.63 ms at 16,384 ids on the 2-core EPYC (timeit,
# best of 5; the H100's host priced as that CPU). It is taken out of the measured rows before the
# host constants are fitted, and added back by code.
HOST_ID_CHECK_S_PER_TOKEN = {"measured": 5.40e-3 / 16384, "current": 0.63e-3 / 16384}


@dataclass(frozen=True)
class Network:
    """nomic-embed-text-v1.5 as models.networks.rotary_bert runs it: post-norm layers
    x = LN(x + attn(x)), x = LN(x + mlp(x)), RoPE on q and k, SwiGLU act(gate(x)) * up(x)."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    head_dim: int = 64
    intermediate: int = 3072  # gate and up each this wide
    value_bytes: int = 2  # bfloat16
    ffn_rows: int = ROWS  # models.networks.rows.by_rows: the FFN this many tokens at a time, then a cat


NOMIC = Network()


@dataclass(frozen=True)
class Costs:
    """Every constant of the model, with the per-method tables it reads. Rates in FLOP/s or
    bytes/s, host costs in seconds."""

    dense_flops_per_s: float = DENSE_FLOPS_PER_S
    sdpa_flops_per_s: float = SDPA_FLOPS_PER_S  # eager: no key mask, cuDNN's flash kernel
    masked_sdpa_flops_per_s: float = SDPA_FLOPS_PER_S  # graph mode: a key mask, another kernel (fitted)
    hbm_bytes_per_s: float = HBM_BYTES_PER_S  # nominal: the limit's row-wise ops
    row_bytes_per_s: dict = dataclasses.field(default_factory=dict)  # per ROW_OPS name, effective (fitted)
    output_copy_bytes_per_s: float = HBM_BYTES_PER_S  # fitted
    other_s_per_token: float = 0.0  # pooling, lookups, memsets: the profile's remainder (fitted)
    host_op_s: float = 0.0  # eager, per torch op (fitted)
    host_eager_pass_s: float = 0.0  # eager, per pass (fitted)
    host_attention_call_s: float = 0.0  # eager, per call of an attention pipeline (fitted)
    host_triton_launch_s: float = 0.0  # eager, per Triton launch of a pipeline, its Python stage code included (fitted)
    host_graph_pass_s: float = 0.0  # graph mode, per pass (fitted)
    host_graph_replay_s: float = HOST_GRAPH_REPLAY_US * 1e-6  # one layer's replay (gpu_model's)
    specs: dict = dataclasses.field(default_factory=dict)  # method label -> its spec's knobs
    attention_points: dict = dataclasses.field(default_factory=dict)  # method -> [(n, s a call)], gpu_model
    attention_launches: dict = dataclasses.field(default_factory=dict)  # method -> {n: (Triton launches, torch ops)}


def dense_flops(net: Network, tokens: int) -> float:
    """q, k, v, out (C x C each) and gate, up, down (C x F each): 2 FLOPs a weight a token."""
    return 2.0 * tokens * net.layers * (4 * net.hidden**2 + 3 * net.hidden * net.intermediate)


def dense_launches(net: Network, tokens: int, code: str = "measured") -> int:
    """Products a pass launches: measured, q, k, v, out and the FFN's three a row block;
    current, qkv, out, gate/up and down."""
    if code == "current":
        return net.layers * 4
    return net.layers * (4 + 3 * math.ceil(tokens / net.ffn_rows))


def sdpa_flops(net: Network, n: int, batch: int) -> float:
    """4 B H N^2 d a layer (QK^T and PV), all layers."""
    return 4.0 * net.layers * batch * net.heads * n * n * net.head_dim


def row_ops(net: Network, tokens: int, code: str = "measured") -> dict[str, tuple[int, float]]:
    """The row-wise kernels of a pass of `tokens` tokens, each (launches, bytes): every op
    reads its inputs and writes its output once. `code`: CODES."""
    t, layers = tokens, net.layers
    chunks = math.ceil(t / net.ffn_rows)
    x = t * net.hidden * net.value_bytes  # one (T, C) activation
    wide = t * net.intermediate * net.value_bytes  # one (T, F) activation, all chunks
    if code == "current":
        return {
            "add + layernorm": (2 * layers, 2 * layers * 3 * x),  # read x and the branch, write the norm
            "embeddings layernorm": (1, 2 * x),
            "gated": (layers, layers * 3 * wide),  # read gate and up, write the product
            "rotary": (layers, layers * 2 * 2 * x),  # q and k in one launch
        }
    cats = layers if chunks > 1 else 0
    return {
        "layernorm": (2 * layers + 1, (2 * layers + 1) * 2 * x),  # two a layer and the embeddings'
        "swiglu multiply": (layers * chunks, layers * 3 * wide),  # act(gate).mul_(up): two reads, one write
        "silu": (layers * chunks, layers * 2 * wide),
        "rotary": (2 * layers, 2 * layers * 2 * x),  # q and k
        "residual add": (2 * layers, 2 * layers * 3 * x),
        "ffn cat": (cats, cats * 2 * x),
    }


def limit_row_bytes(net: Network, tokens: int) -> float:
    """The row-wise bytes no epilogue absorbs: per layer two residual + LayerNorm passes (read
    x and the branch, write the sum's norm), and the embeddings' LayerNorm. SiLU * up runs in
    the gate/up GEMM's epilogue and rotary in the q/k projection's."""
    x = tokens * net.hidden * net.value_bytes
    return (net.layers * 2 * 3 + 2) * x


def interpolated(points: list[tuple[int, float]], n: int) -> float:
    """Piecewise log-log interpolation in n, extrapolated along the end segments."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    i = 0
    while i < len(points) - 2 and n > points[i + 1][0]:
        i += 1
    (n0, y0), (n1, y1) = points[i], points[i + 1]
    slope = math.log(y1 / y0) / math.log(n1 / n0)
    return y0 * (n / n0) ** slope


def nearest(table: dict[int, int], n: int) -> int:
    return table[min(table, key=lambda m: abs(math.log2(m) - math.log2(n)))]


def is_exact(costs: Costs, method: str) -> bool:
    return costs.specs[method]["method"] == "full"


def row_rate(costs: Costs, name: str) -> float:
    """The effective bytes/s a row-wise op of either code is priced at."""
    return costs.row_bytes_per_s[FUSED_RATES.get(name, name)]


def attention_s(costs: Costs, method: str, n: int, batch: int, masked: bool, net: Network = NOMIC) -> float:
    """All layers' attention on the device: exact at its SDPA rate (masked in graph mode), an
    approximate pipeline at gpu_model's per-call estimate for (1, 12, n, 64), times the batch."""
    if is_exact(costs, method):
        rate = costs.masked_sdpa_flops_per_s if masked else costs.sdpa_flops_per_s
        return sdpa_flops(net, n, batch) / rate
    return net.layers * batch * interpolated(costs.attention_points[method], n)


def device_parts(
    costs: Costs, method: str, n: int, batch: int, graph: bool, net: Network = NOMIC, code: str = "measured",
) -> dict[str, float]:
    """Seconds on the device by part: eager, or (graph) replayed from CUDA graphs, which copy x
    into and out of static buffers. The measured code passes exact attention a key mask in
    graphs; the current code none (a padded group runs varlen flash attention, priced at the
    unmasked rate)."""
    tokens = n * batch
    masked = graph and code == "measured"
    parts = {"dense": dense_flops(net, tokens) / costs.dense_flops_per_s,
             "attention": attention_s(costs, method, n, batch, masked, net)}
    parts |= {name: nbytes / row_rate(costs, name) for name, (_, nbytes) in row_ops(net, tokens, code).items()}
    x = tokens * net.hidden * net.value_bytes
    if costs.specs[method]["method"] in OUTPUT_COPY_METHODS:
        parts["output copy"] = net.layers * 2 * x / costs.output_copy_bytes_per_s
    parts["other"] = tokens * costs.other_s_per_token
    if graph:  # x copied into the static buffer, back inside the graph, then cloned out: plain copies
        parts["graph copies"] = net.layers * 3 * 2 * x / costs.row_bytes_per_s["ffn cat"]
    return parts


def eager_ops(costs: Costs, method: str, n: int, batch: int, net: Network = NOMIC, code: str = "measured") -> int:
    """The torch ops an eager pass launches from Python."""
    tokens = n * batch
    ops = REQUEST_OPS + dense_launches(net, tokens, code) + sum(n for n, _ in row_ops(net, tokens, code).values())
    if is_exact(costs, method):
        return ops + net.layers  # one SDPA op a layer
    _, pipeline_ops = nearest(costs.attention_launches[method], n)
    return ops + net.layers * (pipeline_ops + (costs.specs[method]["method"] in OUTPUT_COPY_METHODS))


def id_check_s(tokens: int, code: str) -> float:
    return HOST_ID_CHECK_S_PER_TOKEN[code] * tokens


def eager_host_s(costs: Costs, method: str, n: int, batch: int, net: Network = NOMIC, code: str = "measured") -> float:
    """The host's time for an eager pass: per pass, per torch op, per attention-pipeline call
    and Triton launch, and the id check a token."""
    pipeline = 0.0
    if not is_exact(costs, method):
        launches, _ = nearest(costs.attention_launches[method], n)
        pipeline = net.layers * (costs.host_attention_call_s + launches * costs.host_triton_launch_s)
    return (costs.host_eager_pass_s + eager_ops(costs, method, n, batch, net, code) * costs.host_op_s + pipeline
            + id_check_s(n * batch, code))


def graph_host_s(costs: Costs, net: Network = NOMIC, tokens: int = 0, code: str = "measured") -> float:
    """The host's time for a pass replayed from graphs: per pass, per layer a replay and the two
    torch ops around it (copy in, clone out), and the id check a token."""
    return (costs.host_graph_pass_s + net.layers * (costs.host_graph_replay_s + 2 * costs.host_op_s)
            + id_check_s(tokens, code))


def limit_s(costs: Costs, method: str, n: int, batch: int, net: Network = NOMIC) -> float:
    """Dense at its rate, attention at its rate (exact: unmasked SDPA), the row-wise bytes no
    epilogue absorbs at nominal HBM speed; no host time."""
    tokens = n * batch
    return (dense_flops(net, tokens) / costs.dense_flops_per_s + attention_s(costs, method, n, batch, False, net)
            + limit_row_bytes(net, tokens) / costs.hbm_bytes_per_s)


def estimate(costs: Costs, method: str, n: int, batch: int = 1, code: str = "measured") -> dict:
    """One pass of `batch` documents of n tokens (none padded) by `code`: eager and graph times
    with their host shares, the mode the service runs (graphs up to
    DEFAULT_CUDA_GRAPH_MAX_LENGTH, eager beyond) as estimate_ms, and the limit; milliseconds."""
    eager_parts = device_parts(costs, method, n, batch, graph=False, code=code)
    graph_parts = device_parts(costs, method, n, batch, graph=True, code=code)
    eager_device, graph_device = sum(eager_parts.values()), sum(graph_parts.values())
    eager_host = eager_host_s(costs, method, n, batch, code=code)
    graph_host = graph_host_s(costs, tokens=n * batch, code=code)
    # Eager, the host's time adds to the device's (the exact rows fit that; 16k: busy 30.2 of 43 ms).
    eager, graph = eager_device + eager_host, graph_device + graph_host
    graphed = n <= DEFAULT_CUDA_GRAPH_MAX_LENGTH
    ms = 1e3
    return dict(method=method, code=code, tokens=n, batch=batch, mode="graph" if graphed else "eager",
                estimate_ms=ms * (graph if graphed else eager), limit_ms=ms * limit_s(costs, method, n, batch),
                host_ms=ms * (graph_host if graphed else eager_host), eager_ms=ms * eager, graph_ms=ms * graph,
                device_ms=ms * eager_device,
                parts_ms={k: ms * v for k, v in (graph_parts if graphed else eager_parts).items()})


# ---- calibration ---------------------------------------------------------------------------------


def load_inputs(session: Path = SESSION, estimates: Path = ATTENTION_ESTIMATES) -> tuple[dict, dict]:
    return json.loads(session.read_text()), json.loads(estimates.read_text())


def profile(session: dict, kind: str, method: str, tokens: int = PROFILED_TOKENS) -> dict:
    return next(p for p in session["profiles"] if (p["kind"], p["method"], p["tokens"]) == (kind, method, tokens))


def profile_us(entry: dict, name: str) -> float:
    """A profile's device µs for an aten op (its self time) or a kernel (its launches')."""
    ops = {o["op"]: o["self_device_us"] for o in entry["ops"]}
    if name in ops:
        return ops[name]
    return sum(k["us"] for k in entry["kernels"] if k["kernel"] == name)


def embed_row(session: dict, method: str, n: int) -> dict:
    return next(r for r in session["embed"] if (r["method"], r["seq_len"]) == (method, n))


def method_tables(session: dict, estimates: dict) -> dict:
    """specs, attention_points and attention_launches for every method of the embed rows."""
    specs = {r["method"]: r["spec"] for r in session["embed"]}
    points = {m: [(c["seq_len"], c["device_ms"] * 1e-3) for c in estimates["calls"]
                  if c["spec"] == spec and c["head_dim"] == NOMIC.head_dim] for m, spec in specs.items()}
    launches = {m: {p["tokens"]: (sum(k["launches"] for k in p["kernels"] if k["category"] == "triton"),
                                  sum(o["calls"] for o in p["ops"]))
                    for p in session["profiles"] if p["kind"] == "attention" and p["method"] == m} for m in specs}
    missing = [m for m, spec in specs.items() if spec["method"] != "full" and not (points[m] and launches[m])]
    if missing:
        raise ValueError(f"no gpu_model.json estimate or attention profile for {missing}: regenerate them")
    return dict(specs=specs, attention_points=points, attention_launches=launches)


def exact_method(costs: Costs) -> str:
    return next(m for m in costs.specs if is_exact(costs, m))


def device_fit(costs: Costs, session: dict, net: Network = NOMIC) -> dict:
    """From the 16k profiles: each row-wise op's effective rate (its bytes over its device
    time, exact's profile), the remainder of exact's device time a token, and the output copy's
    rate (a copying method's aten::copy_ time above exact's)."""
    exact = profile(session, "embed", exact_method(costs))
    ops = row_ops(net, PROFILED_TOKENS)
    rates = {name: ops[name][1] / (profile_us(exact, source) * 1e-6) for name, source in ROW_OPS.items()}
    accounted = sum(profile_us(exact, name) for name in (*ROW_OPS.values(), "aten::mm", "aten::_cudnn_attention_forward"))
    copying = next(m for m, spec in costs.specs.items() if spec["method"] in OUTPUT_COPY_METHODS)
    copy_us = profile_us(profile(session, "embed", copying), "aten::copy_") - profile_us(exact, "aten::copy_")
    x = PROFILED_TOKENS * net.hidden * net.value_bytes
    return dict(row_bytes_per_s=rates, other_s_per_token=(exact["device_us"] - accounted) * 1e-6 / PROFILED_TOKENS,
                output_copy_bytes_per_s=net.layers * 2 * x / (copy_us * 1e-6))


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points (two: the line through them)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def host_fit(costs: Costs, session: dict, net: Network = NOMIC) -> dict:
    """Eager: exact's measured time less its modelled device time, at FIT_TOKENS, is a fixed
    cost a pass plus one a torch op. An attention pipeline's call: the attention-alone eager
    calls at ATTENTION_LAUNCH_FIT_TOKENS (host-bound: the device is busy a quarter of each or
    less) less their torch ops are a fixed cost a call plus one a Triton launch. Graph mode:
    exact's measured time less everything but its masked attention is a fixed cost a pass plus
    the attention's FLOPs over the masked rate."""
    exact = exact_method(costs)
    eager = [(eager_ops(costs, exact, n, 1, net),
              embed_row(session, exact, n)["ms"] * 1e-3 - sum(device_parts(costs, exact, n, 1, False, net).values())
              - id_check_s(n, "measured"))
             for n in FIT_TOKENS]
    pass_s, op_s = line(eager)
    costs = dataclasses.replace(costs, host_op_s=op_s, host_eager_pass_s=pass_s)
    calls = []
    for r in session["attention"]:
        if r["seq_len"] == ATTENTION_LAUNCH_FIT_TOKENS and r["method"] in costs.specs and not is_exact(costs, r["method"]):
            launches, ops = nearest(costs.attention_launches[r["method"]], r["seq_len"])
            calls.append((launches, r["ms"] * 1e-3 - ops * op_s))
    call_s, launch_s = line(calls)
    graph = []
    for n in FIT_TOKENS:
        parts = device_parts(costs, exact, n, 1, True, net)
        rest = sum(parts.values()) - parts["attention"] + graph_host_s(costs, net, n)
        graph.append((sdpa_flops(net, n, 1), embed_row(session, exact, n)["graph_ms"] * 1e-3 - rest))
    graph_pass_s, per_flop = line(graph)
    return dict(host_op_s=op_s, host_eager_pass_s=pass_s, host_attention_call_s=call_s, host_triton_launch_s=launch_s,
                host_graph_pass_s=graph_pass_s, masked_sdpa_flops_per_s=1.0 / per_flop)


def calibrate(session: dict, estimates: dict, net: Network = NOMIC) -> Costs:
    """The model's constants: the measured rates given above, the rest fitted to `session`."""
    costs = Costs(**method_tables(session, estimates))
    costs = dataclasses.replace(costs, **device_fit(costs, session, net))
    return dataclasses.replace(costs, **host_fit(costs, session, net))
