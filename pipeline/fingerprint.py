"""The config fingerprint: everything that changes a run's outputs, recorded with every
committed shard and compared when a run resumes (see pipeline.output).

:func:`config_identity` is plain data:

- the resolved config sections that change outputs, whatever fields they hold
  (:data:`OUTPUT_SECTIONS`: ``models``, ``method``, ``generation``, ``task`` with its
  prompt template filled in and its chat template / system prompt settings), and the
  ``input:`` settings that change what a row's prompt or id is (:data:`INPUT_KEYS`: the
  text column, the id column, the format; not where the input lies); keys whose
  value is None (unset) are left out, so a field added later with a None default does
  not change the fingerprint of older outputs; the drafter is left out when the method
  does not use it, and so is a local model's path (its files identify it: the same
  checkpoint moved, or named by another relative path, is the same model).  No more than
  decides the output: of ``method:``, only the settings the method reads
  (:func:`method_fields`, from the method table); under greedy decoding, no sampling
  setting (:data:`SAMPLING_ONLY`: a new seed does not refuse a resume); stop strings,
  suppressed tokens, bad words and EOS ids as sets (a reordered stop list is the same);
  an ``input.format`` that names what ``auto`` takes for every file counts as ``auto``
  (``format_is_auto``, which :func:`pipeline.run.run_identity` works out from the shards);
- the identity of each model's files (:func:`model_files`): the SHA-256 of each file's
  whole content (config, generation config, tokenizer and chat-template files, remote
  code, weights), so a checkpoint edited in place (a tensor changed, same size and
  header) is told apart.  Hashing gigabytes once is a few seconds; it is done once per
  file version: :func:`content_hash` caches each hash in a per-user cache file
  (:func:`hash_cache_path`), keyed by the file's real path, size, modification and
  status-change times (ns) and inode, so a rerun reads nothing.  (Not beside the
  checkpoint: a model folder is often read-only or shared, and the job writes nothing it
  does not own.)  A copy of the same bytes is hashed once more and gets the same identity.
  A hub id is identified by its cached snapshot (revision and files), or by the id alone
  when it is not in the local cache;
- :data:`SCHEME`, the version of these rules: shards committed under older rules are
  refused with a message that says so (an older fingerprint cannot tell whether they
  match), not with a list of changes that did not happen.

:func:`config_fingerprint` is a short SHA-256 of that data; :func:`describe_changes` names the
keys that differ between two identities, for the refusal message.

:func:`reuse_identity` is the part of an identity that shapes a row's output when its prompt
token ids are given (a nightly run copies a previous row whose reuse key matches,
:mod:`pipeline.reuse`): the identity less the ``input:`` settings (the prompt ids and the
row's seed key stand for them), and, for a greedy lossless run, less the method and its
drafter (a lossless method's greedy output is plain greedy decoding's).  A sampled run keeps
them: the tokens a seed draws depend on how the method uses the random stream (the law does
not), and so does a lossy static ensemble (``assistant_ensemble_weight``), greedy or not.
:func:`reuse_fingerprint` is its hash.  :func:`model_and_tokenizer` is the target's files split
into its model and its tokenizer: what a persisted job-wide draft pool is keyed to.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from typing import Any

log = logging.getLogger("specbatch")

#: resolved config sections whose settings change what the job writes
OUTPUT_SECTIONS = ("models", "method", "generation", "task")
#: ``input:`` settings that change a row's prompt or id
INPUT_KEYS = ("format", "id_column", "text_column")
#: the version of the identity's rules (2: input settings and whole-file model hashes; 3: only
#: the settings the method and the decoding mode read, sets in canonical order, the format
#: ``auto`` takes counted as ``auto``)
SCHEME = 3

#: files of a model directory that do not change outputs
_IGNORED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".txt.bak")
_IGNORED_PREFIXES = (".", "LICENSE", "NOTICE", "README", "USE_POLICY")
_CHUNK = 8 * 2**20  # bytes read at a time when hashing


def config_identity(cfg: Any, generation: Any = None, format_is_auto: bool = False) -> dict[str, Any]:
    """What the outputs of a run with this :class:`pipeline.config.JobConfig` depend on (plain data).

    Args:
        generation: the resolved :class:`pipeline.engine.GenerationSettings` of the run (the
            checkpoint's defaults filled in): when they decode greedily, the sampling
            settings (:data:`SAMPLING_ONLY`) are left out; ``None``: only when the config
            itself sets ``do_sample: false``.
        format_is_auto: ``input.format`` names the format ``auto`` takes for every file of
            the run (:func:`pipeline.run.run_identity` tells): it counts as ``auto``.
    """
    resolved = cfg.resolved()
    ident: dict[str, Any] = {sec: _drop_none(resolved[sec]) for sec in OUTPUT_SECTIONS}
    ident["input"] = {k: resolved["input"][k] for k in INPUT_KEYS}
    ident["scheme"] = SCHEME
    ident["method"] = _method_identity(ident["method"])
    greedy = (generation.do_sample is False) if generation is not None else cfg.generation.do_sample is False
    ident["generation"] = _generation_identity(ident["generation"], greedy)
    if format_is_auto:
        ident["input"]["format"] = "auto"
    if not cfg.uses_drafter:
        ident["models"].pop("drafter", None)
    ident["model_files"] = {"target": model_files(cfg.models.target)}
    if cfg.uses_drafter and cfg.models.drafter:
        ident["model_files"]["drafter"] = model_files(cfg.models.drafter)
    for key, files in ident["model_files"].items():
        if "hub_id" not in files:  # a local model is its files, wherever they lie
            ident["models"].pop(key, None)
    return ident


#: generation settings that only sampling reads (greedy decoding is the argmax whatever they are)
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "seed")
#: generation settings that are sets: their order (and repeats) change nothing
_SETS = ("stop_strings", "suppress_tokens", "bad_words_ids", "eos_token_id")


def method_fields(name: str) -> frozenset[str]:
    """The SpeculationSettings fields method ``name`` reads: its
    :attr:`MethodSpec.reads <pipeline.engine.methods.MethodSpec.reads>`."""
    from pipeline.engine import METHODS

    spec = METHODS.get(name)
    return spec.reads if spec is not None else frozenset()


def _method_identity(section: dict[str, Any]) -> dict[str, Any]:
    """The method section less the settings the method does not read (another method's,
    kept in the config)."""
    used = method_fields(section.get("name"))
    return {k: v for k, v in section.items() if k == "name" or k in used}


def _generation_identity(section: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """The generation section with its set-valued settings in a canonical order, less the
    sampling settings when decoding is greedy."""
    out = {k: v for k, v in section.items() if not (greedy and k in SAMPLING_ONLY)}
    for k in _SETS:
        v = out.get(k)
        if isinstance(v, list):
            out[k] = sorted({json.dumps(x, sort_keys=True): x for x in v}.items())
            out[k] = [x for _, x in out[k]]
    return out


def config_fingerprint(identity: dict[str, Any]) -> str:
    """A 16-hex-digit SHA-256 of :func:`config_identity` (canonical JSON)."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: the method setting that makes a method lossy (static ensemble verification)
LOSSY_FIELDS = ("assistant_ensemble_weight",)


def reuse_identity(identity: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """What shapes a row's output besides its prompt token ids (and, sampling, its seed):
    ``identity`` (:func:`config_identity`) less ``input`` and, when ``greedy`` and the method
    is lossless (no :data:`LOSSY_FIELDS` set), less ``method`` and the drafter (its section
    key, its GGUF file and its files' hashes).  See the module docstring for why a sampled or
    lossy run keeps them.

    Args:
        identity: a run's :func:`config_identity`, or one a committed unit recorded.
        greedy: whether the run that asks decodes greedily (its resolved ``do_sample``).
    """
    out = {k: v for k, v in identity.items() if k != "input"}
    lossy = any((identity.get("method") or {}).get(f) is not None for f in LOSSY_FIELDS)
    if greedy and not lossy:
        out.pop("method", None)
        out["models"] = {k: v for k, v in (out.get("models") or {}).items() if k not in ("drafter", "drafter_gguf_file")}
        out["model_files"] = {k: v for k, v in (out.get("model_files") or {}).items() if k != "drafter"}
    return out


def reuse_fingerprint(identity: dict[str, Any], greedy: bool) -> str:
    """A 16-hex-digit SHA-256 of :func:`reuse_identity` (the first part of every row's reuse key)."""
    return config_fingerprint(reuse_identity(identity, greedy))


#: files of a model directory that make its tokenizer (the rest, less the chat template, make the model)
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "spiece", "sentencepiece")


def model_and_tokenizer(identity: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The target's identity split in two: ``{"model": ..., "tokenizer": ...}``, each a
    ``file name -> sha256`` of :func:`model_files` (a hub id and revision count as the model;
    a ``chat_template*`` file as neither: it shapes prompts, not what the token ids mean).
    What a job-wide draft pool of token ids is keyed to (:mod:`pipeline.reuse`).

    Args:
        identity: a run's :func:`config_identity`, or one a committed unit recorded.
    """
    files = (identity.get("model_files") or {}).get("target") or {}
    out: dict[str, dict[str, str]] = {"model": {}, "tokenizer": {}}
    for name, ident in files.items():
        if name.startswith("chat_template"):
            continue
        out["tokenizer" if name.startswith(TOKENIZER_FILES) or name.endswith(".tiktoken") else "model"][name] = ident
    return out


def model_files(path: str) -> dict[str, str]:
    """File name -> identity (``sha256:<hex>`` of its content) of the model at ``path`` (a
    local directory, a single file such as a GGUF, or a hub id)."""
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
    """``sha256:<hex>`` of the file's whole content (:func:`content_hash`, cached)."""
    return f"sha256:{content_hash(p)}"


def hash_cache_path() -> str:
    """The per-user cache of file hashes: ``$XDG_CACHE_HOME/specbatch/file-hashes.json``
    (default ``~/.cache/specbatch/file-hashes.json``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specbatch", "file-hashes.json")


_CACHE_LOCK = threading.Lock()
_MAX_CACHED = 20_000  # entries kept in the cache file (the most recently used)


def content_hash(p: str) -> str:
    """The SHA-256 (hex) of the file ``p``'s content, read once per file version: the hash
    is cached (:func:`hash_cache_path`) under the file's real path with its size,
    ``st_mtime_ns``, ``st_ctime_ns``, device and inode, and reused while all of them are
    unchanged (``st_ctime`` changes on every write and on any attempt to set the times
    back, so an edit that keeps the size and restores the mtime is still seen).  A cache
    that cannot be read or written only costs a rehash (logged once).

    Raises:
        OSError: the file cannot be read.
    """
    real = os.path.realpath(p)
    st = os.stat(real)
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "dev": st.st_dev,
           "ino": st.st_ino}
    with _CACHE_LOCK:
        cache = _load_cache()
        hit = cache.get(real)
        if isinstance(hit, dict) and all(hit.get(k) == v for k, v in key.items()) and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if os.stat(real).st_ctime_ns != st.st_ctime_ns:  # written while we read it: do not cache
        return digest
    with _CACHE_LOCK:
        cache = _load_cache()
        cache.pop(real, None)
        cache[real] = dict(key, sha256=digest)
        _save_cache(cache)
    return digest


def _load_cache() -> dict[str, Any]:
    try:
        with open(hash_cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once(f"the file-hash cache {hash_cache_path()} cannot be read ({type(e).__name__}: {e}): model files "
                   "are hashed again")
        return {}


def _save_cache(cache: dict[str, Any]) -> None:
    path = hash_cache_path()
    if len(cache) > _MAX_CACHED:
        for k in list(cache)[: len(cache) - _MAX_CACHED]:  # oldest first (insertion order)
            del cache[k]
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".file-hashes.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        _warn_once(f"the file-hash cache {path} cannot be written ({type(e).__name__}: {e}): model files are "
                   "hashed again on every run")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


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
    keys whose values differ (at most ``limit``, then a count); a section's ``name`` (the
    method, the task) first, then in key order."""
    if not old:
        return "the committed shards carry no config fingerprint (written by an older version)"
    if old.get("scheme") != new.get("scheme"):
        return ("the committed shards were fingerprinted by an older version of this job, whose fingerprint did "
                "not cover everything this one does (the input settings, the model files' whole content), so "
                "whether they match cannot be told")
    a, b = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(set(a) | set(b), key=lambda k: (not k.endswith(".name"), k)):
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
