"""Schemathesis hooks (`make fuzz`): the relations between request fields that the OpenAPI
document cannot state, so that schema-valid data the fuzzer makes keeps them too.

JSON Schema bounds each field on its own; it cannot say that one field is below another. The
server answers a body that breaks one of these with 422 naming the field (docs/http.md):
- `chunking.overlap` below `chunking.size` (256 when left out);
- with `"late": false`, a chunk and its special and prompt tokens within the model's length
  limit (at least 512 tokens for every model served);
- `chunking.window` above its special and prompt tokens (at most FRAMING here), and
  `chunking.window_overlap` below the window's room for text: the window (the model's length
  limit when left out, at least 512 tokens for every model served) less those tokens.
"""

from __future__ import annotations

from typing import Any

try:  # the hooks need schemathesis (make fuzz); the rules themselves are tested without it
    import schemathesis
except ImportError:
    schemathesis = None

DEFAULT_SIZE = 256  # models.planning.chunking.ChunkingSpec.size
SMALLEST_DEFAULT_WINDOW = 512  # the shortest length limit of a model served (all-MiniLM-L6-v2)
FRAMING = 16  # special tokens and the longest shipped prompt, in tokens, with room to spare


def keeps_cross_field_rules(body: Any) -> bool:
    """Whether a request body keeps the chunking relations (True for any other body)."""
    chunking = body.get("chunking") if isinstance(body, dict) else None
    if not isinstance(chunking, dict):
        return True
    size, overlap = chunking.get("size"), chunking.get("overlap")
    size = size if isinstance(size, (int, float)) else DEFAULT_SIZE
    if isinstance(overlap, (int, float)) and overlap >= size:
        return False
    if chunking.get("late") is False and size > SMALLEST_DEFAULT_WINDOW - FRAMING:
        return False
    window, window_overlap = chunking.get("window"), chunking.get("window_overlap")
    if isinstance(window, (int, float)) and window <= FRAMING:
        return False
    room = (window if isinstance(window, (int, float)) else SMALLEST_DEFAULT_WINDOW) - FRAMING
    return not (isinstance(window_overlap, (int, float)) and window_overlap >= room)


if schemathesis is not None:

    @schemathesis.hook
    def filter_body(context: Any, body: Any) -> bool:
        return keeps_cross_field_rules(body)
