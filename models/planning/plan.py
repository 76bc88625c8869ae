"""The plan of one embedding call: what each input runs, decided once, before anything runs.

    plan(checkpoint, inputs, spec, ...)
      -> prompt and task adapter    the one named, else the checkpoint's default (UnknownPrompt,
                                    UnknownAdapter)
      -> tokens                     prompt prepended, tokenized, checked, truncated or refused
                                    (models.planning.inputs' typed errors)
      -> attention per input        `kernels.resolve_auto` by the input's own length, with the
                                    checkpoint's calibration table for a target fidelity, and the
                                    exact-by-knobs shortcut
    Plan.batches(max_batch_tokens)  the inputs in packed batches, by the one rule `fits`

`Encoder.embed` runs a plan's batches itself; the service queues a plan's inputs on its
scheduler, which joins inputs of several requests into batches by the same `fits`. Either way
an input's attention is the one planned here, from its own length, so its vector does not
depend on what it is batched with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from clusterserve.kernels import AttentionSpec, FieldError, Resolved, resolve_auto
from clusterserve.models.prompts import NO_PROMPT, UnknownAdapter, UnknownPrompt

if TYPE_CHECKING:  # for annotations: planning reads a checkpoint's data, never the reverse
    from clusterserve.models.checkpoint import Checkpoint


@dataclass(frozen=True)
class PlannedInput:
    """One input as it will run: its token ids and its resolved attention."""

    ids: list[int]
    attention: Resolved

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def spec(self) -> AttentionSpec:
        return self.attention.spec


@dataclass(frozen=True)
class Plan:
    """A call's inputs in input order, the prompt and adapter they run with, and what was asked."""

    inputs: tuple[PlannedInput, ...]
    requested: AttentionSpec
    target_fidelity: float | None
    prompt_name: str | None  # the prompt prepended to the texts (None: none)
    adapter: str | None  # the task adapter that runs (None: the base weights)

    def batches(self, max_batch_tokens: int) -> list[list[int]]:
        """Input indices in packed batches: longest first, each batch filled while `fits`."""
        order = sorted(range(len(self.inputs)), key=lambda i: -self.inputs[i].tokens)
        batches: list[list[int]] = []
        used = 0
        for i in order:
            tokens = self.inputs[i].tokens
            if batches and fits(used, tokens, max_batch_tokens):
                batches[-1].append(i)
                used += tokens
            else:
                batches.append([i])
                used = tokens
        return batches

    def echo(self) -> dict[str, Any]:
        """What a response reports: the one resolved spec, or, where inputs resolved
        differently (auto over mixed lengths, or a method exact by its knobs for the short
        inputs only), the method asked for, what auto went by (threshold or target), and each
        input's resolved spec."""
        echoes = [planned.attention.echo for planned in self.inputs]
        if len({json.dumps(echo, sort_keys=True) for echo in echoes}) == 1:
            return echoes[0]
        if self.requested.method != "auto":
            return {"method": self.requested.method, "inputs": echoes}
        if self.target_fidelity is not None:
            rule: dict[str, Any] = {"target_fidelity": self.target_fidelity}
        else:
            rule = {"auto_threshold": self.requested.auto_threshold}
        return {"method": "auto", **rule, "inputs": echoes}


def fits(batch_tokens: int, tokens: int, max_batch_tokens: int) -> bool:
    """Whether an input of `tokens` tokens joins a packed batch that holds `batch_tokens` so
    far: the batch's real tokens stay within the budget (no padding is computed). An empty
    batch takes any input, so an input longer than the budget runs alone."""
    return batch_tokens == 0 or batch_tokens + tokens <= max_batch_tokens


def choose_prompt_and_adapter(
    checkpoint: Checkpoint, inputs: Sequence[Any], prompt_name: str | None = None, adapter: str | None = None
) -> tuple[str | None, str | None]:
    """The prompt the texts get and the task adapter that runs (None: none, the base weights).

    The prompt is Prompts.applied's: the one named, else the checkpoint's default prompt (or,
    where every text already starts with a prompt, theirs); NO_PROMPT and token-id inputs get
    none. The adapter is the one named, else the adapter named like the prompt in effect: Jina
    v3 names its prompts after its tasks, so `prompt_name="retrieval.query"` selects both.
    Raises UnknownPrompt or UnknownAdapter naming the ones the checkpoint has."""
    prompts, adapters = checkpoint.prompts, tuple(checkpoint.adapters)
    if prompt_name not in (None, NO_PROMPT) and prompt_name not in prompts.prompts:
        raise UnknownPrompt(prompt_name, tuple(prompts.prompts))
    if adapter is not None and adapter not in adapters:
        raise UnknownAdapter(adapter, adapters)
    texts = all(isinstance(one, str) for one in inputs)
    chosen = prompts.applied(prompt_name, inputs) if texts else None
    if adapter is not None:
        return chosen, adapter
    return chosen, chosen if chosen in adapters else None


def check_attention(spec: AttentionSpec, target_fidelity: float | None) -> None:
    """FieldError naming `spec` or `target_fidelity` unless they make a request (that a target
    goes with "auto" only is kernels.resolve_auto's rule)."""
    if not isinstance(spec, AttentionSpec):
        raise FieldError("spec", f"must be a kernels.AttentionSpec, got {type(spec).__name__}")
    if target_fidelity is not None:
        if isinstance(target_fidelity, bool) or not isinstance(target_fidelity, (int, float)) or not 0 < target_fidelity <= 1:
            raise FieldError("target_fidelity", f"must be a number in (0, 1], got {target_fidelity!r}")


def plan(
    checkpoint: Checkpoint, inputs: Sequence[str] | Sequence[Sequence[int]], spec: AttentionSpec, *,
    target_fidelity: float | None = None, truncate: bool = False, truncation_direction: str = "right",
    prompt_name: str | None = None, adapter: str | None = None,
) -> Plan:
    """Plan a call (see the module docstring). `spec` may be "auto": with `target_fidelity` it
    picks from `checkpoint.calibration` (the length threshold where the checkpoint has no table),
    without one by `spec.auto_threshold`. Raises the typed errors of models.planning.inputs,
    UnknownPrompt, UnknownAdapter, or ValueError naming a bad argument."""
    check_attention(spec, target_fidelity)
    chosen_prompt, chosen_adapter = choose_prompt_and_adapter(checkpoint, inputs, prompt_name, adapter)
    sequences = checkpoint.prepare(inputs, truncate, truncation_direction, prompt_name)
    table = checkpoint.calibration if target_fidelity is not None else None
    planned = tuple(
        PlannedInput(ids, resolve_auto(spec, len(ids), table, target_fidelity)) for ids in sequences
    )
    return Plan(planned, spec, target_fidelity, chosen_prompt, chosen_adapter)
