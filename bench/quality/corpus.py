"""Long technical documents and queries for the retrieval benchmark, from this machine's own
text: Debian's manual pages, rendered with `man` (plain text, no hyphenation).

    documents(encoder, count, min_tokens, max_tokens)   -> [Document]: distinct pages whose
        rendered text has min..max tokens, chosen deterministically (sorted by name, spread
        evenly over the candidates)
    passages(documents, per_document, words, seed)      -> [Query]: word spans from inside each
        document (between 10% and 90% of it) that occur in no other document
    questions(documents, path)                          -> [Query]: questions written by hand
        about the default corpus's pages (QUESTIONS), for the pages in `documents`
    split_sets(encoder, min_tokens, max_tokens, held_out) -> (dev, held_out) [Document]: every
        distinct page of min..max tokens, a quarter to tune on and `held_out` of the rest

The same machine and seed give the same corpus; another machine's man pages give another.
"""

from __future__ import annotations

import gzip
import itertools
import os
import random
import re
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MAN_DIR = Path("/usr/share/man")
QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "man-questions.tsv"
SECTIONS = ("man1", "man8", "man5")
# Compressed size of a page whose rendered text is ~2k-30k tokens; rendering is the slow part,
# so candidates are chosen by size first.
MIN_GZ_BYTES, MAX_GZ_BYTES = 5_000, 60_000


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    tokens: int


@dataclass(frozen=True)
class Query:
    text: str
    document: int  # index of the document it comes from


def render(page: Path) -> str:
    """A man page as plain text, lines joined at 100 columns, no hyphenation, whitespace runs
    inside lines kept (the page's own layout)."""
    env = {**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "", "MANROFFOPT": "-rHY=0", "LC_ALL": "C.UTF-8"}
    done = subprocess.run(["man", "-P", "cat", "-l", str(page)], capture_output=True, text=True, env=env, timeout=60)
    text = re.sub(r".\x08", "", done.stdout)  # overstrike bold and underline, should any remain
    return text.replace("\u2010", "-")


def candidates() -> list[Path]:
    """Man pages (English, sections 1, 8, 5) of a size likely to be a few thousand tokens, the
    first of each program family by name."""
    pages = []
    for section in SECTIONS:
        folder = MAN_DIR / section
        if folder.is_dir():
            pages += [
                p for p in folder.glob("*.gz")
                if p.is_file() and not p.is_symlink() and MIN_GZ_BYTES <= p.stat().st_size <= MAX_GZ_BYTES
            ]  # fmt: skip
    # One page per program family (git-*, gcloud_*, ...): a family's pages share whole sections.
    by_family: dict[str, Path] = {}
    for page in sorted(pages, key=lambda p: p.name):
        by_family.setdefault(re.split(r"[-_.]", page.name, maxsplit=1)[0], page)
    return sorted(by_family.values(), key=lambda p: p.name)


def documents(encoder, count: int, min_tokens: int, max_tokens: int) -> list[Document]:
    """`count` pages of min_tokens..max_tokens tokens, spread evenly over the candidates, each
    with a distinct first line (no two renderings of one program)."""
    pages = candidates()
    if not pages:
        raise FileNotFoundError(f"no manual pages under {MAN_DIR}; install man-db and some packages' pages")
    step = max(1, len(pages) // (count * 4))
    # Sweep the whole list, then again from the next offset.
    swept = (page for start in range(step) for page in pages[start::step])
    chosen = list(itertools.islice(_distinct(encoder, swept, min_tokens, max_tokens), count))
    if len(chosen) < count:
        raise RuntimeError(f"only {len(chosen)} man pages of {min_tokens}-{max_tokens} tokens, asked for {count}")
    return chosen


def split_sets(encoder, min_tokens: int, max_tokens: int, held_out: int) -> tuple[list[Document], list[Document]]:
    """Every distinct page of min_tokens..max_tokens tokens, sorted by name: every fourth is
    the development set (to choose defaults on), and `held_out` pages spread evenly over the
    others the held-out set (to report on). Deterministic for a machine's man pages."""
    pages = list(_distinct(encoder, candidates(), min_tokens, max_tokens))
    dev = pages[0::4]
    rest = [page for i, page in enumerate(pages) if i % 4]
    if len(rest) < held_out:
        raise RuntimeError(f"only {len(rest)} man pages of {min_tokens}-{max_tokens} tokens to hold out, asked for {held_out}")
    step = (len(rest) - 1) / max(held_out - 1, 1)
    return dev, [rest[round(i * step)] for i in range(held_out)]


def passages(docs: list[Document], per_document: int, words: int, seed: int = 0) -> list[Query]:
    """`per_document` spans of `words` words from inside each document, each found in no
    other document (whitespace collapsed), as queries."""
    rng = random.Random(seed)
    flat = [" ".join(doc.text.split()) for doc in docs]
    queries = []
    for index, text in enumerate(flat):
        tokens = text.split(" ")
        found = 0
        for _ in range(200):
            if found == per_document:
                break
            start = rng.randrange(len(tokens) // 10, max(len(tokens) * 9 // 10 - words, len(tokens) // 10 + 1))
            passage = " ".join(tokens[start : start + words])
            if len(passage) > words * 2 and not any(passage in other for j, other in enumerate(flat) if j != index):
                queries.append(Query(passage, index))
                found += 1
    return queries


def questions(docs: list[Document], path: Path = QUESTIONS) -> list[Query]:
    """The questions of `path` (lines of page name, tab, question; # comments) about the pages
    in `docs`; none when another machine's man pages make another corpus."""
    index = {doc.name: i for i, doc in enumerate(docs)}
    queries = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            page, text = line.split("\t", 1)
            if page in index:
                queries.append(Query(text.strip(), index[page]))
    return queries


def _distinct(encoder, pages: Iterable[Path], min_tokens: int, max_tokens: int) -> Iterator[Document]:
    """The pages, in order, rendered, of min_tokens..max_tokens tokens, each with a first line
    no page before it had (no two renderings of one program), `.so` pointers left out."""
    seen: set[str] = set()
    for page in pages:
        if _is_gzip_junk(page):
            continue
        text = render(page)
        title, tokens = _title(text), encoder.count_tokens([text])[0]
        if title and title not in seen and min_tokens <= tokens <= max_tokens:
            seen.add(title)
            yield Document(page.name.removesuffix(".gz"), text, tokens)


def _title(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _is_gzip_junk(page: Path) -> bool:
    """A page that is only a `.so` pointer to another page."""
    with gzip.open(page, "rt", errors="replace") as handle:
        return handle.read(4) == ".so "
