"""The meta-device start (largebatch.parallel.materialize) with REAL processes: 2 gloo ranks, 1
thread each, spawned ONCE for every case of tests/meta_cases.py. Under FSDP2 and tensor + sequence
parallel, a model built on the meta device and materialised per rank must hold only this rank's
shards, equal the one-process build bit for bit, and train to the one-process losses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import meta_cases as cases
from largebatch.memory.estimate import stage_parameters
from largebatch.models import build_model
from largebatch.parallel import spawn
from largebatch.parallel.materialize import build_on_meta, materialize
from parallel_cases import tiny

# "llama": the GPT with RMSNorm, rotary positions (non-persistent cos/sin tables), the SwiGLU MLP and
# grouped-query attention (parallel_cases.tiny)
KINDS = ("gpt", "bert", "llama")
# "qwen3": those layers with each query and key head normalised (their gains split with no heads);
# "olmo": OLMo 2's, the whole q and k projections normalised (their gains split with the heads)
CASES = [(kind, mode) for kind in (*KINDS, "qwen3", "olmo") for mode in ("fsdp", "sp")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta")
    spawn(cases.run_all, 2, str(out))
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind,mode", CASES)
def test_parameters_equal_the_one_process_build_bit_for_bit(ranks, kind, mode):
    """Gathered parameters == the plain build of the same seed, exactly; the CPU generator is left
    where the plain build leaves it; tied embeddings are one tensor; the causal mask and the rotary
    tables are rebuilt, equal to the plain build's."""
    for results in ranks:
        key = f"{kind}/{mode}"
        assert results[f"param_diff/{key}"] == 0.0
        assert results[f"rng_same/{key}"] and results[f"tied/{key}"] and results[f"rotary_ok/{key}"]
        if kind != "bert":
            assert results[f"mask_ok/{key}"]


@pytest.mark.parametrize("kind,mode", CASES)
def test_each_rank_holds_only_its_shards_and_never_the_whole_model(ranks, kind, mode):
    """Before materialisation every parameter is meta; after it, a rank holds exactly what the plain
    build sharded the same way holds (FSDP: half of every tensor; TP+SP: half of the split tensors
    plus the replicated norms and position embedding), and the peak of the floating-point storage
    allocated while materialising is the local shards plus at most ONE full parameter (plus the
    rotary tables, whole on every rank as the plain build's, where the model has them)."""
    key = f"{kind}/{mode}"
    total = ranks[0][f"param_bytes/{kind}"]
    for results in ranks:
        local = results[f"local_bytes/{key}"]
        assert results[f"meta_before/{key}"]
        assert local == results[f"plain_local_bytes/{key}"]
        if mode == "fsdp":  # every dim 0 of the tiny model is even: exactly half
            assert local == total // 2
            assert total == 4 * stage_parameters(tiny(kind, bias=False))  # the memory model's count
        else:
            assert total // 2 < local < 0.6 * total
            assert local == 4 * stage_parameters(tiny(kind, bias=False), tp=2)
        tables = results[f"table_bytes/{key}"]  # the rotary tables (all but "gpt", "bert"; the mask is bool)
        assert (tables > 0) == (kind in ("llama", "qwen3", "olmo"))
        bound = local + results[f"largest_param_bytes/{kind}"] + tables
        assert local < results[f"peak_bytes/{key}"] <= bound < local + total


@pytest.mark.parametrize("kind,mode", CASES)
def test_training_from_the_meta_start_equals_one_process(ranks, kind, mode):
    """The first and the next LAMB steps' losses equal the one-process run's (selective recompute on)."""
    for results in ranks:
        assert results[f"loss_rel_err/{kind}/{mode}"] < 1e-5


def test_a_parameter_the_constructor_never_fills_is_refused():
    """A parameter made from values (not filled in place by torch.nn.init) cannot be rebuilt from a
    meta build: refused by name before any sharding."""

    def build():
        model = build_model(tiny("gpt"))
        model.scale = torch.nn.Parameter(torch.ones(3))
        return model

    with pytest.raises(ValueError, match="parameter scale is never filled in place"):
        build_on_meta(build)


def test_a_tie_between_plain_parameters_stays_one_tensor_with_the_one_process_values():
    """``to_empty`` replaces a plain (not DTensor) meta parameter by a new object, once per module
    that holds it (one process: nothing sharded). The tie is restored: the output layer is the
    embedding, and every value and the generator's end state are the one-process build's."""
    torch.manual_seed(0)
    model, log = build_on_meta(lambda: build_model(tiny("gpt")))
    materialize(model, log, torch.device("cpu"))
    after = torch.get_rng_state()
    torch.manual_seed(0)
    reference = build_model(tiny("gpt"))
    assert model.lm_head.weight is model.tok_emb.weight
    assert reference.lm_head.weight is reference.tok_emb.weight
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    assert torch.equal(after, torch.get_rng_state())


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_stages_start_on_meta_with_the_one_process_values_and_only_their_stage(ranks, kind):
    """pp = 2: each rank holds only its stage's parameters (the embeddings on rank 0, the output on
    rank 1), equal to the one-process build exactly; the generator ends where that build leaves it
    (the dropped stage's inits were replayed too); materialising peaks at the stage plus one full
    parameter; the causal masks of the kept blocks are rebuilt."""
    key = f"pp/{kind}"
    held = [set(results[f"names/{key}"]) for results in ranks]
    assert not held[0] & held[1]  # no parameter on both ranks
    assert any(n.startswith("blocks.0.") for n in held[0]) and any(n.startswith("blocks.1.") for n in held[1])
    assert sum(results[f"stage_bytes/{key}"] for results in ranks) == ranks[0][f"param_bytes/{key}"]
    for results in ranks:
        local = results[f"local_bytes/{key}"]
        assert results[f"param_diff/{key}"] == 0.0
        assert results[f"rng_same/{key}"] and results[f"mask_ok/{key}"] and results[f"names_same/{key}"]
        assert results[f"rotary_ok/{key}"]
        assert local == results[f"stage_bytes/{key}"] == results[f"plain_local_bytes/{key}"]
        assert local < results[f"param_bytes/{key}"]
        tables = results[f"table_bytes/{key}"]  # the kept blocks' rotary tables ("llama")
        assert local <= results[f"peak_bytes/{key}"] <= local + results[f"largest_param_bytes/{key}"] + tables
    first = ranks[0][f"local_bytes/{key}"]  # the memory model counts the first stage's parameters
    assert first == 4 * stage_parameters(replace(tiny(kind), tie_embeddings=False), pp=2)


def test_fsdp_over_tensor_parallel_on_a_2d_mesh_equals_one_process(tmp_path):
    """4 ranks (dp 2 x tp 2, FSDP2 over TP+SP): parameters laid out as strided shards over the
    tensor-parallel shards still equal the one-process build exactly. Then pp 2 x tp 2 (TP+SP
    within each stage) started on meta: each rank holds its stage's tensor-parallel shards only,
    equal to the one-process build exactly."""
    spawn(cases.run_2d, 4, str(tmp_path))
    for rank in range(4):
        results = json.loads((tmp_path / f"results_rank{rank}.json").read_text())
        for kind in KINDS:
            assert results[f"param_diff/{kind}"] == 0.0 and results[f"rotary_ok/{kind}"]
            assert any("_StridedShard" in p for p in results[f"placements/{kind}"])
            key = f"pp_tp/{kind}"
            assert results[f"param_diff/{key}"] == 0.0
            assert results[f"rng_same/{key}"] and results[f"mask_ok/{key}"] and results[f"names_same/{key}"]
            assert results[f"rotary_ok/{key}"]
            assert results[f"local_bytes/{key}"] == results[f"plain_local_bytes/{key}"]
            assert results[f"local_bytes/{key}"] < results[f"stage_bytes/{key}"] < results[f"param_bytes/{key}"]
            if "tok_emb.weight" in results[f"names/{key}"]:  # a first-stage rank: the memory model's count
                untied = replace(tiny(kind), tie_embeddings=False)
                assert results[f"local_bytes/{key}"] == 4 * stage_parameters(untied, tp=2, pp=2)
