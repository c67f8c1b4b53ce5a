"""Every shipped config loads, validates, and builds its model and schedule."""


import pytest
import torch

from largebatch.models import build_model
from largebatch.train.cli import shipped_configs
from largebatch.train.config import load_config

CONFIGS = list(shipped_configs().values())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_builds(path):
    cfg = load_config(path)
    schedule = cfg.schedule.build(cfg.run.total_tokens, cfg.model.seq_len, cfg.run.micro_batch, 1)
    assert schedule.batch_size(0) % cfg.run.micro_batch == 0
    with torch.device("meta"):  # shapes only: GPT-2/BERT-base need no memory here
        model = build_model(cfg.model)
    assert model.num_params() > 0


def test_configs_cover_gpt_and_bert_at_several_sizes():
    kinds = [load_config(p).model.kind for p in CONFIGS]
    assert kinds.count("gpt") >= 3 and kinds.count("bert") >= 3
