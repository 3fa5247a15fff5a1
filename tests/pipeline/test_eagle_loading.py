"""Method ``eagle`` in a job: ``models.drafter`` names a draft-head folder, which the driver
checks (config only) and the actors load and attach to the target."""

from __future__ import annotations

import pytest
import torch

from pipeline_testkit import job_config
from pipeline.engine import GenerationSettings, SpeculativeEngine
from pipeline.engine.draft_head import DraftHead, DraftHeadConfig, save_draft_head
from pipeline.loading import build_engine, load_job_models
from pipeline.models import ModelError, check_models


@pytest.fixture(scope="module")
def head_folder(tiny_models, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32)
    cfg = DraftHeadConfig.for_target(target, feature_layers=[1, 2], draft_vocab_size=20)
    torch.manual_seed(0)
    head = DraftHead(cfg)
    head.set_draft_vocab(torch.arange(target.config.vocab_size - 20, target.config.vocab_size))
    path = tmp_path_factory.mktemp("head") / "eagle"
    save_draft_head(head, path)
    return str(path)


def test_a_job_drafts_with_a_head_folder(tiny_models, head_folder, tmp_path):
    models = dict(tiny_models, drafter=head_folder)
    cfg = job_config(models, "unused", str(tmp_path / "o"), method="eagle",
                     overrides=["method.num_assistant_tokens=3", "method.draft_vocab_size=12"])
    checked = check_models(cfg.models, cfg.uses_drafter, method="eagle")
    assert checked["drafter_config"].draft_vocab_size == 20 and checked["drafter_tokenizer"] is None
    loaded = load_job_models(cfg, "cpu")
    assert isinstance(loaded.drafter, DraftHead)
    engine = build_engine(loaded, cfg.method.speculation_settings(), 4)
    assert engine.proposer.vocab_ids.numel() == 12
    prompt = loaded.tokenizer("the cat sat on the mat")["input_ids"]
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=12))
    assert result.token_ids == SpeculativeEngine(loaded.target).generate(prompt, GenerationSettings(max_new_tokens=12)).token_ids
    assert result.stats.draft_tokens > 0


def test_a_head_folder_is_refused_for_another_method_and_a_model_for_eagle(tiny_models, head_folder, tmp_path):
    cfg = job_config(dict(tiny_models, drafter=head_folder), "unused", str(tmp_path / "o"), method="draft_model")
    with pytest.raises(ModelError, match="models.drafter"):  # not a causal LM: draft_model cannot read it
        check_models(cfg.models, cfg.uses_drafter, method="draft_model")
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), method="eagle")
    with pytest.raises(ModelError, match="drafts with a draft head folder"):
        check_models(cfg.models, cfg.uses_drafter, method="eagle")
