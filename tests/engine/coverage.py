"""What the engine tests cover, per architecture: the tests parametrize from these lists,
and the list of accepted architectures in docs/engine.md is generated from them
(``test_architectures_page.py``), so the two cannot drift apart.

Each entry: model class, what its attention / positions look like, the methods checked
lossless (greedy equal to single-row plain greedy, and to ``generate()`` where it has the
method, in float64), and whether batched runs (several rows in flight) are checked.
"""

from __future__ import annotations

# tests/engine/test_differential.py: every method against generate(), four architectures
DIFFERENTIAL_ARCHS = ["llama", "qwen2", "gpt_neox", "gpt2"]
DIFFERENTIAL_METHODS = ["plain", "draft_model", "prompt_lookup"]
# tests/engine/test_early_exit.py: early exit splits these (and refuses GPT-2)
EARLY_EXIT_ARCHS = ["llama", "qwen2"]
# tests/engine/test_architectures.py: sliding-window layers, as target and as drafter
SLIDING_ARCHS = ["gemma2", "gemma3", "mistral", "qwen2_mixed"]
SLIDING_METHODS = ["plain", "draft_model", "prompt_lookup", "early_exit"]
# tests/engine/test_batch.py: batch sizes 1, 3, 8, continuous batching, shuffling
BATCH_ARCHS = ["gemma3", "gpt2", "llama"]
BATCH_METHODS = ["plain", "draft_model", "prompt_lookup", "early_exit"]

ROWS = [
    # (label, model class, attention / positions, methods checked lossless, batched, test file)
    ("llama", "LlamaForCausalLM", "full, RoPE (llama3 scaling in the LayerSkip fixture)",
     DIFFERENTIAL_METHODS + ["early_exit", "ensemble (lossy)"], True, "test_differential, test_early_exit, test_batch"),
    ("qwen2", "Qwen2ForCausalLM", "full, RoPE", DIFFERENTIAL_METHODS + ["early_exit"], False,
     "test_differential, test_early_exit"),
    ("gpt_neox", "GPTNeoXForCausalLM", "full, partial RoPE", DIFFERENTIAL_METHODS, False, "test_differential"),
    ("gpt2", "GPT2LMHeadModel", "full, learned absolute positions", DIFFERENTIAL_METHODS, True,
     "test_differential, test_batch"),
    ("mistral", "MistralForCausalLM", "sliding window in every layer", SLIDING_METHODS, False, "test_architectures"),
    ("qwen2_mixed", "Qwen2ForCausalLM", "full and sliding layers (use_sliding_window)", SLIDING_METHODS, False,
     "test_architectures"),
    ("gemma2", "Gemma2ForCausalLM", "sliding and full alternating, soft-capping", SLIDING_METHODS, False,
     "test_architectures"),
    ("gemma3", "Gemma3ForCausalLM", "5 sliding : 1 full, two RoPE bases", SLIDING_METHODS, True,
     "test_architectures, test_batch"),
    ("phi3_longrope", "Phi3ForCausalLM", "LongRoPE (short/long factors, switch recomputed)",
     ["plain", "draft_model", "prompt_lookup"], True, "test_architectures"),
    ("llama_yarn", "LlamaForCausalLM", "YaRN (context = factor x original)", ["plain", "prompt_lookup"], False,
     "test_architectures"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "MLA, MoE, MTP layers", ["plain", "mtp"], True, "test_mtp"),
    ("glm4_moe", "Glm4MoeForCausalLM", "MoE, MTP layers", ["plain", "mtp"], True, "test_mtp"),
    ("gemma4", "Gemma4ForConditionalGeneration", "sliding and full, KV-shared layers",
     ["plain", "mtp_assistant"], True, "test_mtp_assistant"),
    ("llama_universal", "LlamaForCausalLM (two BPE tokenizers)", "full, RoPE", ["universal"], True,
     "test_universal (one row at a time)"),
    ("llama_eagle", "LlamaForCausalLM (+ a draft head on its hidden states)", "full, RoPE",
     ["eagle (EAGLE-1 / EAGLE-3 features, reduced vocabulary)", "draft_model (reduced vocabulary)"], True, "test_eagle"),
]

# tests/engine/test_architectures.py: refused when the engine is built (label -> layer kind named)
REFUSED = {
    "lfm2 (conv)": "conv",
    "qwen3_next (linear attention)": "linear_attention",
    "mamba": "linear_attention",
    "jamba (hybrid)": "linear_attention",
}
