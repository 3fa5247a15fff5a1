"""A new decoding method in one file, as a contributor would add one: its proposer and its
``build`` factory.  ``SPEC`` is the one line the method table (``METHODS`` in
``pipeline/engine/proposers/__init__.py``) would get; :func:`register` adds that line at run
time, in every process that decodes (the test adds it in the driver and in the job's actors).

``repeat_last`` drafts ``k`` copies of the row's last committed token: cheap, often wrong,
and lossless like every method (verification keeps only what the target would emit).
"""

from __future__ import annotations

from pipeline.engine.methods import MethodSpec
from pipeline.engine.proposers.base import Draft, NoState


class RepeatLastProposer(NoState):
    def propose(self, requests):
        return [Draft(r.sequence[0, -1:].repeat(r.k)) for r in requests]


def build(inputs) -> RepeatLastProposer:
    return RepeatLastProposer()


SPEC = MethodSpec("repeat_last", build, RepeatLastProposer, tune_k_max=3)


def register() -> None:
    """Add :data:`SPEC` to the method table (the registry line), once per process."""
    from pipeline.engine import METHODS

    METHODS.setdefault(SPEC.name, SPEC)


# ---------------------------------------------------------------------------- a drafter of its own format
class FixedTokenProposer(NoState):
    """Drafts ``k`` copies of the token its "head" names (a drafter that is no causal LM)."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, requests):
        return [Draft(r.sequence.new_full((r.k,), self.token)) for r in requests]


def check_head(path: str, target_config) -> dict:
    """The driver's check of ``<path>/head.json`` (``{"token": id}``) against the target."""
    import json
    import os

    file = os.path.join(path, "head.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} holds no head.json")
    with open(file) as f:
        head = json.load(f)
    vocab = target_config.get_text_config().vocab_size
    if not 0 <= head.get("token", -1) < vocab:
        raise ValueError(f"the head's token {head.get('token')} is outside the target's vocabulary ({vocab})")
    return head


def load_head(path: str, target) -> dict:
    return check_head(path, target.config)


def build_fixed(inputs) -> FixedTokenProposer:
    if not isinstance(inputs.drafter, dict):
        raise ValueError("method 'fixed_token' drafts with its head (models.drafter: a folder with head.json)")
    return FixedTokenProposer(inputs.drafter["token"])


HEAD_SPEC = MethodSpec("fixed_token", build_fixed, FixedTokenProposer, needs_drafter=True, check_drafter=check_head,
                       load_drafter=load_head)
