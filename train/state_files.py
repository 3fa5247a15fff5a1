"""Training states and caches as safetensors plus JSON: nothing the training reads is a pickle.

A pickle (``torch.save``'s format) runs code when it is loaded, and a job loads what lies
in the folders it is given (``--output``, a work folder): a file planted there would run.
So a state is one ``.safetensors`` file: its tensors in the safetensors body, everything
else (numbers, strings, lists, dicts, the tensors' places in the tree) as JSON in the
header's metadata under :data:`TREE_KEY`.  One file, written through a temporary name and
an atomic rename, so a killed save leaves the previous state whole.

:func:`load_state` reads only that format (``safetensors.safe_open`` and ``json.loads``,
neither of which runs code); anything else, a pickle included, raises
:class:`StateFileError` naming the file.  :func:`refuse_pickled` names the pickled states
an older version left (``train_state.pt``...), which are never read.
"""

from __future__ import annotations

import json
import os

#: the metadata key of the JSON tree in a state's safetensors header
TREE_KEY = "specbatch.state"
#: the format's version, in the metadata (a state of another version is refused)
FORMAT = "specbatch-state/1"


class StateFileError(ValueError):
    """A training state or cache that is not a safetensors + JSON state of this format
    (a pickle, a truncated or foreign file); the message names the file."""


def _encode(obj, tensors: dict):
    import torch

    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()  # clone: safetensors refuses shared storage
        return {"$tensor": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        for k in obj:  # int keys (an optimizer's state) keep their type
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"a state's dict key must be a str or an int, got {type(k).__name__}")
        return {"$items": [[k, _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"a state holds tensors, numbers, strings, lists and dicts, not {type(obj).__name__}")


def _decode(node, tensors: dict):
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if set(node) == {"$tensor"}:
            return tensors[node["$tensor"]]
        if set(node) == {"$items"}:
            return {k: _decode(v, tensors) for k, v in node["$items"]}
        return {k: _decode(v, tensors) for k, v in node.items()}
    return node


def save_state(path: str | os.PathLike, state) -> None:
    """Write ``state`` (tensors, numbers, strings, lists, tuples, dicts with str or int
    keys, nested) to ``path`` as safetensors + JSON, through ``<path>.tmp`` and an atomic
    rename.  Tuples come back as lists.

    Raises:
        TypeError: a value of another type (nothing is written).
    """
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = _encode(state, tensors)
    meta = {TREE_KEY: json.dumps(tree), "format": FORMAT}
    path = os.fspath(path)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def load_state(path: str | os.PathLike):
    """Read a state :func:`save_state` wrote; tensors on the CPU, dtypes as saved.

    Raises:
        StateFileError: ``path`` is not such a state (a pickle, a truncated file, another
            format or version); its message names ``path``.  Nothing in it is run.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError and OSError
        raise StateFileError(f"{path!r} is not a training state in safetensors + JSON ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}); it is never loaded any other way (a pickle "
                             "can run code): delete it to start afresh") from None
    if meta.get("format") != FORMAT or TREE_KEY not in meta:
        raise StateFileError(f"{path!r} is a safetensors file but not a training state of format {FORMAT!r}: "
                             "delete it to start afresh")
    try:
        return _decode(json.loads(meta[TREE_KEY]), tensors)
    except (ValueError, KeyError, TypeError) as e:
        raise StateFileError(f"{path!r}: its state tree does not decode ({type(e).__name__}: {e}): delete it "
                             "to start afresh") from None


def refuse_pickled(folder: str | os.PathLike, names) -> None:
    """Raise :class:`StateFileError` when ``folder`` holds one of ``names`` (the pickled
    states an older version wrote); the file is named and never opened."""
    found = [n for n in names if os.path.exists(os.path.join(os.fspath(folder), n))]
    if found:
        raise StateFileError(f"{os.path.join(os.fspath(folder), found[0])!r} is a pickled training state an older "
                             "version wrote; it is never loaded (a pickle can run code) and states are now "
                             "safetensors + JSON: delete it to start afresh")
