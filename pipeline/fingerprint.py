"""The config fingerprint: everything that changes a run's outputs, recorded with every
committed shard and compared when a run resumes (see pipeline.output).

:func:`config_identity` is plain data:

- the resolved config sections that change outputs, whatever fields they hold
  (:data:`OUTPUT_SECTIONS`: ``models``, ``method``, ``generation``, ``task`` with its
  prompt template filled in and its chat template / system prompt settings); keys whose
  value is None (unset) are left out, so a field added later with a None default does
  not change the fingerprint of older outputs; the drafter is left out when the method
  does not use it, and so is a local model's path (its files identify it: the same
  checkpoint moved, or named by another relative path, is the same model);
- the identity of each model's files (:func:`model_files`): a SHA-256 of every small file
  (config, generation config, tokenizer and chat-template files, remote code) and, for
  large files (weights), their size and a SHA-256 of three 1 MiB samples (start, middle,
  end: a safetensors header and some weights of the first, a middle and the last
  tensors), so a retrained or re-quantized checkpoint is told apart without reading
  gigabytes.  A hub id is identified by its cached snapshot (revision and files), or by
  the id alone when it is not in the local cache.

:func:`config_fingerprint` is a short SHA-256 of that data; :func:`describe_changes` names the
keys that differ between two identities, for the refusal message.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

#: resolved config sections whose settings change what the job writes
OUTPUT_SECTIONS = ("models", "method", "generation", "task")

#: files of a model directory that do not change outputs
_IGNORED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".txt.bak")
_IGNORED_PREFIXES = (".", "LICENSE", "NOTICE", "README", "USE_POLICY")
_WHOLE_FILE_LIMIT = 4 * 2**20  # bytes: hashed whole up to this size
_SAMPLE = 2**20  # bytes per sample of a larger file


def config_identity(cfg: Any) -> dict[str, Any]:
    """What the outputs of a run with this :class:`pipeline.config.JobConfig` depend on (plain data)."""
    resolved = cfg.resolved()
    ident: dict[str, Any] = {sec: _drop_none(resolved[sec]) for sec in OUTPUT_SECTIONS}
    if not cfg.uses_drafter:
        ident["models"].pop("drafter", None)
    ident["model_files"] = {"target": model_files(cfg.models.target)}
    if cfg.uses_drafter and cfg.models.drafter:
        ident["model_files"]["drafter"] = model_files(cfg.models.drafter)
    for key, files in ident["model_files"].items():
        if "hub_id" not in files:  # a local model is its files, wherever they lie
            ident["models"].pop(key, None)
    return ident


def config_fingerprint(identity: dict[str, Any]) -> str:
    """A 16-hex-digit SHA-256 of :func:`config_identity` (canonical JSON)."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_files(path: str) -> dict[str, str]:
    """File name -> identity (``sha256:...`` or ``size=N;sample-sha256:...``) of the model at
    ``path`` (a local directory, a single file such as a GGUF, or a hub id)."""
    local = os.path.expanduser(path)
    if os.path.isfile(local):
        return {os.path.basename(local): file_identity(local)}
    if os.path.isdir(local):
        return _dir_identity(local)
    snapshot = _cached_snapshot(path)
    if snapshot is None:
        return {"hub_id": path, "revision": "unknown (not in the local cache)"}
    return {"hub_id": path, "revision": os.path.basename(snapshot), **_dir_identity(snapshot)}


def _dir_identity(d: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if not os.path.isfile(p) or name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
            continue
        out[name] = file_identity(p)
    return out


def file_identity(p: str) -> str:
    """``sha256:<hex>`` of a small file, ``size=N;sample-sha256:<hex>`` of a large one (three
    1 MiB samples: start, middle, end)."""
    size = os.path.getsize(p)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        if size <= _WHOLE_FILE_LIMIT:
            h.update(f.read())
            return f"sha256:{h.hexdigest()}"
        for offset in (0, size // 2 - _SAMPLE // 2, size - _SAMPLE):
            f.seek(offset)
            h.update(f.read(_SAMPLE))
    return f"size={size};sample-sha256:{h.hexdigest()}"


def _cached_snapshot(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, no hub library
        return None
    return os.path.dirname(hit) if isinstance(hit, str) else None


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def describe_changes(old: dict[str, Any] | None, new: dict[str, Any], limit: int = 6) -> str:
    """``"method.name: 'plain' -> 'draft_model'; generation.max_new_tokens: 4 -> 8"``: the
    keys whose values differ (at most ``limit``, then a count)."""
    if not old:
        return "the committed shards carry no config fingerprint (written by an older version)"
    a, b = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if va == vb:
            continue
        if key.startswith("model_files.") and isinstance(va, dict) and isinstance(vb, dict):
            files = sorted(f for f in set(va) | set(vb) if va.get(f) != vb.get(f))
            changes.append(f"{key}: files changed: {', '.join(files)}")
        elif key.startswith("model_files."):
            changes.append(f"{key}: {'(unset)' if va is _MISSING else 'files'} -> {'(unset)' if vb is _MISSING else 'files'}")
        else:
            changes.append(f"{key}: {_show(va)} -> {_show(vb)}")
    if not changes:
        return "the config fingerprint differs"
    more = f"; and {len(changes) - limit} more" if len(changes) > limit else ""
    return "; ".join(changes[:limit]) + more


_MISSING = object()


def _show(v: Any) -> str:
    if v is _MISSING:
        return "(unset)"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and prefix != "model_files.":  # one entry per model
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
