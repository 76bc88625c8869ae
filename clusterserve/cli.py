"""The `clusterserve` command: `clusterserve serve [flags]` runs the server (the flags of
`python -m clusterserve.service`), `clusterserve fetch [--check]` fetches the default model once
(`python -m clusterserve.models.fetch`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: clusterserve {serve,fetch} [options]

  serve   serve embeddings over HTTP (clusterserve serve --help)
  fetch   fetch the default model's file once into the cache (clusterserve fetch --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else (None, [])
    if command == "serve":
        from clusterserve.service.__main__ import main as serve

        serve(rest)
        return 0
    if command == "fetch":
        from clusterserve.models.fetch import main as fetch

        return fetch(rest)
    if command in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    print(USAGE if command is None else f"clusterserve: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
