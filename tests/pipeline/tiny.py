"""Tiny random Llama pairs and an offline word-level tokenizer, for the pipeline tests and bench.

:func:`make_model_pair` writes ``<dir>/target`` and ``<dir>/drafter`` (``save_pretrained``
of a Llama with hidden 48, 2 layers, context 256 tokens, plus the tokenizer).  The drafter
is the target with noise added to its output head, so it agrees with the target on
most but not all tokens: drafts are partly accepted.
"""

from __future__ import annotations

from pathlib import Path

SENTENCES = [
    "the cat sat on the mat and looked at the dog",
    "a storm hit the coast on monday and many homes lost power",
    "the council voted to build a new school near the river",
    "scientists found a new species of frog in the forest",
    "the team won the final match after a long season",
    "prices rose again this month as fuel costs went up",
    "the museum opened a new exhibition about ancient ships",
    "local farmers said the dry summer hurt their crops",
    "summarize the following article in a few sentences",
    "article summary translate from english to french text",
    "le chat est sur le tapis et regarde le chien",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def make_tokenizer(chat_template: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for s in SENTENCES for w in s.split()} | set("abcdefghijklmnopqrstuvwxyz.,:!?0123456789"))
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_byte_tokenizer(chat_template: str | None = None):
    """A byte-level tokenizer (GPT-2's and SmolLM2's kind: the grammar library reads its token
    strings): ``<eos>`` (id 0) and one token per byte, no merges, so a text has one tokenization."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(["<eos>"] + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_model_pair(root: str | Path, *, seed: int = 0, context: int = 256, noise: float = 0.15,
                    hidden: int = 48, layers: int = 2, tokenizer=None) -> tuple[str, str]:
    """Save a target and a drafter (same tokenizer: ``tokenizer``, default :func:`make_tokenizer`'s)
    under ``root``; returns their paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(root)
    tok = tokenizer if tokenizer is not None else make_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).eval()
    drafter = LlamaForCausalLM(cfg).eval()
    drafter.load_state_dict(target.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        w = drafter.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    paths = []
    for name, model in (("target", target), ("drafter", drafter)):
        d = root / name
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(d)
        tok.save_pretrained(d)
        paths.append(str(d))
    return paths[0], paths[1]
