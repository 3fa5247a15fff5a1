"""The small-M kernels (``csrc/smallm.c``), built with gcc at first use and loaded with ctypes:
``y = x @ W^T (+ bias)`` in float32 for a few rows of input, reading each weight once per call
(:meth:`Library.linear`), and the attention of a short query block over a KV cache, reading each
row's keys and values once (:meth:`Library.attention`).

Why.  At 3-8 rows of input every library kernel on offer (oneDNN packed, MKL, ``x @ W^T``,
inductor's row-dot loop) turns compute-inefficient: a verification pass of a few tokens costs
2-3 one-token steps although it reads the same weights (``docs/benchmarks.md``, "The roofline of
a pass").  The linear kernel keeps two panels of 16 output columns of the weight (one on the AVX2
path), packed once K-major (:meth:`Library.pack`), in the cache while it multiplies every row of
input with them, so the weight comes from memory once whatever the row count (AVX2 + FMA;
AVX-512 where the CPU has it).  SDPA at 1-8 query tokens spends several times the cache's read
on per-call work; the attention kernel scores a block of keys against all the query heads of a
KV head, then sums the values the same way.

Each output element of the linear kernel is one FMA lane summing over the input features in
order, so the result is bitwise the same for every row count (row ``i`` of an ``M``-row call
equals row ``i`` alone): batch-invariant where every row count of a shape takes this kernel.

Where they are offered: an x86-64 CPU with AVX2 and FMA (torch's CPU capability), gcc on the path,
and the C source compiled into ``<compile cache>/smallm/smallm-<hash of source and flags>.so`` (the
node's cache folder, :func:`.options.compile_cache_dir`, shared by its processes; compiled once,
a second or two).  Anywhere else :func:`library` returns ``None``, logged at INFO with the reason,
and the other kernels serve.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import time

import torch

from .measure import Costs
from .options import CpuOptions, compile_cache_dir

log = logging.getLogger(__name__)

#: the C source, shipped as package data
SOURCE = Path(__file__).with_name("csrc") / "smallm.c"
#: how the source is compiled (part of the library's cache key)
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
#: the C ABI version the loader expects (``smallm_abi()``)
ABI = 2
#: head sizes :meth:`Library.attention` serves
ATTENTION_HEAD_DIMS = (32, 64, 128)
#: the most query vectors per row and key/value head it serves (query heads per KV head x tokens)
ATTENTION_MAX_QUERIES = 64

_LOADED: dict[str, "Library | None"] = {}


class Library:
    """The loaded kernel: :meth:`pack` a weight once, then :meth:`linear` per call.

    Args:
        path: the compiled shared library.
    """

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        if lib.smallm_abi() != ABI:
            raise OSError(f"{path}: ABI {lib.smallm_abi()}, expected {ABI}")
        i64, p = ctypes.c_int64, ctypes.c_void_p
        lib.smallm_packed_size.restype = i64
        lib.smallm_packed_size.argtypes = (i64, i64)
        lib.smallm_pack.restype = None
        lib.smallm_pack.argtypes = (p, i64, i64, i64, p)
        lib.smallm_linear.restype = None
        lib.smallm_linear.argtypes = (p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int)
        lib.smallq_attention.restype = ctypes.c_int
        lib.smallq_attention.argtypes = (p, i64, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, i64, i64, p,
                                         i64, i64, i64, i64, i64, i64, ctypes.c_float, p)
        self._lib, self.path = lib, path
        #: the AVX-512 path (else AVX2)
        self.wide = bool(lib.smallm_has_avx512())

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """The ``(out, in)`` float32 weight ``w`` packed for :meth:`linear`: a flat float32 tensor
        of ``ceil(out / 32) * 32 * in`` elements (a new tensor; ``w`` is read, not kept)."""
        if w.dtype != torch.float32 or w.dim() != 2 or w.stride(1) != 1:
            raise ValueError(f"smallm packs a float32 (out, in) weight with unit column stride, got {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        out = torch.empty(self._lib.smallm_packed_size(n, k), dtype=torch.float32)
        self._lib.smallm_pack(w.data_ptr(), w.stride(0), n, k, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``x @ W^T (+ bias)``: ``(M, in)`` float32 ``x`` with unit column stride, ``packed`` from
        :meth:`pack` of the ``(out_features, in)`` ``W``, ``bias`` ``(out_features,)`` contiguous or
        ``None`` -> a new ``(M, out_features)`` float32 tensor.  Nothing is checked here (the
        caller, :class:`.linear.PackedLinear`, holds the shapes): wrong shapes read out of bounds."""
        m, k = x.shape
        y = torch.empty(m, out_features, dtype=torch.float32)
        self._lib.smallm_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), out_features, m, out_features, k, int(self.wide))
        return y


    def serves_attention(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
        """Whether :meth:`attention` takes these ``(b, Hq, Q, d)`` queries, ``(b, Hkv, S, d)`` keys and
        additive mask: float32 throughout, a head size of :data:`ATTENTION_HEAD_DIMS`, grouped heads of
        at most :data:`ATTENTION_MAX_QUERIES` query vectors, unit last strides, a ``(b or 1, 1, Q, >= S)``
        mask (or ``None``, every position visible)."""
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        return (q.dtype == k.dtype == torch.float32 and d in ATTENTION_HEAD_DIMS and hkv > 0 and hq % hkv == 0
                and hq // hkv * nq <= ATTENTION_MAX_QUERIES and q.stride(3) == 1 and k.stride(3) == 1
                and k.shape[0] == b and k.shape[2] > 0
                and (mask is None or (mask.dtype == torch.float32 and mask.dim() == 4 and mask.shape[0] in (1, b)
                                      and mask.shape[1] == 1 and mask.shape[2] == nq and mask.shape[3] >= k.shape[2]
                                      and mask.stride(3) == 1)))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, checked: bool = False) -> torch.Tensor:
        """Softmax attention of ``(b, Hq, Q, d)`` float32 queries over ``(b, Hkv, S, d)`` keys and values
        (grouped heads: query head ``h`` reads KV head ``h // (Hq / Hkv)``), ``scale`` on the scores, the
        additive ``mask`` ``(b or 1, 1, Q, >= S)`` (its first ``S`` positions) or ``None``: a new
        contiguous ``(b, Hq, Q, d)`` tensor, SDPA's result within float32 rounding.  Each row's keys
        and values are read once for all its query heads and tokens.  Only shapes
        :meth:`serves_attention` accepts (``ValueError`` otherwise); ``checked``: the caller has just
        asked :meth:`serves_attention` and checked ``v`` (the lean pass, once per layer), so it is not asked again."""
        if not checked and (not self.serves_attention(q, k, mask) or v.shape != k.shape or v.stride(3) != 1):
            raise ValueError(f"attention shapes not served: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        b, hq, nq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        out = torch.empty(b, hq, nq, d, dtype=torch.float32)
        scratch = torch.empty(hq // hkv * nq * s, dtype=torch.float32)
        m_ptr, m_sb, m_sq = (None, 0, 0) if mask is None else (
            mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2))
        rc = self._lib.smallq_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
                                        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                                        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                                        m_ptr, m_sb, m_sq, out.data_ptr(), b, hq, hkv, nq, s, d, scale,
                                        scratch.data_ptr())
        if rc:
            raise ValueError(f"attention shapes not served: q {tuple(q.shape)}, k {tuple(k.shape)}")
        return out


def why_unavailable() -> str | None:

    """Why this machine cannot run the kernel (``None``: it may): not x86-64, no AVX2 in
    torch's CPU capability, or no gcc."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"the CPU has no AVX2 (torch's CPU capability: {capability})"
    if shutil.which("gcc") is None:
        return "no gcc on the path"
    return None


def _build(folder: str) -> str:
    """The path of the compiled library in ``folder``, compiling it there first if missing
    (written under a temporary name and renamed: processes of a node may race)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join(FLAGS).encode()).hexdigest()[:16]
    path = os.path.join(folder, f"smallm-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(["gcc", *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise OSError(f"gcc failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def library(folder: str) -> Library | None:
    """The kernel compiled into (or found in) ``folder/smallm``, loaded once per process and
    folder, or ``None`` where this machine cannot build or run it (the reason logged at INFO)."""
    if folder in _LOADED:
        return _LOADED[folder]
    lib = None
    why = why_unavailable()
    if why is None:
        try:
            lib = Library(_build(os.path.join(folder, "smallm")))
        except (OSError, subprocess.SubprocessError) as exc:
            why = str(exc)
    if lib is None:
        log.info("no small-M linear kernel: %s (the other kernels serve)", why)
    _LOADED[folder] = lib
    return lib


def library_for(options: CpuOptions, costs: Costs | None = None) -> Library | None:
    """:func:`library` in the node's cache folder of ``options`` (:func:`.options.compile_cache_dir`),
    ``None`` where the ``smallm`` part is off; the seconds spent (a compile at first use) are added
    to ``costs.compile_s``."""
    if not options.part_on("smallm"):
        return None
    start = time.perf_counter()
    try:
        return library(compile_cache_dir(options))
    finally:
        if costs is not None:
            costs.compile_s += time.perf_counter() - start

