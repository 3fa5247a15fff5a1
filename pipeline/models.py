"""Model paths: checked in the driver (cheap, no weights), loaded in the actors.

:func:`check_models` reads only each model's ``config.json`` and the target's tokenizer,
so a wrong path fails the job before Ray starts any actor.  :func:`load_models` loads
the weights, on ``cuda`` when the process sees a GPU, else on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeline.config import JobRefused, ModelsConfig
from pipeline.paths import looks_local


class ModelError(JobRefused):
    """A model path does not exist, holds no loadable config/tokenizer/GGUF file, is not a
    causal LM, or the drafter does not fit the target."""


GGUF_MAGIC = b"GGUF"
#: weight files that are pickles (``pytorch_model.bin``, ``*.pt``...): loading one can run code, so they are refused
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def model_ref(path: str, gguf_file: str | None = None) -> str:
    """How a model is named in outputs: its path, or ``path/file.gguf`` for a GGUF checkpoint."""
    return path if not gguf_file else path.rstrip("/") + "/" + gguf_file


def _check_gguf_file(folder: str, gguf_file: str, key: str, gguf_key: str) -> None:
    """A local GGUF file: it exists and starts with the GGUF magic (cheap: reads 4 bytes)."""
    full = os.path.join(folder, gguf_file)
    if not os.path.isfile(full):
        raise ModelError(f"{gguf_key}: GGUF file {gguf_file!r} not found in {key} {folder!r} (looked for {full!r})")
    try:
        with open(full, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"{gguf_key}: cannot read {full!r}: {e}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"{gguf_key}: {full!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def _gguf_error(e: Exception, gguf_file: str, gguf_key: str) -> ModelError:
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, ImportError) or "gguf" in text.lower() and "install" in text.lower():
        return ModelError(f"{gguf_key}: loading {gguf_file!r} needs the gguf package (pip install gguf): {text}")
    return ModelError(f"{gguf_key}: {gguf_file!r} is not a readable GGUF checkpoint: {type(e).__name__}: {text}")


def refuse_special_files(folder: str, key: str) -> None:
    """Refuse a model folder holding a named pipe, a device or a socket (following links,
    :func:`pipeline.storage.refuse_special`): the fingerprint's hash, or transformers'
    loader, would read it and may never return.  A dangling link is left to the loader.

    Raises:
        ModelError: naming ``key`` and the file.
    """
    from pipeline.storage import refuse_special

    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            refuse_special(p, f"{key}: {p!r}", ModelError, "replace it with a file", folder_ok=True)


def check_model_path(path: str, key: str, trust_remote_code: bool = False, gguf_file: str | None = None,
                     gguf_key: str = "models.gguf_file"):
    """Load the config of the model at ``path``; returns it.

    Args:
        path: a local directory or a hub id.
        key: the config key of ``path`` for messages (``models.target``).
        gguf_file: a GGUF file inside ``path``, read as transformers'
            ``from_pretrained(path, gguf_file=...)`` does (metadata and tensor index only;
            no weights are dequantized).  ``None``: ``path`` holds ``config.json``.
        gguf_key: the config key of ``gguf_file`` for messages.

    Raises:
        ModelError: naming ``key`` (``models.target``): the directory is missing, or has no
            loadable ``config.json``; or ``path`` is no local directory and no cached hub id.
            Naming ``gguf_key``: the GGUF file is missing, is not a GGUF file, is truncated
            or otherwise unreadable, has an architecture transformers cannot load, or the
            ``gguf`` package is missing.
    """
    from transformers import AutoConfig

    kw: dict = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        refuse_special_files(expanded, key)
        if gguf_file:
            _check_gguf_file(expanded, gguf_file, key, gguf_key)
        try:
            return AutoConfig.from_pretrained(expanded, **kw)
        except Exception as e:
            if gguf_file:
                raise _gguf_error(e, gguf_file, gguf_key) from None
            raise ModelError(f"{key}: {path!r} holds no loadable model config: {type(e).__name__}: {e}") from None
    if looks_local(path):
        hint = _fetch_hint(path)
        raise ModelError(f"{key}: model path {path!r} does not exist (resolved from {os.getcwd()!r}){hint}")
    try:  # an org/name hub id: only from the local cache, so a typo fails fast and offline
        return AutoConfig.from_pretrained(path, local_files_only=True, **kw)
    except Exception:
        pass
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except Exception as e:
        what = f"with GGUF file {gguf_file!r} ({gguf_key}) " if gguf_file else ""
        raise ModelError(
            f"{key}: model path {path!r} is not a local directory (resolved from {os.getcwd()!r}) "
            f"and not a loadable hub id {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _fetch_hint(path: str) -> str:
    """For a missing folder under ``models/cache/`` (where ``scripts/fetch_models.py`` converts the
    real models; the set-up fetches the default job's only): the command that fetches it, naming
    the folder (``--only`` takes a model's key or its folder name)."""
    parts = [p for p in path.replace(os.sep, "/").split("/") if p]
    at = next((i for i in range(len(parts) - 1) if parts[i:i + 2] == ["models", "cache"]), None)
    if at is None:
        return ""
    rest = [p for p in parts[at + 2:] if p != "gguf"]
    return ("; the real models are fetched and converted on first use by: python scripts/fetch_models.py"
            + (f" --only {rest[0]}" if rest else ""))


def check_causal_lm(config, path: str, key: str, trust_remote_code: bool = False) -> None:
    """Refuse a model that ``AutoModelForCausalLM`` would not load as a decoder-only causal LM.

    Raises:
        ModelError: naming ``key``, the model type and its architectures.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", None)
    archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
    what = f"{key}: {path!r} is a {model_type} model ({archs})"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"{what}, an encoder-decoder model; speculative decoding here needs a decoder-only "
                         "causal LM (one that AutoModelForCausalLM loads)")
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelError(f"{what}, which AutoModelForCausalLM cannot load: not a causal language model")


def check_weight_files(path: str, key: str) -> None:
    """Open the header of every safetensors file of a local model (no weights are read) and
    check that a sharded checkpoint's index names files that exist.  A local model whose
    weights are only pickles (``pytorch_model.bin``, :data:`PICKLE_WEIGHT_SUFFIXES`) is refused
    here, in the driver, before Ray starts (transformers would refuse it only in the actor).

    Raises:
        ModelError: naming ``key`` and the file: a truncated or corrupt header, a missing
            shard, or weights only as pickles.
    """
    import glob
    import json

    from safetensors import safe_open

    d = os.path.expanduser(path)
    if not os.path.isdir(d):
        return  # a hub id: transformers fetches and checks it
    for index in glob.glob(os.path.join(d, "*.safetensors.index.json")):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{key}: {os.path.basename(index)} is unreadable: {type(e).__name__}: {e}") from None
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(d, s)))
        if missing:
            raise ModelError(f"{key}: {path!r} lacks weight files its index names: {', '.join(missing[:5])}")
    weights = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    if not weights:
        pickles = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*"))
                         if p.endswith(PICKLE_WEIGHT_SUFFIXES) and os.path.isfile(p))
        if pickles:
            raise ModelError(f"{key}: {path!r} holds its weights only as {', '.join(pickles[:3])}"
                             f"{' ...' if len(pickles) > 3 else ''}, a pickle (loading one can run code), which "
                             "the job does not load: use a checkpoint with safetensors weights (model.safetensors), "
                             "or convert it with transformers (from_pretrained(...).save_pretrained(folder))")
    for f in weights:
        try:
            with safe_open(f, framework="pt") as h:
                h.keys()
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{key}: weight file {os.path.basename(f)} of {path!r} is unreadable: "
                             f"{type(e).__name__}: {e}") from None


def check_models(cfg: ModelsConfig, uses_drafter: bool, method: str | None = None, pair: bool = True) -> dict[str, Any]:
    """Check the target (config, architecture, weight files, tokenizer) and, when used, the
    drafter (config, architecture, weight files, and with ``pair`` its fit to the target for
    ``method``: :func:`check_vocabularies`; a drafter in a format of the method's own, such
    as a draft head, by the method's :attr:`~pipeline.engine.methods.MethodSpec.check_drafter`).

    A GGUF checkpoint (``models.gguf_file``, ``models.drafter_gguf_file``) is checked the same
    way: the file exists, is a GGUF file, and transformers reads its config (and, for the
    target, its tokenizer) from it.

    Returns:
        ``{"target_config", "drafter_config" (or None), "tokenizer", "drafter_tokenizer" (or None)}``.

    Raises:
        ModelError: as :func:`check_model_path`, :func:`check_causal_lm` and
            :func:`check_weight_files`, the target has no tokenizer, or the drafter's
            vocabulary does not fit the target's.
    """
    from transformers import AutoTokenizer

    target_config = check_model_path(cfg.target, "models.target", cfg.trust_remote_code,
                                     cfg.gguf_file, "models.gguf_file")
    check_causal_lm(target_config, cfg.target, "models.target", cfg.trust_remote_code)
    if not cfg.gguf_file:
        check_weight_files(cfg.target, "models.target")
    drafter_config = drafter_tok = None
    own_format = _method(method).check_drafter if uses_drafter and method is not None else None
    if own_format is not None:  # a drafter that is not a causal-LM checkpoint: the method checks it
        check_weight_files(cfg.drafter, "models.drafter")
        try:
            drafter_config = own_format(os.path.expanduser(cfg.drafter), target_config)
        except ValueError as e:
            raise ModelError(f"models.drafter: {e}") from None
        uses_drafter = False  # no causal-LM config, tokenizer or pair check of its own
    if uses_drafter:
        drafter_config = check_model_path(cfg.drafter, "models.drafter", cfg.trust_remote_code,
                                          cfg.drafter_gguf_file, "models.drafter_gguf_file")
        check_causal_lm(drafter_config, cfg.drafter, "models.drafter", cfg.trust_remote_code)
        if not cfg.drafter_gguf_file:
            check_weight_files(cfg.drafter, "models.drafter")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.target), **_tokenizer_kwargs(cfg, cfg.gguf_file))
    except Exception as e:
        key = "models.gguf_file" if cfg.gguf_file else "models.target"
        raise ModelError(f"{key}: {model_ref(cfg.target, cfg.gguf_file)!r} has no loadable tokenizer: "
                         f"{type(e).__name__}: {e}") from None
    if uses_drafter:
        try:
            drafter_tok = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.drafter),
                                                        **_tokenizer_kwargs(cfg, cfg.drafter_gguf_file))
        except Exception:  # noqa: BLE001 - a drafter saved without a tokenizer shares the target's
            drafter_tok = None
        if pair:
            check_vocabularies(method, target_config, drafter_config, tok, drafter_tok)
    return {"target_config": target_config, "drafter_config": drafter_config, "tokenizer": tok,
            "drafter_tokenizer": drafter_tok}


def check_vocabularies(method: str | None, target_config, drafter_config, tokenizer, drafter_tokenizer) -> None:
    """The drafter against the target for ``method``, from the configs and tokenizers alone:
    the method's own pair check (:attr:`pipeline.engine.methods.MethodSpec.check_pair`;
    a draft model's ids must map onto the target's tokenizer and mean the same, an MTP
    assistant's vocabulary must be the target's, ...).  A method without one, or no
    method, checks nothing.

    Raises:
        ModelError: the pair does not fit the method (saying why).
    """
    spec = _method(method) if method is not None else None
    if spec is None or spec.check_pair is None:
        return
    try:
        spec.check_pair(target_config, drafter_config, tokenizer, drafter_tokenizer)
    except ValueError as e:
        raise ModelError(f"models.drafter does not fit models.target for method {method!r}: {e}") from None


def checkpoint_generation_config(path: str, model_config, trust_remote_code: bool = False):
    """The target checkpoint's decoding defaults, as ``from_pretrained`` loads them: its
    ``generation_config.json``, else derived from ``model_config`` (``config.json``).
    Cheap (no weights); a hub id is read from the local cache first."""
    from transformers import GenerationConfig

    expanded = os.path.expanduser(path)
    for local_only in ((False,) if os.path.isdir(expanded) else (True, False)):
        try:
            return GenerationConfig.from_pretrained(expanded, local_files_only=local_only,
                                                    trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            continue
    return GenerationConfig.from_model_config(model_config)


def _tokenizer_kwargs(cfg: ModelsConfig, gguf_file: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    return kw


@dataclass
class LoadedModels:
    target: Any
    drafter: Any | None
    tokenizer: Any
    drafter_tokenizer: Any | None
    device: str


def pick_device() -> str:
    """``cuda`` when this process sees a GPU (Ray sets CUDA_VISIBLE_DEVICES per actor), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _method(name: str):
    """The method table's spec of ``name`` (an unknown name has no special checks: the
    config refuses it)."""
    from pipeline.engine import METHODS
    from pipeline.engine.methods import MethodSpec

    return METHODS.get(name) or MethodSpec(name)


def load_models(cfg: ModelsConfig, uses_drafter: bool, device: str | None = None,
                method: str | None = None) -> LoadedModels:
    """Load tokenizer, target and (when used) drafter, in eval mode (a drafter in a format of
    ``method``'s own, such as a draft head: by its
    :attr:`~pipeline.engine.methods.MethodSpec.load_drafter`, onto the loaded target).

    ``models.dtype: auto`` is the checkpoint's dtype on a GPU and float32 on the CPU;
    ``models.device_map`` (default: the device) goes to ``from_pretrained``.  A GGUF
    checkpoint (``models.gguf_file`` / ``models.drafter_gguf_file``) is dequantized by
    transformers to that dtype (float32 on the CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars from every actor on the driver's console

    device = device or pick_device()
    if cfg.dtype == "auto":
        dtype: Any = "auto" if device != "cpu" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    device_map = cfg.device_map or device
    kw = dict(dtype=dtype, device_map=device_map, trust_remote_code=cfg.trust_remote_code)

    def _load(path: str, gguf_file: str | None):
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), **kw, **extra)
        model.eval()
        return model

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.target), **_tokenizer_kwargs(cfg, cfg.gguf_file))
    target = _load(cfg.target, cfg.gguf_file)
    drafter = drafter_tokenizer = None
    own_format = _method(method).load_drafter if uses_drafter and cfg.drafter and method is not None else None
    if own_format is not None:
        return LoadedModels(target, own_format(os.path.expanduser(cfg.drafter), target), tokenizer, None, device)
    if uses_drafter and cfg.drafter:
        drafter = _load(cfg.drafter, cfg.drafter_gguf_file)
        try:
            drafter_tokenizer = AutoTokenizer.from_pretrained(
                os.path.expanduser(cfg.drafter), **_tokenizer_kwargs(cfg, cfg.drafter_gguf_file)
            )
        except Exception:
            drafter_tokenizer = None  # a drafter saved without a tokenizer shares the target's
    return LoadedModels(target, drafter, tokenizer, drafter_tokenizer, device)
