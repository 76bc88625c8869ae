"""Prompts as sentence-transformers defines them: `prompts` (name -> text prepended to the
input) and `default_prompt_name` in a checkpoint's config_sentence_transformers.json, e.g.
nomic-embed-text's {"query": "search_query: ", "document": "search_document: "}.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from clusterserve.kernels import FieldError

# The prompt_name that asks for no prompt, whatever the checkpoint's default: each text is
# embedded exactly as written (as Ollama embeds it).
NO_PROMPT = ""


class UnknownPrompt(FieldError):
    """`name` is not one of the checkpoint's prompts."""

    def __init__(self, name: str, known: tuple[str, ...]):
        listed = ", ".join(known) if known else "none: this checkpoint defines no prompts"
        super().__init__("prompt_name", f"unknown prompt {name!r}; known: {listed}")
        self.name = name


class UnknownAdapter(FieldError):
    """`name` is not one of the checkpoint's task adapters (which a prompt's name may also
    select: Jina v3 names its prompts after its tasks)."""

    def __init__(self, name: str, known: tuple[str, ...]):
        listed = ", ".join(known) if known else "none: this checkpoint has no task adapters"
        super().__init__("adapter", f"unknown adapter {name!r}; known: {listed}")
        self.name = name


@dataclass(frozen=True)
class Prompts:
    prompts: dict[str, str] = field(default_factory=dict)
    default_name: str | None = None

    def text(self, name: str | None) -> str:
        """The text to prepend for prompt `name` (None: the default prompt, or none; NO_PROMPT: none)."""
        if name == NO_PROMPT:
            return ""
        if name is None:
            return self.prompts[self.default_name] if self.default_name else ""
        if name not in self.prompts:
            raise UnknownPrompt(name, tuple(self.prompts))
        return self.prompts[name]

    def prepend(self, name: str | None, text: str) -> str:
        """`text` with prompt `name` in front. The default prompt (name None) is not added to a
        text that already starts with one of the prompts: a nomic user who writes
        "search_query: ..." as its model card says gets that text embedded as written."""
        if name is None and self.written(text) is not None:
            return text
        return self.text(name) + text

    def applied(self, name: str | None, texts: Iterable[str]) -> str | None:
        """The name of the prompt `texts` get from prepend(name, ...): `name`, none for
        NO_PROMPT; for the default (None), the default where it goes in front of any text, else
        the prompt they all already start with, or none where they start with different ones."""
        if name is not None or self.default_name is None:
            return name or None
        written = {self.written(text) for text in texts}
        if None in written:
            return self.default_name
        return written.pop() if len(written) == 1 else None

    def written(self, text: str) -> str | None:
        """The name of the prompt `text` already starts with (the longest, where one prompt
        starts another), else None."""
        names = [name for name, prompt in self.prompts.items() if prompt and text.startswith(prompt)]
        return max(names, key=lambda name: len(self.prompts[name])) if names else None


def read_prompts(folder: Path | None) -> Prompts:
    """Prompts of a sentence-transformers folder; none without config_sentence_transformers.json."""
    path = None if folder is None else folder / "config_sentence_transformers.json"
    if path is None or not path.is_file():
        return Prompts()
    raw = json.loads(path.read_text(encoding="utf-8"))
    prompts = raw.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{path}: prompts must map names to strings, got {prompts!r}")
    default = raw.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ValueError(f"{path}: default_prompt_name {default!r} is not one of the prompts {list(prompts)}")
    return Prompts(dict(prompts), default)
