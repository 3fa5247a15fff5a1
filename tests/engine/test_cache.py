"""The slot cache (pipeline/engine/cache.py) on its own: a pass of one token in all writes by a
copy into its slot, every other pass by advanced indexing; both leave the same buffers and
return the same keys and values."""

from __future__ import annotations

import torch

from pipeline.engine.cache import SlotCache


def _write(passes, single: bool):
    cache, out, taken = SlotCache(3), [], []
    for slots, write, kv_len, k, v in passes:
        cache.step(slots, torch.tensor(write), kv_len)
        taken.append(cache.current.single is not None)
        if not single:
            cache.current.single = None  # the advanced-indexing path
        out.append(tuple(t.clone() for t in cache.update(k, v, 0)))
    return cache.layers[0], out, taken


def test_one_token_passes_write_what_the_general_path_writes():
    g = torch.Generator().manual_seed(0)

    def kv(b, q):
        return torch.randn(b, 2, q, 4, generator=g), torch.randn(b, 2, q, 4, generator=g)

    passes = [([0, 1], [[0, 1, 2], [0, 1, -1]], 3, *kv(2, 3)),  # a ragged prefill, padding to the scratch slot
              ([1], [[2]], 3, *kv(1, 1)),  # one token, slot row 1
              ([0], [[3]], 4, *kv(1, 1)),
              ([2], [[0]], 1, *kv(1, 1)),  # a new row in slot row 2
              ([1], [[-1]], 3, *kv(1, 1)),  # one padding token
              ([0, 2], [[4], [1]], 5, *kv(2, 1))]  # two rows
    fast, got, taken = _write(passes, True)
    slow, want, _ = _write(passes, False)
    assert taken == [False, True, True, True, False, False]
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert torch.equal(fast.keys, slow.keys) and torch.equal(fast.values, slow.values)
    assert torch.equal(fast.keys[1, :, 2], passes[1][3][0, :, 0])  # position 2 of slot row 1
