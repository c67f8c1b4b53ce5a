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


def test_bert_large_lans_is_bert_large_and_each_phase_fits_the_papers_gpus(capsys):
    """The cluster recipe: built on the meta device it has exactly transformers' BERT-large masked-LM
    parameters (less the token-type table, which this BERT does not have); its phases are the paper's
    lengths and batches; the planner, given each phase, plans at that phase's length and micro-batch
    and finds it fits a 32 GB GPU at dp = 1536 without recomputation."""
    transformers = pytest.importorskip("transformers")
    from largebatch.memory.cli import main as memory_main
    from largebatch.memory.estimate import GIB
    from largebatch.memory.planner import Setup
    from largebatch.train.cli import shipped_configs

    path = shipped_configs()["bert-large-lans"]
    cfg = load_config(path)
    assert [(p.seq_len, p.schedule["batch_size"]) for p in cfg.phases] == [(128, 98_304), (512, 33_792)]
    assert cfg.optim.name == "lans" and cfg.schedule.lr_schedule == "lans" and cfg.run.dtype == "bf16"
    with torch.device("meta"):
        ours = build_model(cfg.model.replace(vocab_size=cfg.data.vocab_size)).num_params()
        hf_config = transformers.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                                            num_attention_heads=16, intermediate_size=4096,
                                            max_position_embeddings=512)
        hf = transformers.BertForMaskedLM(hf_config)
        hf.tie_weights()  # (transformers 5.0 leaves the decoder untied on the meta device)
        hf_params = sum(p.numel() for p in hf.parameters())
    assert ours == hf_params - 2 * 1024  # type_vocab_size x hidden
    for index, phase in enumerate(cfg.phases):
        capsys.readouterr()
        assert memory_main(["--config", str(path), "--phase", str(index), "--dp", "1536",
                            "--budget-gib", "32", "--optimizer", "lans"]) == 0
        out = capsys.readouterr().out
        assert '["none"] * 24' in out
        expected = Setup(dp=1536, micro_batch=phase.micro_batch, seq_len=phase.seq_len,
                         optimizer="lans").estimate(
            cfg.model.replace(seq_len=phase.seq_len, vocab_size=cfg.data.vocab_size), "none")
        assert f"Per device, no recompute: {expected}" in out
        assert expected.total < 32 * GIB


@pytest.mark.parametrize("argv, message", [
    (["--phase", "0"], "--phase 0: needs --config"),
    (["--config", "configs/bert-demo.toml", "--phase", "0"], "has no [[phases]]"),
    (["--config", "configs/bert-lans-demo.toml", "--phase", "2"], "has phases 0..1"),
])
def test_memory_phase_bad_input_is_one_line(argv, message, capsys):
    from largebatch.memory.cli import main as memory_main

    assert memory_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
