"""Model paths: checked in the driver (cheap, no weights), loaded in the actors.

:func:`check_models` reads only each model's ``config.json`` and the target's tokenizer,
so a wrong path fails the job before Ray starts any actor.  :func:`load_models` loads
the weights, on ``cuda`` when the process sees a GPU, else on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeline.config import ModelsConfig


class ModelError(ValueError):
    """A model path does not exist or holds no loadable config/tokenizer."""


def _looks_local(path: str) -> bool:
    """A path that can only mean a local directory (absolute, ./, ~, or not ``org/name``)."""
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        return True
    return os.path.isdir(path.split("/", 1)[0])  # "models/demo-target" with a local models/


def check_model_path(path: str, key: str, trust_remote_code: bool = False):
    """Load the config of the model at ``path``; returns it.

    Raises:
        ModelError: naming ``key`` (``models.target``): the directory is missing, or has no
            loadable ``config.json``; or ``path`` is no local directory and no cached hub id.
    """
    from transformers import AutoConfig

    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        try:
            return AutoConfig.from_pretrained(expanded, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise ModelError(f"{key}: {path!r} holds no loadable model config: {type(e).__name__}: {e}") from None
    if _looks_local(path):
        raise ModelError(f"{key}: model path {path!r} does not exist (resolved from {os.getcwd()!r})")
    try:  # an org/name hub id: only from the local cache, so a typo fails fast and offline
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception:
        pass
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelError(
            f"{key}: model path {path!r} is not a local directory (resolved from {os.getcwd()!r}) "
            f"and not a loadable hub id: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def check_models(cfg: ModelsConfig, uses_drafter: bool) -> dict[str, Any]:
    """Check the target (config + tokenizer) and, when used, the drafter's config.

    Returns:
        ``{"target_config", "drafter_config" (or None), "tokenizer"}``.

    Raises:
        ModelError: as :func:`check_model_path`, or the target has no tokenizer.
    """
    from transformers import AutoTokenizer

    target_config = check_model_path(cfg.target, "models.target", cfg.trust_remote_code)
    drafter_config = check_model_path(cfg.drafter, "models.drafter", cfg.trust_remote_code) if uses_drafter else None
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.target), trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise ModelError(f"models.target: {cfg.target!r} has no loadable tokenizer: {type(e).__name__}: {e}") from None
    return {"target_config": target_config, "drafter_config": drafter_config, "tokenizer": tok}


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


def load_models(cfg: ModelsConfig, uses_drafter: bool, device: str | None = None) -> LoadedModels:
    """Load tokenizer, target and (when used) drafter, in eval mode.

    ``models.dtype: auto`` is the checkpoint's dtype on a GPU and float32 on the CPU;
    ``models.device_map`` (default: the device) goes to ``from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or pick_device()
    if cfg.dtype == "auto":
        dtype: Any = "auto" if device != "cpu" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    device_map = cfg.device_map or device
    kw = dict(dtype=dtype, device_map=device_map, trust_remote_code=cfg.trust_remote_code)

    def _load(path: str):
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), **kw)
        model.eval()
        return model

    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(cfg.target), trust_remote_code=cfg.trust_remote_code)
    target = _load(cfg.target)
    drafter = drafter_tokenizer = None
    if uses_drafter and cfg.drafter:
        drafter = _load(cfg.drafter)
        try:
            drafter_tokenizer = AutoTokenizer.from_pretrained(
                os.path.expanduser(cfg.drafter), trust_remote_code=cfg.trust_remote_code
            )
        except Exception:
            drafter_tokenizer = None  # a drafter saved without a tokenizer shares the target's
    return LoadedModels(target, drafter, tokenizer, drafter_tokenizer, device)
