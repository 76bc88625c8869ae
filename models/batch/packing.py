"""A batch of sequences laid end to end: the token-wise layers run on real tokens only.

An encoder's embeddings, projections, feed-forward blocks and norms treat every token alone,
so a batch of sequences of different lengths runs them on one (T, C) tensor of all the
batch's tokens, T = the sum of the lengths: no token of padding is ever computed. Only
attention needs the sequences apart. `Packed.attend` runs it per group of consecutive
sequences that share a length and an attention spec, each group as one (G, H, n, D) call
that is a view of the packed tensor; `pack` orders the sequences so that such groups are as
large as they can be, and `Packed.unsort` puts per-sequence results back in the caller's order.

For CUDA graphs (models.runtime.graphs), which replay fixed shapes, `pack` can instead give each
sequence a slot of its length bucket (`bucket_length`: under 1/16 of a slot is padding).
The padded rows follow their sequence's real tokens; attention masks them
(`key_padding_mask`: they get no weight and their outputs are 0), and `parts`, `split` and
pooling leave them out, so every sequence's result is the one it gets unpadded, within
rounding. A group is then the sequences of one slot length and one spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec

# Lengths up to twice this are their own bucket; above, each doubling is cut into this many.
BUCKET_STEPS = 16


def bucket_length(n: int) -> int:
    """The slot a sequence of n tokens is padded to: n itself up to 2 * BUCKET_STEPS, else n
    rounded up to a multiple of 2^k / BUCKET_STEPS, 2^k < n <= 2^(k+1), so that padding is
    under 1 / BUCKET_STEPS of the slot (16 buckets per doubling: 6.25%). Monotone and
    idempotent; 208 buckets up to 65536 tokens."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: must be a positive integer, got {n!r}")
    if n <= 2 * BUCKET_STEPS:
        return n
    step = (1 << ((n - 1).bit_length() - 1)) // BUCKET_STEPS  # 2^k / BUCKET_STEPS
    return -(-n // step) * step


@dataclass(frozen=True)
class Group:
    """Sequences `first` .. `first + count - 1` of the packed order: each `length` rows long
    (its slot: its tokens, then any padding), all attending by `spec`; their rows start at
    `start` in the packed tensor. padded: whether any of them has padding rows (attention then
    takes a key mask; a group that fills its slots runs without one, on exact attention's
    unmasked flash kernel)."""

    first: int
    count: int
    length: int
    start: int
    spec: AttentionSpec
    padded: bool = False

    @property
    def stop(self) -> int:
        return self.start + self.count * self.length


@dataclass(frozen=True)
class Packed:
    """Where each sequence's tokens are in a packed (T, ...) tensor.

    lengths: tokens per sequence, in packed order; order: order[j] = the caller's index of
    packed sequence j; positions: (T,) long, each token's position in its own sequence (0 on
    padding); groups: the attention groups, covering the packed order in turn; check: None,
    or called by the attention layers between their stages (it may raise to stop the pass);
    slots: rows per sequence, its tokens then its padding (None: no padding, the lengths);
    real: None unpadded, else (T,) bool, True on real tokens.
    """

    lengths: tuple[int, ...]
    order: tuple[int, ...]
    positions: Tensor
    groups: tuple[Group, ...]
    check: Callable[[], None] | None = None
    slots: tuple[int, ...] | None = None
    real: Tensor | None = None

    @property
    def tokens(self) -> int:
        """Real tokens."""
        return sum(self.lengths)

    @property
    def rows(self) -> tuple[int, ...]:
        """Rows per sequence in the packed tensor: its slot, or its length unpadded."""
        return self.lengths if self.slots is None else self.slots

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, attend: Callable[[Tensor, Tensor, Tensor, AttentionSpec], Tensor]
    ) -> Tensor:
        """Attention within each sequence. q, k: (T, H, D), v: (T, H, Dv) -> (T, H, Dv).

        attend(q, k, v, spec, mask) runs one group: (G, H, n, D) views in, (G, H, n, Dv) out;
        mask: None where the group has no padding, else its (G, n) key_padding_mask (True = real token).
        """
        out = None
        for group in self.groups:
            def heads(t: Tensor) -> Tensor:
                return t[group.start : group.stop].view(group.count, group.length, *t.shape[1:]).transpose(1, 2)

            mask = None if not group.padded else self.real[group.start : group.stop].view(group.count, group.length)
            o = attend(heads(q), heads(k), heads(v), group.spec, mask)  # (G, H, n, Dv)
            heads_, value_dim = o.shape[1], o.shape[3]
            if len(self.groups) == 1:
                return o.transpose(1, 2).reshape(q.shape[0], heads_, value_dim)
            if out is None:
                out = o.new_empty(q.shape[0], heads_, value_dim)
            out[group.start : group.stop].view(group.count, group.length, heads_, value_dim).copy_(o.transpose(1, 2))
        return out

    def per_sequence(self, table: Callable[[int], Tensor]) -> Tensor:
        """(T, ...): for each sequence of n tokens, the n rows of `table(n)` (a table that
        depends on the sequence's length, as dynamic NTK's RoPE angles do); a padded row
        gets its sequence's row 0."""
        tables = {n: table(n) for n in set(self.lengths)}
        if self.slots is None:
            return torch.cat([tables[n] for n in self.lengths])
        parts = []
        for n, slot in zip(self.lengths, self.slots):
            parts.append(tables[n])
            if slot > n:
                parts.append(tables[n][:1].expand(slot - n, *tables[n].shape[1:]))
        return torch.cat(parts)

    def keep(self, sequences: Sequence[int]) -> tuple[Packed, Tensor]:
        """The layout of these sequences alone (the caller's indices, ascending; renumbered
        0.. in that order) and the (T',) indices of their rows in this layout's tensors.
        Each kept sequence keeps its slot."""
        renumber = {original: new for new, original in enumerate(sequences)}
        if len(renumber) != len(sequences) or not sequences:
            raise ValueError(f"sequences: distinct indices of this batch, at least one, got {list(sequences)}")
        starts = [0]
        for n in self.rows:
            starts.append(starts[-1] + n)
        kept = [j for j, original in enumerate(self.order) if original in renumber]
        specs = {j: group.spec for group in self.groups for j in range(group.first, group.first + group.count)}
        tokens = torch.cat([torch.arange(starts[j], starts[j + 1]) for j in kept]).to(self.positions.device)
        packed = _layout(
            [self.lengths[j] for j in kept], [specs[j] for j in kept], [renumber[self.order[j]] for j in kept],
            None if self.slots is None else [self.slots[j] for j in kept],
        )
        return _on(packed, self.positions.device, check=self.check), tokens

    def parts(self, x: Tensor) -> list[Tensor]:
        """A packed (T, ...) tensor -> each sequence's (n_i, ...) real rows, in packed order."""
        parts = x.split(list(self.rows))
        if self.slots is None:
            return list(parts)
        return [part[:n] for part, n in zip(parts, self.lengths)]

    def split(self, x: Tensor) -> list[Tensor]:
        """A packed (T, ...) tensor -> one (n_i, ...) view per sequence, in the caller's order."""
        return self.unsort(self.parts(x))

    def unsort(self, items: Sequence) -> list:
        """Per-sequence items in packed order -> the caller's order."""
        result = [None] * len(items)
        for j, original in enumerate(self.order):
            result[original] = items[j]
        return result


def pack(
    sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], device: torch.device,
    slot: Callable[[int], int] | None = None, pad_id: int = 0,
) -> tuple[Tensor, Packed]:
    """Token ids of the sequences end to end, (T,) long on `device`, and their layout.

    Sequences with the same spec and length are placed next to each other, so that each
    such set is one attention call; otherwise the order is the caller's (stable).
    slot: None packs the real tokens only; else slot(n) >= n is the rows a sequence of n
    tokens takes (e.g. `bucket_length`), its last slot(n) - n rows padding of id `pad_id`,
    and sequences of one slot length and spec form a group.
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
    lengths = [len(sequences[i]) for i in order]
    slots = None if slot is None else [slot(n) for n in lengths]
    if slots is not None and any(s < n for s, n in zip(slots, lengths)):
        raise ValueError(f"slot: must give at least n rows to a sequence of n tokens, got {slots} for {lengths}")
    packed = _layout(lengths, [specs[i] for i in order], order, slots)
    if slots is None:
        ids = torch.tensor([t for i in order for t in sequences[i]], dtype=torch.long)
    else:
        ids = torch.tensor([t for j, i in enumerate(order) for t in (*sequences[i], *[pad_id] * (slots[j] - lengths[j]))],
                           dtype=torch.long)  # fmt: skip
    return ids.to(device), _on(packed, device)


def _layout(
    lengths: Sequence[int], specs: Sequence[AttentionSpec], order: Sequence[int], slots: Sequence[int] | None = None
) -> Packed:
    """The layout of sequences already in packed order (on the CPU): consecutive ones of the
    same spec and slot length form a group."""
    rows = lengths if slots is None else slots
    groups: list[Group] = []
    start = 0
    for j, (n, spec) in enumerate(zip(rows, specs)):
        last = groups[-1] if groups else None
        padded = n > lengths[j]
        if last is not None and last.spec == spec and last.length == n:
            groups[-1] = Group(last.first, last.count + 1, n, last.start, spec, last.padded or padded)
        else:
            groups.append(Group(j, 1, n, start, spec, padded))
        start += n
    if slots is None:
        positions = torch.cat([torch.arange(n) for n in lengths]) if len(lengths) > 1 else torch.arange(lengths[0])
        return Packed(tuple(lengths), tuple(order), positions, tuple(groups))
    positions = torch.cat([torch.cat([torch.arange(n), torch.zeros(s - n, dtype=torch.long)]) for n, s in zip(lengths, slots)])
    real = torch.cat([torch.arange(s) < n for n, s in zip(lengths, slots)])
    return Packed(tuple(lengths), tuple(order), positions, tuple(groups), slots=tuple(slots), real=real)


def _on(packed: Packed, device: torch.device, **changes) -> Packed:
    """The layout with its tensors on `device`."""
    real = None if packed.real is None else packed.real.to(device)
    return dataclasses.replace(packed, positions=packed.positions.to(device), real=real, **changes)
