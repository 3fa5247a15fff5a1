"""The KV cache of a batch of rows in flight: the entry of position ``p`` of a row sits in
slot ``p`` of that row.

Rows are ragged (each has its own length) and a finished row's slot is reused by the next
row, so the cache never appends at a shared end as ``DynamicCache`` does.  Instead every
forward pass says, per row, which slots its tokens write (:meth:`SlotCache.step`), and the
attention mask (built by :mod:`pipeline.engine.runner` from the rows' positions) lets a
query at position ``p`` read slots ``<= p`` (and ``> p - W`` in a sliding-window layer).
Consequences:

- KV-cache rollback costs nothing: entries past a row's committed length are never read
  (the causal mask hides them) and are overwritten when that position is written again.
- A new row in a slot needs no clearing: the previous row's entries sit at positions the
  new row writes before it reads them.
- Padding never pollutes a row: padded tokens of a ragged batch write to one scratch slot
  past the end of the buffer, which no mask ever reaches.
- A token tree (:mod:`pipeline.engine.verify`) writes its nodes in the slots after the
  row's last token, in node order, at positions given by their depth; after verification
  the accepted path's entries are copied to the slots of their positions
  (:meth:`SlotCache.move`) and the rest are left to be overwritten, as after a rejection.

Memory: ``rows x heads x capacity x head_dim`` per layer for keys and for values, where
``capacity`` grows (doubling, capped by the model's context) to the longest row seen, so
it is bounded by ``max_batch_size x (longest prompt + max_new_tokens + k)`` (``k x num_candidates`` tree nodes instead of ``k`` with token trees) and stays flat
once reached.

transformers' model code calls :meth:`SlotCache.update` from every attention layer; the
cache needs nothing else from the models: they get explicit ``position_ids`` and a 4D
mask, except in a pass whose rows all feed the same number of tokens from position 0 (a
prefill), where SDPA's own causal kernel is faster and the model builds the mask from
:meth:`SlotCache.get_mask_sizes`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: smallest capacity (positions) a layer's buffer is allocated with
MIN_CAPACITY = 64


class SlotLayer(CacheLayerMixin):
    """Keys and values of one attention layer: ``(rows, heads, capacity + 1, head_dim)``,
    the last slot being the scratch slot for padding."""

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        rows, cap = self.owner.max_rows, max(self.owner.initial_capacity, self.owner.reserved)
        self.keys = key_states.new_zeros((rows, key_states.shape[1], cap + 1, key_states.shape[3]))
        self.values = value_states.new_zeros((rows, value_states.shape[1], cap + 1, value_states.shape[3]))
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] - 1

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        needed = max(needed, self.owner.reserved)
        if needed <= cap:
            return
        new_cap = max(needed, min(2 * cap, self.owner.max_capacity or 2 * cap))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], new_cap + 1, old.shape[3]))
            new[:, :, :cap] = old[:, :, :cap]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write this pass's ``(b, heads, q, head_dim)`` keys and values into their slots and
        return every row's ``(b, heads, kv_len, head_dim)`` (a view when the rows are the
        slots ``0 .. b-1``, a gathered copy otherwise)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.owner.current
        if step is None:
            raise RuntimeError("SlotCache.step() must be called before a forward pass")
        self._grow(step.kv_len)
        if step.single is not None:
            row, position = step.single
            self.keys[row, :, position].copy_(key_states[0, :, 0])
            self.values[row, :, position].copy_(value_states[0, :, 0])
            return self.keys[row: row + 1, :, : step.kv_len], self.values[row: row + 1, :, : step.kv_len]
        slots = step.slots(self.capacity)
        rows = step.rows.view(-1, 1)
        self.keys[rows, :, slots] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, slots] = value_states.transpose(1, 2).to(self.values.dtype)
        if step.first is not None:  # consecutive slots: a view, no copy
            rows = slice(step.first, step.first + step.rows.numel())
            return self.keys[rows, :, : step.kv_len], self.values[rows, :, : step.kv_len]
        return self.keys[step.rows, :, : step.kv_len], self.values[step.rows, :, : step.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, 0)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:  # rollback is free: see the module docstring
        pass


class _Step:
    """Where one forward pass writes: ``rows`` ``(b,)`` slot rows, ``write`` ``(b, q)`` the
    slot (= position) of each token, ``-1`` for padding, ``kv_len`` the slots read."""

    __slots__ = ("rows", "write", "kv_len", "first", "_slots", "single")

    def __init__(self, rows: torch.Tensor, write: torch.Tensor, kv_len: int, slots: list[int]):
        self.rows = rows
        self.write = write
        self.kv_len = kv_len
        self._slots: tuple[int, torch.Tensor] | None = None
        # the first slot when the rows are consecutive slots (their keys are then a view)
        consecutive = all(b == a + 1 for a, b in zip(slots, slots[1:]))
        self.first = slots[0] if consecutive else None
        # ``(slot row, position)`` of a pass of one token in all (a one-row decoding step): written
        # by a copy into that slot, where advanced indexing costs about 10 us per layer and tensor
        position = int(write.view(-1)[0]) if write.numel() == 1 else -1
        self.single = (slots[0], position) if position >= 0 else None

    def slots(self, capacity: int) -> torch.Tensor:
        """``write`` with padding sent to the scratch slot ``capacity`` (made once per pass,
        not once per layer)."""
        if self._slots is None or self._slots[0] != capacity:
            self._slots = (capacity, torch.where(self.write < 0, capacity, self.write))
        return self._slots[1]


class SlotCache(Cache):
    """A KV cache for up to ``max_rows`` rows, one slot per position (see the module docstring).

    Args:
        max_rows: rows in flight (the batch's ``max_batch_size``).
        max_capacity: the most positions a row can have (the model's context), or ``None``.
        initial_capacity: positions allocated at first use (grows as needed).
    """

    def __init__(self, max_rows: int, max_capacity: int | None = None, initial_capacity: int = MIN_CAPACITY):
        super().__init__(layers=[])
        self.max_rows = max_rows
        self.max_capacity = max_capacity
        self.initial_capacity = max(1, min(initial_capacity, max_capacity or initial_capacity))
        self.reserved = 0
        self.current: _Step | None = None

    def reserve(self, positions: int) -> None:
        """Make room for rows of up to ``positions`` positions at the next write (one
        allocation instead of repeated doubling), rounded up to a multiple of 64 and capped
        by ``max_capacity``."""
        positions = -(-positions // MIN_CAPACITY) * MIN_CAPACITY
        if self.max_capacity is not None:
            positions = min(positions, self.max_capacity)
        self.reserved = max(self.reserved, positions)

    def step(self, slots: list[int], write: torch.Tensor, kv_len: int) -> None:
        """Declare the next forward pass: ``slots`` the slot row of each batch row,
        ``write`` ``(b, q)`` int64 the position each input token writes (``-1``: padding),
        ``kv_len`` the positions its queries may read (max position + 1)."""
        rows = torch.tensor(slots, dtype=torch.long, device=write.device)
        self.current = _Step(rows, write, kv_len, list(slots))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions before this pass's queries, for a pass whose rows all start at the same
        position (the only passes that let the model build its own mask)."""
        return self.current.kv_len - self.current.write.shape[1] if self.current is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return (self.current.kv_len if self.current is not None else query_length), 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def move(self, slot: int, sources: list[int], targets: list[int]) -> None:
        """Copy the keys and values of positions ``sources`` of row ``slot`` to positions
        ``targets`` (every layer; all sources are read before any target is written).  After
        a token tree's verification the accepted path's nodes, written in the slots of their
        index in the tree, move to the slots of their positions, so that position ``p`` sits
        in slot ``p`` again."""
        if not sources:
            return
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            device = layer.keys.device
            src = torch.tensor(sources, dtype=torch.long, device=device)
            dst = torch.tensor(targets, dtype=torch.long, device=device)
            layer.keys[slot, :, dst] = layer.keys[slot, :, src]
            layer.values[slot, :, dst] = layer.values[slot, :, src]

    def nbytes(self) -> int:
        """Bytes held by the buffers (keys and values of every layer)."""
        return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                   for l in self.layers if l.is_initialized)
