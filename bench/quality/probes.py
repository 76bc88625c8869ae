"""Synthetic long-context probes in the style of LongEmbed's passkey and needle tasks (Zhu et
al. 2024, "LongEmbed: Extending Embedding Models for Long Context Retrieval").

At each length, `candidates` documents of that many tokens: a haystack of real prose
(Debian's licence texts, each document from another offset) with one fact inserted at a
depth between 10% and 90%, on a sentence boundary. One query per document asks for its
fact; a retrieval is right when that document ranks first among the length's candidates.

    passkey   "<name>'s pass key is <5 digits>. Remember it. <digits> is the pass key for
              <name>."                       query: "What is the pass key for <name>?"
    needle    a distinct everyday fact       query: a question only that fact answers
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..common import LICENSE_DIR

NAMES = ("Amara", "Bjorn", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi", "Ines", "Jonas")
NEEDLES = (
    ("The best thing to do in Lisbon is to eat custard tarts on the river bank at dusk.",
     "What is the best thing to do in Lisbon?"),
    ("The secret ingredient in Tomas's lentil soup is a spoonful of smoked paprika.",
     "What is the secret ingredient in Tomas's lentil soup?"),
    ("The lighthouse keeper on Skerry Island feeds his three cats smoked mackerel every Sunday.",
     "What does the lighthouse keeper on Skerry Island feed his cats?"),
    ("The village choir of Oberwald rehearses in an old salt mine because of its echo.",
     "Where does the village choir of Oberwald rehearse?"),
    ("Doctor Okafor keeps her telescope on the roof of the city library.",
     "Where does Doctor Okafor keep her telescope?"),
    ("The kite festival in Weymouth was cancelled because the beach was full of jellyfish.",
     "Why was the kite festival in Weymouth cancelled?"),
    ("Priya learned to juggle flaming torches while she worked for a circus in Montreal.",
     "Where did Priya learn to juggle flaming torches?"),
    ("The oldest tree in Hallstatt is a lime tree planted by a blacksmith in 1702.",
     "Who planted the oldest tree in Hallstatt?"),
)  # fmt: skip
TASKS = ("passkey", "needle")


@dataclass(frozen=True)
class Probe:
    task: str
    tokens: int  # the documents' length, special tokens included
    documents: list[str]
    queries: list[str]  # queries[i] asks for documents[i]'s fact


def haystack(encoder) -> tuple[str, list[tuple[int, int]], list[int]]:
    """The filler text, its tokens' character offsets, and the characters where its sentences
    begin (after ". " or a blank line)."""
    files = sorted(p for p in LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no texts under {LICENSE_DIR}; install Debian's base-files")
    text = "\n\n".join(" ".join(p.read_text(errors="replace").split()) for p in files)
    offsets = encoder.tokenizer.encode_body([text])[0].offsets
    starts = [i + 2 for i in range(len(text) - 2) if text[i] == "." and text[i + 1] == " "]
    return text, offsets, starts


def probe(encoder, task: str, tokens: int, candidates: int, seed: int = 0, filler=None) -> Probe:
    """`candidates` documents of `tokens` tokens with a fact each, and their queries."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
    limit = len(NAMES) if task == "passkey" else len(NEEDLES)
    if not 1 <= candidates <= limit:
        raise ValueError(f"candidates: must be in [1, {limit}] for {task}, got {candidates}")
    text, offsets, starts = filler or haystack(encoder)
    rng = random.Random(f"{task}-{tokens}-{seed}")
    documents, queries = [], []
    for i in range(candidates):
        if task == "passkey":
            key = rng.randrange(10000, 100000)
            fact = f"{NAMES[i]}'s pass key is {key}. Remember it. {key} is the pass key for {NAMES[i]}."
            query = f"What is the pass key for {NAMES[i]}?"
        else:
            fact, query = NEEDLES[i]
        fact_tokens = encoder.count_tokens([fact])[0] - encoder.tokenizer.num_special_tokens
        body = tokens - encoder.tokenizer.num_special_tokens - fact_tokens - 1
        first = rng.randrange(0, len(offsets) - body)
        begin, end = offsets[first][0], offsets[first + body - 1][1]
        depth = begin + int((end - begin) * rng.uniform(0.1, 0.9))
        cut = min((s for s in starts if begin < s < end), key=lambda s: abs(s - depth), default=depth)
        documents.append(f"{text[begin:cut]}{fact} {text[cut:end]}")
        queries.append(query)
    return Probe(task, tokens, documents, queries)
