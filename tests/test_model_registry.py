"""A model kind declared in one place: a GPT whose blocks run attention and the MLP in parallel on one
normed input (GPT-J style: x + attn(ln(x)) + mlp(ln(x))), registered here (in this file only). It is
accepted by the config, listed by --help-config, counted by the FLOP model exactly as torch's FLOP
counter counts it, by the activation-memory model as its saved tensors measure, and trained by the
real trainer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from largebatch.integrations import ExportError
from largebatch.integrations.hf_export import check_exportable
from largebatch.memory import apply_recompute, estimate, measure_forward_bytes, model_activation_bytes
from largebatch.models import GPT, MODELS, ModelConfig, build_model, flops_per_token, register_model
from largebatch.models.layers import Block
from largebatch.parallel.tensor_parallel import model_plan
from largebatch.train.cli import main
from largebatch.train.config import load_config
from largebatch.train.hf_import import largebatch_state
from largebatch.train.metrics import read_metrics
from largebatch.typed_config import ConfigError
from test_train import _run, tiny_overrides

NAME = "parallel-gpt"


class ParallelBlock(Block):
    """One LayerNorm; attention and the MLP both read its output, and both add to the stream."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        del self.ln2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        return x + self.attn(h) + self.mlp(h)


class ParallelGPT(GPT):
    block = ParallelBlock


@pytest.fixture
def parallel_gpt():
    gpt = MODELS["gpt"]
    register_model(
        NAME, build=ParallelGPT, objective="causal",
        help="GPT with attention and MLP in parallel on one LayerNorm (GPT-J style; a test's own)",
        head_flops=gpt.head_flops, output_activations=gpt.output_activations,
        stage_parameters=gpt.stage_parameters, pipeline_first=gpt.pipeline_first,
        pipeline_last=gpt.pipeline_last,
        tp_plan=lambda model: {k: v for k, v in gpt.tp_plan(model).items() if k != "blocks.*.ln2"},
        layer_replicated=2,  # the LayerNorm input, and its output that q, k, v and fc1 all read
        layer_norms=1)
    yield
    MODELS.pop(NAME)


def test_a_registered_kind_is_a_choice_of_the_config_and_of_the_help(parallel_gpt, capsys):
    assert load_config(None, {"model.kind": NAME}).model.kind == NAME
    with pytest.raises(ConfigError, match=f"did you mean '{NAME}'"):
        load_config(None, {"model.kind": "parallel-gtp"})
    assert main(["--help-config"]) == 0
    text = capsys.readouterr().out
    assert f"'gpt' | 'bert' | '{NAME}'" in text
    assert f"{NAME}: GPT with attention and MLP in parallel" in text
    assert isinstance(build_model(ModelConfig(kind=NAME, n_layer=1, n_embd=8, n_head=2)).blocks[0], ParallelBlock)


def test_unregistered_it_is_refused_naming_the_kinds_and_the_fix():
    assert NAME not in MODELS
    with pytest.raises(ValueError, match=f"ModelConfig.kind='{NAME}': must be one of 'gpt', 'bert' "
                                         r"\(register another with largebatch.models.register_model"):
        ModelConfig(kind=NAME)
    with pytest.raises(ConfigError, match=f"model.kind = '{NAME}': must be one of 'gpt', 'bert'"):
        load_config(None, {"model.kind": NAME})


def test_the_transformers_bridges_name_a_kind_they_do_not_map(parallel_gpt):
    cfg = ModelConfig(kind=NAME, init_from="hf:some/gpt2")
    with pytest.raises(ExportError, match=f"model.kind='{NAME}': the hf format exports 'gpt' "
                                          r"\(GPT2LMHeadModel\), 'bert' \(BertForMaskedLM\) only"):
        check_exportable(cfg)
    with pytest.raises(ConfigError, match=f"model.kind='{NAME}': model.init_from='hf:some/gpt2' reads "
                                          "transformers weights into 'gpt'"):
        largebatch_state(cfg)


def _counted_flops(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """Matmul FLOPs of one forward and backward, as torch's FLOP counter counts them."""
    with FlopCounterMode(display=False) as counter:
        model(idx, targets)[1].backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", ["gpt", "bert", NAME])
def test_flops_per_token_is_what_torch_counts(parallel_gpt, kind):
    c = ModelConfig(kind=kind, n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=96)
    b = 4
    idx = torch.randint(0, c.vocab_size, (b, c.seq_len))
    targets, mask_fraction = idx, 0.15
    if kind == "bert":  # the head runs on the predicted positions only: 1 in 8 here
        targets = torch.full_like(idx, -100)
        targets[:, ::8] = idx[:, ::8]
        mask_fraction = 1 / 8
    counted = _counted_flops(build_model(c), idx, targets)
    assert flops_per_token(c, mask_fraction=mask_fraction) == pytest.approx(counted / (b * c.seq_len), rel=1e-12)


def test_activation_memory_is_what_the_saved_tensors_measure(parallel_gpt):
    c = ModelConfig(kind=NAME, n_layer=2, n_embd=128, n_head=4, seq_len=128, vocab_size=64, dropout=0.1)
    b = 8
    model = build_model(c)
    assert estimate(c, 1, dtype_bytes=4).parameters == 4 * model.num_params()
    idx = torch.randint(0, c.vocab_size, (b, c.seq_len))
    for policy in ("none", "selective", "full"):
        apply_recompute(model, policy)
        measure_forward_bytes(lambda: model(idx, idx))[0][1].backward()  # one-time initialisations
        (_, loss), held = measure_forward_bytes(lambda: model(idx, idx))
        loss.backward()
        model.zero_grad(set_to_none=True)
        predicted = model_activation_bytes(c, b, policy, dtype_bytes=4, device="cpu")
        assert held.tensor_bytes == pytest.approx(predicted, rel=0.05), policy
    # what the kind declares matters: its blocks keep 2 s b h fp32 values fewer than GPT's
    gpt = model_activation_bytes(c.replace(kind="gpt"), b, "none", dtype_bytes=4, device="cpu")
    assert gpt - model_activation_bytes(c, b, "none", dtype_bytes=4, device="cpu") == \
        c.n_layer * 2 * c.seq_len * b * c.n_embd * 4


def test_its_tensor_parallel_plan_names_its_modules(parallel_gpt):
    model = build_model(ModelConfig(kind=NAME, n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=64))
    plan = model_plan(model, sequence_parallel=True)
    assert {"blocks.0.ln1", "blocks.1.attn.q", "blocks.1.mlp.fc2", "lm_head", "ln_f"} <= set(plan)
    assert not any(name.endswith("ln2") for name in plan)
    for name in plan:
        model.get_submodule(name)  # every planned name is a module of the model


def test_a_plan_that_leaves_the_query_and_key_norms_to_the_fallback_is_refused(parallel_gpt):
    """With model.qk_norm, a kind whose plan writes out BLOCK_TP_PLAN (which has no head_norm role for
    attn.q_norm / k_norm) would leave each rank's partial gain gradient unsummed (or, with
    qk_norm_scope="projection", normalise each rank's half of the projection alone): model_plan refuses
    it naming the module and block_tp_plan; the built-in kinds' plans have the role."""
    from largebatch.models.kinds import BLOCK_TP_PLAN

    cfg = ModelConfig(kind=NAME, n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=64, qk_norm=True)
    plan = model_plan(build_model(cfg), sequence_parallel=False)  # the fixture's: gpt's plan, block_tp_plan
    assert type(plan["blocks.1.attn.k_norm"]).__name__ == "SequenceParallel"
    gpt = MODELS["gpt"]
    MODELS.pop(NAME)
    register_model(
        NAME, build=ParallelGPT, objective="causal", help="the same kind, its plan written out from BLOCK_TP_PLAN",
        head_flops=gpt.head_flops, output_activations=gpt.output_activations,
        stage_parameters=gpt.stage_parameters, pipeline_first=gpt.pipeline_first, pipeline_last=gpt.pipeline_last,
        tp_plan=lambda model: {"tok_emb": "vocab_embedding", "lm_head": "output",
                               **{k: v for k, v in BLOCK_TP_PLAN.items() if k != "blocks.*.ln2"}},
        layer_replicated=2, layer_norms=1)
    with pytest.raises(ValueError, match=r"qk_norm \(qk_norm_scope='head'\): its tensor-parallel plan gives "
                                         r"'blocks.0.attn.q_norm' no 'head_norm' role.*block_tp_plan\(config\)"):
        model_plan(build_model(cfg), sequence_parallel=False)
    # OLMo 2's projection-wide norms: left to the fallback each rank would normalise over its half of q
    olmo = cfg.replace(norm="rmsnorm", qk_norm_scope="projection")
    with pytest.raises(ValueError, match=r"'blocks.0.attn.q_norm' no 'projection_norm' role"):
        model_plan(build_model(olmo), sequence_parallel=False)
    model_plan(build_model(cfg.replace(qk_norm=False)), sequence_parallel=False)  # (nothing to sum without them)


def test_the_trainer_trains_it(parallel_gpt, tiny_data_cache, tmp_path):
    out = tmp_path / NAME
    summary = _run(tiny_overrides(tiny_data_cache, out, **{"model.kind": NAME, "schedule.batch_policy": "constant",
                                                            "run.sample_tokens": 8, "run.sample_prompt": "ROMEO:"}))
    losses = [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]
    assert len(losses) >= 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses  # 6.24 -> 5.86 measured
    assert summary["steps"] == len(losses) and summary["final_val_loss"] < losses[0]
    # its end-of-run sample: the layer takes no KV cache, so generation reads the whole context
    assert summary["sample"].startswith("ROMEO:") and len(summary["sample"]) > len("ROMEO:")


class CappedGPT(GPT):
    """A kind with its own forward, in the signature the registry documents (logit soft-capping)."""

    def forward(self, idx, targets=None, reduction="mean"):
        logits, _ = super().forward(idx)
        logits = 30 * torch.tanh(logits / 30)
        return logits, None


class OwnBlocksGPT(GPT):
    def run_blocks(self, x, mask=None):
        return super().run_blocks(x, mask)


@pytest.mark.parametrize("kind", [ParallelGPT, CappedGPT, OwnBlocksGPT])
def test_a_kind_whose_layer_or_forward_takes_no_cache_generates_without_one(kind):
    """Its forward, run_blocks or layer without a ``cache`` argument: generate reads the whole context
    for every token instead (a TypeError in the end-of-run sample before)."""
    model = kind(ModelConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=50, dropout=0.0)).eval()
    assert not model.decodes() and GPT(ModelConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).decodes()
    idx = torch.randint(0, 50, (2, 4))
    out = model.generate(idx, 20, temperature=0)  # past seq_len too
    assert out.shape == (2, 24)
    expected = idx
    for _ in range(20):  # the kind's own forward, read whole
        expected = torch.cat([expected, model(expected[:, -16:])[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, expected)
