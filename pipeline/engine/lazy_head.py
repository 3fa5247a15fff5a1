"""Greedy verification with the output layer evaluated only where it is needed.

A verification pass over ``B`` rows of width ``W`` runs the body of the target once over
every position, and the output layer (the LM head, ``V x H``) normally at all ``B x W``
positions.  Where the head is a large part of the model -- Gemma 3 270M's 262,144 x 640
head holds more weights than its 18 layers -- and a draft is rejected early, most of those
logits are never looked at: greedy verification reads position ``j`` of a row only if its
draft tokens ``1 .. j`` were all accepted.

:class:`LazyHead` evaluates the head stage by stage: stage ``s`` computes the logits of the
next ``chunk`` positions of every row still alive (all of its draft tokens so far accepted),
in one call, and a row leaves as soon as one of its draft tokens is rejected (its correction
token is the argmax there) or its bonus position is reached.  The body runs once, as
before; its last hidden states are taken at the head's input (the model is called with its
output layer swapped for one that records its input), and the head applied to them is the
model's own (``get_output_embeddings()`` and, where the config has one,
``final_logit_softcapping``).  :meth:`LazyHead.probe` checks on a real pass that this
reproduces the model's logits, and the engine uses the lazy head only if it does.

With ``chunk = 1`` it is position by position; with ``lazy_output_layer=True`` the engine
picks ``chunk`` from the measured head costs and acceptance (:func:`best_chunk`).  Greedy
outputs are those of the full head: the same argmax at every position that is evaluated
(in float32 up to rounding: the head runs over other numbers of positions).

Measured (the engine's ``lazy_output_layer`` docstring has the figures): on a CPU a head call
over a few positions costs about what one costs, so stopping early saves little and each
extra stage reads the head's weights again; it is off by default.
"""

from __future__ import annotations

import torch

from .runner import ModelRunner, text_config


class _Recorded(Exception):
    pass


class LazyHead:
    """The target's output layer, applied to the positions greedy verification reads.

    Args:
        runner: the target's :class:`ModelRunner`.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.model = runner.model
        self.head = self.model.get_output_embeddings()
        self.softcap = getattr(text_config(self.model), "final_logit_softcapping", None)

    def hidden(self, slots, tokens, starts, keep: int) -> torch.Tensor:
        """One target pass over the rows; returns ``(b, keep, H)``: the head's inputs at the
        last ``keep`` positions of every row (left-padded as the runner's passes are)."""
        head = self.head
        seen: dict[str, torch.Tensor] = {}

        def record(x: torch.Tensor) -> torch.Tensor:
            seen["h"] = x
            return x.new_zeros(x.shape[:-1] + (1,))  # what the model does after its head costs nothing

        head.forward = record
        try:
            self.runner.forward(slots, tokens, starts, logits_to_keep=keep)
        finally:
            del head.forward
        return seen["h"]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` hidden states -> ``(..., V)`` logits, as the model computes them."""
        out = self.head(hidden)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    @torch.inference_mode()
    def probe(self, slot: int = 0) -> bool:
        """Whether :meth:`hidden` + :meth:`logits` give the model's own logits, on a two-token
        pass at the start of ``slot`` (call it before rows occupy the slot: the pass writes
        positions 0 and 1 of its cache, which a row overwrites before reading them)."""
        tokens = [torch.tensor([0, 1], dtype=torch.long, device=self.runner.device)]
        try:
            full = self.runner.forward([slot], tokens, [0], logits_to_keep=2).logits
            lazy = self.logits(self.hidden([slot], tokens, [0], 2))
        except Exception:  # noqa: BLE001 - a model this does not fit keeps the full head
            return False
        return full.shape == lazy.shape and torch.equal(full, lazy)

    def verify(self, hidden: torch.Tensor, drafts: list[list[int]], chunk: int) -> list[tuple[int, list[int]]]:
        """Greedy verification of each row's draft from the pass's hidden states.

        Args:
            hidden: ``(b, keep, H)`` from :meth:`hidden`, ``keep = max draft + 1``.
            drafts: per row its draft token ids (``n_b <= keep - 1``).
            chunk: positions evaluated per stage (>= 1).

        Returns:
            Per row ``(evaluated, choices)``: the target's argmax at its positions
            ``0 .. evaluated - 1`` (position ``j`` predicts draft token ``j + 1``; position
            ``n_b`` is the bonus position), evaluated until its first rejected draft token or
            its bonus position; :func:`pipeline.engine.verify.greedy_accept` reads them as
            it reads a full row of choices.
        """
        keep = hidden.shape[1]
        choices: list[list[int]] = [[] for _ in drafts]
        alive = list(range(len(drafts)))
        while alive:
            rows, cols, owners = [], [], []
            for b in alive:
                n, done = len(drafts[b]), len(choices[b])
                for j in range(done, min(done + chunk, n + 1)):
                    rows.append(b)
                    cols.append(keep - n - 1 + j)
                    owners.append(b)
            picked = self.logits(hidden[rows, cols]).argmax(-1).tolist()
            for b, tok in zip(owners, picked):
                choices[b].append(tok)
            still = []
            for b in alive:
                n, c = len(drafts[b]), choices[b]
                rejected = any(c[j] != drafts[b][j] for j in range(min(len(c), n)))
                if not rejected and len(c) <= n:
                    still.append(b)
            alive = still
        return [(len(c), c) for c in choices]


def head_costs(lazy: LazyHead, largest: int, clock, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one head call over ``m`` positions, for ``m`` = 1, 2, 4, ... up to
    ``largest`` (random hidden states; after one warm-up call per size)."""
    import statistics

    h = text_config(lazy.model).hidden_size
    param = next(lazy.head.parameters())
    out: dict[int, float] = {}
    m = 1
    with torch.inference_mode():
        while True:
            x = torch.randn(m, h, dtype=param.dtype, device=param.device)
            samples = []
            for rep in range(repeats + 1):
                t0 = clock()
                lazy.logits(x).argmax(-1).tolist()
                if rep:
                    samples.append(clock() - t0)
            out[m] = statistics.median(samples)
            if m >= largest:
                return out
            m = min(2 * m, largest)


def best_chunk(reach: list[float], cost: dict[int, float], rows: int, keep: int) -> int:
    """The stage size with the least expected head time for ``rows`` rows of width ``keep``.

    Args:
        reach: ``A_1, A_2, ...``: the chance that a row's first ``j`` draft tokens are all
            accepted (the engine's pooled acceptance by position).
        cost: seconds of one head call by the number of positions it evaluates (measured;
            interpolated linearly between measured sizes, extended flat below and by the last
            slope above).
        rows, keep: the pass's rows and width.
    """
    sizes = sorted(cost)

    def t(m: int) -> float:
        if m <= sizes[0]:
            return cost[sizes[0]]
        for a, b in zip(sizes, sizes[1:]):
            if m <= b:
                return cost[a] + (cost[b] - cost[a]) * (m - a) / (b - a)
        a, b = sizes[-2:] if len(sizes) > 1 else (sizes[0], sizes[0])
        slope = (cost[b] - cost[a]) / (b - a) if b != a else 0.0
        return cost[b] + slope * (m - b)

    def expected(chunk: int) -> float:
        total, start = 0.0, 0
        while start < keep:
            alive = 1.0 if start == 0 else (reach[start - 1] if start - 1 < len(reach) else 0.0)
            if alive <= 0.0:
                break
            m = rows * alive * min(chunk, keep - start)
            total += t(max(1, round(m)))
            start += chunk
        return total

    return min(range(1, keep + 1), key=lambda c: (expected(c), -c))
