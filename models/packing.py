"""A batch of sequences laid end to end: the token-wise layers run on real tokens only.

An encoder's embeddings, projections, feed-forward blocks and norms treat every token alone,
so a batch of sequences of different lengths runs them on one (T, C) tensor of all the
batch's tokens, T = the sum of the lengths: no token of padding is ever computed. Only
attention needs the sequences apart. `Packed.attend` runs it per group of consecutive
sequences that share a length and an attention spec, each group as one (G, H, n, D) call
that is a view of the packed tensor; `pack` orders the sequences so that such groups are as
large as they can be, and `Packed.unsort` puts per-sequence results back in the caller's order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from kernels import AttentionSpec


@dataclass(frozen=True)
class Group:
    """Sequences `first` .. `first + count - 1` of the packed order: all `length` tokens long,
    all attending by `spec`; their tokens start at `start` in the packed tensor."""

    first: int
    count: int
    length: int
    start: int
    spec: AttentionSpec

    @property
    def stop(self) -> int:
        return self.start + self.count * self.length


@dataclass(frozen=True)
class Packed:
    """Where each sequence's tokens are in a packed (T, ...) tensor.

    lengths: tokens per sequence, in packed order; order: order[j] = the caller's index of
    packed sequence j; positions: (T,) long, each token's position in its own sequence;
    groups: the attention groups, covering the packed order in turn; check: None, or called
    by the attention layers between their stages (it may raise to stop the pass).
    """

    lengths: tuple[int, ...]
    order: tuple[int, ...]
    positions: Tensor
    groups: tuple[Group, ...]
    check: Callable[[], None] | None = None

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, attend: Callable[[Tensor, Tensor, Tensor, AttentionSpec], Tensor]
    ) -> Tensor:
        """Attention within each sequence. q, k: (T, H, D), v: (T, H, Dv) -> (T, H, Dv).

        attend(q, k, v, spec) runs one group: (G, H, n, D) views in, (G, H, n, Dv) out.
        """
        out = None
        for group in self.groups:
            def heads(t: Tensor) -> Tensor:
                return t[group.start : group.stop].view(group.count, group.length, *t.shape[1:]).transpose(1, 2)

            o = attend(heads(q), heads(k), heads(v), group.spec)  # (G, H, n, Dv)
            heads_, value_dim = o.shape[1], o.shape[3]
            if len(self.groups) == 1:
                return o.transpose(1, 2).reshape(q.shape[0], heads_, value_dim)
            if out is None:
                out = o.new_empty(q.shape[0], heads_, value_dim)
            out[group.start : group.stop].view(group.count, group.length, heads_, value_dim).copy_(o.transpose(1, 2))
        return out

    def per_sequence(self, table: Callable[[int], Tensor]) -> Tensor:
        """(T, ...): for each sequence of n tokens, the n rows of `table(n)` (a table that
        depends on the sequence's length, as dynamic NTK's RoPE angles do)."""
        tables = {n: table(n) for n in set(self.lengths)}
        return torch.cat([tables[n] for n in self.lengths])

    def keep(self, sequences: Sequence[int]) -> tuple[Packed, Tensor]:
        """The layout of these sequences alone (the caller's indices, ascending; renumbered
        0.. in that order) and the (T',) indices of their tokens in this layout's tensors."""
        renumber = {original: new for new, original in enumerate(sequences)}
        if len(renumber) != len(sequences) or not sequences:
            raise ValueError(f"sequences: distinct indices of this batch, at least one, got {list(sequences)}")
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n)
        kept = [j for j, original in enumerate(self.order) if original in renumber]
        specs = {j: group.spec for group in self.groups for j in range(group.first, group.first + group.count)}
        tokens = torch.cat([torch.arange(starts[j], starts[j + 1]) for j in kept]).to(self.positions.device)
        packed = _layout([self.lengths[j] for j in kept], [specs[j] for j in kept], [renumber[self.order[j]] for j in kept])
        return dataclasses.replace(packed, positions=packed.positions.to(self.positions.device), check=self.check), tokens

    def split(self, x: Tensor) -> list[Tensor]:
        """A packed (T, ...) tensor -> one (n_i, ...) view per sequence, in the caller's order."""
        parts = x.split(list(self.lengths))
        return self.unsort(list(parts))

    def unsort(self, items: Sequence) -> list:
        """Per-sequence items in packed order -> the caller's order."""
        result = [None] * len(items)
        for j, original in enumerate(self.order):
            result[original] = items[j]
        return result


def pack(
    sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], device: torch.device
) -> tuple[Tensor, Packed]:
    """Token ids of the sequences end to end, (T,) long on `device`, and their layout.

    Sequences with the same spec and length are placed next to each other, so that each
    such set is one attention call; otherwise the order is the caller's (stable).
    """
    if len(sequences) != len(specs) or not sequences:
        raise ValueError(
            f"sequences and specs: need one spec per sequence and at least one, got {len(sequences)} and {len(specs)}"
        )
    first_seen: dict[AttentionSpec, int] = {}
    for spec in specs:
        first_seen.setdefault(spec, len(first_seen))
    order = sorted(range(len(sequences)), key=lambda i: (first_seen[specs[i]], -len(sequences[i])))
    if min(len(sequences[i]) for i in order) < 1:
        raise ValueError("sequences: every sequence needs at least one token")
    packed = _layout([len(sequences[i]) for i in order], [specs[i] for i in order], order)
    ids = torch.tensor([t for i in order for t in sequences[i]], dtype=torch.long)
    return ids.to(device), dataclasses.replace(packed, positions=packed.positions.to(device))


def _layout(lengths: Sequence[int], specs: Sequence[AttentionSpec], order: Sequence[int]) -> Packed:
    """The layout of sequences already in packed order: consecutive ones of the same spec and
    length form a group."""
    groups: list[Group] = []
    start = 0
    for j, (n, spec) in enumerate(zip(lengths, specs)):
        last = groups[-1] if groups else None
        if last is not None and last.spec == spec and last.length == n:
            groups[-1] = Group(last.first, last.count + 1, n, last.start, spec)
        else:
            groups.append(Group(j, 1, n, start, spec))
        start += n
    positions = torch.cat([torch.arange(n) for n in lengths]) if len(lengths) > 1 else torch.arange(lengths[0])
    return Packed(tuple(lengths), tuple(order), positions, tuple(groups))
