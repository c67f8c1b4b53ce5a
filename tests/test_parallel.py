"""largebatch.parallel with REAL processes: 2 gloo ranks, 1 thread each, spawned ONCE for all the
cases of tests/parallel_cases.py (each spawn costs seconds); the tests below assert on what the
ranks measured. Single-process checks (config, world size 1, batch split, 2 -> 1 resume) run here.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

import parallel_cases as cases
from largebatch.checkpoint.distributed import latest_distributed_checkpoint, load_distributed
from largebatch.models import build_model
from largebatch.optim import LAMB, param_groups
from largebatch.parallel import ParallelConfig, ParallelState, init_distributed, parallelize, spawn
from largebatch.parallel.batch import micro_batches_per_rank
from largebatch.parallel.mesh import resolve_sizes

TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    spawn(cases.run_all, 2, str(out))
    results = [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]
    return out, results


@pytest.mark.parametrize("kind, mode", [(kind, mode) for kind in ("gpt", "bert", "llama", "qwen3", "olmo", "neox")
                                        for mode in cases.MODES]
                         + [(kind, mode) for kind in ("gpt-docs", "bert-docs") for mode in cases.DOCS_MODES]
                         + [("llama-window", mode) for mode in cases.WINDOW_MODES])
def test_forward_backward_matches_single_process(ranks, kind, mode):
    """*_loss: with the vocabulary-parallel cross-entropy (logits never gathered). "llama": the GPT
    with RMSNorm, rotary positions, the SwiGLU MLP (mlp.gate split by columns as fc1) and 2 K/V heads
    for 4 query heads (one K/V head and its 2 query heads per tp rank). "qwen3": those layers with
    heads of 12 values and each query and key head normalised (the norms' gains summed over the tp
    ranks' heads). "olmo": those layers with each sub-layer's output normalised (norm_position
    "reordered") and the whole q and k projections normalised (each tp rank holds half of each
    projection and of its gain; the statistic is summed over the ranks). "neox": GPT-NeoX's layer, the
    attention and the MLP in parallel on the layer input (under sequence parallel both norms read the
    rank's part of the sequence), a quarter of each head rotated. "*-docs": attention within
    the documents of packed rows (model.document_mask; learned positions restarting at each).
    "llama-window": a sliding window of 5 of the 16 positions on layer 0 (model.sliding_window)."""
    for rank_results in ranks[1]:
        assert rank_results[f"fwd_bwd/{kind}/{mode}"] < TOL
        if mode not in ("ddp", "fsdp"):
            assert rank_results[f"loss/{kind}/{mode}"] < TOL
            vocab = cases.tiny().vocab_size
            per_rank = vocab // 2 if "loss" in mode else vocab  # gathered unless vocabulary-parallel
            assert rank_results[f"logits_vocab_per_rank/{kind}/{mode}"] == per_rank


@pytest.mark.parametrize("mode", ["tp", "sp", "tp_loss", "sp_loss"])
def test_projection_qk_norm_gains_are_split_with_the_projections_under_tensor_parallel(ranks, mode):
    """OLMo 2's query and key norms (model.qk_norm_scope="projection") under tp = 2: each gain is a
    Shard(0) DTensor holding this rank's half (q: 4 heads of 12 -> 24 values, k: 2 of 12 -> 12), its
    gradient Shard(0) too (whole for the values it holds: no sum over the ranks needed), and the
    gradients equal one process's (test_forward_backward_matches_single_process: "olmo")."""
    for rank_results in ranks[1]:
        assert rank_results[f"olmo_qk_gains/{mode}"] == [["(Shard(dim=0),)", "(Shard(dim=0),)", [12]],
                                                        ["(Shard(dim=0),)", "(Shard(dim=0),)", [24]]]


def test_ddp_sends_no_buffers_before_each_forward_unless_one_is_persistent(ranks):
    """DDP sent every buffer from rank 0 before every forward: the causal mask (bool, s^2 a layer)
    and the rotary cos/sin tables (fp32, 2 s d a layer), constants of the config equal on every rank.
    A persistent buffer (a model's own state) is still sent, the whole of it, before each forward, and
    so is a non-persistent buffer that no module's init_buffers rebuilds (a user's running scale)."""
    for rank_results in ranks[1]:
        key = "ddp_buffers/{}/{}"
        T, d, layers = cases.T, 32 // 4, 2
        assert rank_results[key.format("gpt", "buffer_bytes")] == layers * T * T  # the masks
        assert rank_results[key.format("llama", "buffer_bytes")] == layers * (T * T + 2 * T * d * 4)
        assert rank_results[key.format("gpt", "broadcast_bytes")] == []
        assert rank_results[key.format("llama", "broadcast_bytes")] == []
        everything = layers * T * T + 3 * 4
        assert rank_results[key.format("persistent", "broadcast_bytes")] == [everything, everything]
        assert rank_results[key.format("users", "broadcast_bytes")] == [everything, everything]


@pytest.mark.parametrize("mode", ["tp", "sp", "tp_loss", "sp_loss"])
def test_rmsnorm_gain_gradients_are_summed_over_the_sequence_parallel_ranks(ranks, mode):
    """Under sequence parallel an RMSNorm sees only this rank's tokens: backward leaves each gain's
    gradient a partial sum (a Partial(sum) DTensor, as a LayerNorm's), off the one-process gradient
    by O(1) on each rank; what the optimizers, the gradient norm and clipping read (local_grad) is
    the all-reduced sum, the one-process gradient. Without sequence parallel the norms run whole.
    The query and key heads' norms (qk_norm) see only this rank's heads under any tensor parallel."""
    for rank_results in ranks[1]:
        key = f"norm_gains/{mode}"
        assert rank_results[f"{key}/names"] == ["blocks.0.ln1.weight", "blocks.0.ln2.weight", "blocks.1.ln1.weight",
                                                "blocks.1.ln2.weight", "ln_f.weight"]
        assert rank_results[f"{key}/optimizer_reads"] < TOL
        if mode.startswith("sp"):
            assert rank_results[f"{key}/grad_placements"] == ["(Partial(sum),)"]
            assert rank_results[f"{key}/local_before_reduce"] > 0.1
        else:
            assert rank_results[f"{key}/grad_placements"] == ["(Replicate(),)"]
            assert rank_results[f"{key}/local_before_reduce"] < TOL
        # the query and key heads' norms (qk_norm): each rank's gain gradient sums over its own heads
        # under tensor parallel with or without sequence parallel, and must be summed over the ranks
        key = f"qk_gains/{mode}"
        assert rank_results[f"{key}/names"] == [f"blocks.{i}.attn.{n}_norm.weight" for i in (0, 1) for n in "qk"]
        assert rank_results[f"{key}/grad_placements"] == ["(Partial(sum),)"]
        assert rank_results[f"{key}/local_before_reduce"] > 0.1
        assert rank_results[f"{key}/optimizer_reads"] < TOL


def test_llama_layers_under_pipeline_stages_lamb_and_a_checkpoint_across_layouts(ranks):
    """The Llama-style GPT: pp = 2 (1F1B) gives the one-process loss and every held parameter's
    gradient, the two stages together holding every parameter once; two LAMB steps under tp = 2 +
    SP equal one process's; a DCP checkpoint written under tp = 2 + SP loads under FSDP2 (dp = 2)
    and under pp = 2 bit for bit (parameters and optimizer state), and FSDP2's next step from it is
    the tp + SP run's next step."""
    _, results = ranks
    held = [set(r["llama/pp/held"]) for r in results]
    everything = {n for n, _ in build_model(replace(cases.tiny("llama"), tie_embeddings=False)).named_parameters()}
    assert not held[0] & held[1] and held[0] | held[1] == everything
    assert "blocks.0.mlp.gate.weight" in held[0] and "blocks.1.mlp.gate.weight" in held[1]
    for rank_results in results:
        assert rank_results["llama/pp/loss"] < TOL and rank_results["llama/pp/grad"] < TOL
        assert rank_results["llama/optim/lamb/sp"] < TOL
        assert rank_results["llama/dcp/sp_to_fsdp/extra"]
        assert rank_results["llama/dcp/sp_to_fsdp/max_diff"] == 0.0
        assert rank_results["llama/dcp/sp_to_pp/max_diff"] == 0.0
        assert rank_results["llama/dcp/sp_to_fsdp/next_step"] < TOL


def test_sequence_parallel_keeps_the_shard_for_the_gated_mlps_two_column_linears(ranks):
    """The Llama-style block under SP: gate and fc1 read the MLP's one gathered input, as q, k and v
    read attention's, and the sub-layer keeps its sequence shard in place of it (in fp32: s/t of
    each of the two inputs instead of all of it; under bf16 autocast, where torch keeps a bf16 copy
    per linear, 5 of them, the fp32 shard once per sub-layer). The gradients are torch's own."""
    t, s, b, h, fp32 = 2, cases.T, cases.B, 32, 4
    key = "llama/sp_regather={}/autocast={}/block"
    for rank_results in ranks[1]:
        assert rank_results[key.format(False, False)] - rank_results[key.format(True, False)] == \
            2 * (s * b * h * fp32) * (1 - 1 / t)
        assert rank_results[key.format(False, True)] - rank_results[key.format(True, True)] == \
            5 * s * b * h * 2 - 2 * (s * b * h * fp32) / t
        for autocast in (False, True):
            assert rank_results[f"llama/sp_regather/autocast={autocast}/grad_diff"] == 0.0


def test_llama_checkpoint_from_tensor_and_sequence_parallel_loads_on_one_process(ranks):
    """The tp = 2 + SP checkpoint of the Llama-style GPT on one process: every parameter and LAMB
    state tensor bit for bit, and the next step is the 2-rank run's next step."""
    from dataclasses import replace

    out, _ = ranks
    saved = torch.load(out / "llama_sp_expected.pt", weights_only=False)
    torch.manual_seed(123)
    model = build_model(replace(cases.tiny("llama"), tie_embeddings=False))
    opt = LAMB(param_groups(model, weight_decay=0.01), lr=0.02)
    state = init_distributed(ParallelConfig())
    assert load_distributed(saved["path"], model, opt, state) == {"step": 1}
    _loaded_state_and_next_step_as_two_ranks(saved, model, opt, state, "llama")


@pytest.mark.parametrize("kind", ["gpt", "gpt-docs"])
@pytest.mark.parametrize("mode", ["sp", "fsdp"])
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recomputation_composes_with_sharding(ranks, kind, mode, policy):
    for rank_results in ranks[1]:
        assert rank_results[f"recompute/{kind}/{mode}/{policy}"] < TOL


@pytest.mark.parametrize("name", ["lamb", "lans", "lars", "adamw"])
@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_two_optimizer_steps_equal_unsharded(ranks, name, mode):
    for rank_results in ranks[1]:
        assert rank_results[f"optim/{name}/{mode}"] < TOL


@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_sharded_lamb_step_matches_float64_formula_and_needs_the_reduction(ranks, mode):
    for rank_results in ranks[1]:
        assert rank_results[f"optim/lamb_float64/{mode}/reduced"] < 1e-6
        assert rank_results[f"optim/lamb_float64/{mode}/default"] < 1e-6  # DTensors: their meshes' sum
        # without summing the squared norms over shards the ratios are per-shard: a different algorithm
        assert rank_results[f"optim/lamb_float64/{mode}/unreduced"] > 1e-5


def test_one_all_reduce_per_group_and_norm_stage(ranks):
    """LAMB: ||x|| and ||r|| of every tensor of an adapted group in ONE all-reduce (groups without
    a trust ratio need none). LANS: ||g|| of every group first (it normalises the gradient before the
    moments), then ||x||, ||r||, ||c|| of an adapted group together."""
    for rank_results in ranks[1]:
        calls, groups, adapted = rank_results["all_reduces/lamb"]
        assert adapted >= 1 and calls == adapted
        calls, groups, adapted = rank_results["all_reduces/lans"]
        assert calls == groups + adapted


@pytest.mark.parametrize("mode", ["tp", "sp", "fsdp", "ddp"])
def test_global_grad_norm_and_clipping(ranks, mode):
    for rank_results in ranks[1]:
        assert rank_results[f"grad_norm/{mode}"] < 1e-6  # relative to the float64 single-process norm
        assert rank_results[f"grad_norm_clipped/{mode}"] < 1e-5  # clipped to max_norm = 0.5
        checks = {"tp": 3, "sp": 3, "fsdp": 2, "ddp": 1}[mode]
        assert rank_results[f"grad_norm_nonfinite_anywhere/{mode}"] == [True] * checks


def test_sequence_parallel_divides_norm_and_dropout_activations_by_t(ranks):
    """docs/papers.md: memory: LayerNorm inputs and dropout masks are stored whole under tensor parallel
    alone (the 10sbh term is not divided by t) and divided by t with sequence parallel; and so are
    the inputs of the column-parallel linears (q/k/v and fc1, 2sbh each at 16 bits), which keep
    their sequence shard and gather it again in backward (torch alone kept the gathered input)."""
    t = 2
    s, b, h = cases.T, cases.B, 32
    fp32, mask = 4, 1  # bytes: the test runs in fp32; masks are bool
    ln_tp = s * b * h * fp32 + 2 * s * b * fp32  # LayerNorm input + its per-token mean and rstd
    drop_tp = s * b * h * mask
    expected_tp = {"ln1": ln_tp, "ln2": ln_tp, "attn.drop": drop_tp, "mlp.drop": drop_tp}
    for rank_results in ranks[1]:
        for region, tp_bytes in expected_tp.items():
            assert rank_results[f"memory/tp/{region}"] == tp_bytes
            assert rank_results[f"memory/sp/{region}"] * t == tp_bytes
        # the rest of the paper's 10sbh(1 - 1/t): the two gathered linear inputs, kept as shards
        region_saving = sum(tp_bytes - rank_results[f"memory/sp/{r}"] for r, tp_bytes in expected_tp.items())
        linear_inputs = 2 * s * b * h * fp32
        assert region_saving == (2 * ln_tp + 2 * drop_tp) * (1 - 1 / t)
        assert rank_results["memory/tp/block"] - rank_results["memory/sp/block"] == \
            region_saving + linear_inputs * (1 - 1 / t)
        # against torch's own sequence parallel (the gathered input saved): in fp32 each sub-layer
        # keeps s/t of its input instead of all of it; under bf16 autocast each linear (q, k, v; fc1)
        # saved its own bf16 copy of the whole input, where the fp32 shard is kept once per sub-layer
        key = "memory/sp_regather={}/autocast={}/block"
        fp32_saving = 2 * (s * b * h * fp32) * (1 - 1 / t)
        bf16_saving = (4 * s * b * h * 2) - 2 * (s * b * h * fp32) / t
        assert rank_results[key.format(False, False)] - rank_results[key.format(True, False)] == fp32_saving
        assert rank_results[key.format(False, True)] - rank_results[key.format(True, True)] == bf16_saving
        # the gather again, started early (prefetch: none is waited for where the linears need it)
        # or where the first linear needs it (one per sub-layer); the same gradients either way
        layers = 2
        for autocast in (False, True):
            for kind, waited in (("prefetch", 0), ("on_demand", 2 * layers)):
                assert rank_results[f"memory/sp_regather/{kind}/autocast={autocast}/waited_gathers"] == waited
                assert rank_results[f"memory/sp_regather/{kind}/autocast={autocast}/grad_diff"] == 0.0
            assert rank_results[f"memory/sp_regather/torch/autocast={autocast}/waited_gathers"] == 0


def test_the_output_layer_keeps_its_gathered_input_as_the_memory_model_counts(ranks):
    """Under sequence parallel the final norm's input is split by t, while the output layer
    all-gathers the sequence and keeps the whole input for its weight gradient: the memory model
    divided both by t (s b h d (1 - 1/t) short on every rank); the change from tp to tp + sp is now
    the model's."""
    from largebatch.memory.activations import stage_activation_bytes

    t, s, b, h, fp32 = 2, cases.T, cases.B, 32, 4
    config = cases.tiny("gpt", dropout=0.1)

    def model(sp: bool) -> float:  # per rank: dp = 1 in both meshes, the whole batch on each rank
        return stage_activation_bytes(config, b, 0, first=False, last=True, tp=t, sequence_parallel=sp,
                                      dtype_bytes=fp32, device="cpu")

    stats = 2 * s * b * fp32  # a LayerNorm's per-token mean and rstd, which the model does not count
    for rank_results in ranks[1]:
        for mode in ("tp", "sp"):
            assert rank_results[f"memory/{mode}/lm_head"] == s * b * h * fp32  # the whole sequence
        assert rank_results["memory/tp/ln_f"] == s * b * h * fp32 + stats
        assert rank_results["memory/sp/ln_f"] == (s * b * h * fp32 + stats) / t
        measured = sum(rank_results[f"memory/sp/{r}"] - rank_results[f"memory/tp/{r}"] for r in cases.OUTPUT_REGIONS)
        assert measured + stats * (1 - 1 / t) == model(True) - model(False) == -s * b * h * fp32 * (1 - 1 / t)


def test_noise_scale_inputs_from_local_and_all_reduced_norms(ranks):
    """The small-batch input is the mean over dp ranks of each rank's own mean-gradient norm^2
    (float64 reference per half). With BERT's uneven target counts the trainer's loss scale has
    to be undone per rank: without that the input is off (by 0.5% here)."""
    for rank_results in ranks[1]:
        for kind in ("gpt", "bert"):
            assert rank_results[f"noise/{kind}/mean_small_rel_err"] < 1e-6, kind
            first, rebuilt, same_grads = rank_results[f"noise/{kind}/local_norm_bits_after_rebuild"]
            assert same_grads and first == rebuilt, (kind, first, rebuilt)  # whatever DDP's bucket layout
            assert rank_results[f"noise/{kind}/batches"] == [cases.B // 2, cases.B]
        counts = rank_results["noise/bert/target_counts"]
        assert counts[0] != counts[1], counts  # the case needs uneven halves to mean anything
        assert rank_results["noise/bert/uncorrected_rel_err"] > 1e-3  # (0.5% here)


def test_fsdp_mixed_precision_computes_in_bf16_and_reduces_in_fp32(ranks):
    for rank_results in ranks[1]:
        assert rank_results["mp/forward_param_dtype"] == "torch.bfloat16"
        assert rank_results["mp/reduce_dtypes"] == ["torch.float32"]  # every reduce-scatter
        assert rank_results["mp/sharded_dtypes"] == ["torch.float32"]  # parameters and gradients
        assert rank_results["mp/loss_rel_err"] < 1e-2  # bf16 sums over half-batches vs the whole


@pytest.mark.parametrize("mode", ["fsdp", "sp"])
def test_two_rank_resume_continues_exactly(ranks, mode):
    for rank_results in ranks[1]:
        assert rank_results[f"resume/{mode}/extra_ok"]
        assert rank_results[f"resume/{mode}/max_diff"] == 0.0


@pytest.mark.parametrize("mode", ["fsdp", "sp"])
def test_checkpoint_from_two_ranks_resumes_on_one(ranks, mode):
    out, _ = ranks
    saved = torch.load(out / f"{mode}_expected.pt", weights_only=False)
    assert latest_distributed_checkpoint(out / mode).name == "step_00000001.dcp"
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = build_model(cases.tiny("gpt"))
    opt = LAMB(param_groups(model, weight_decay=0.01), lr=0.02)
    state = init_distributed(ParallelConfig())  # world size 1: no process group
    extra = load_distributed(saved["path"], model, opt, state)
    assert extra == {"step": 1, "mode": mode}
    # and the next step on 1 process is the 2-rank run's next step
    _loaded_state_and_next_step_as_two_ranks(saved, model, opt, state, "gpt")


def test_dropout_streams_differ_across_replicas_and_match_within_tensor_parallel(ranks):
    for rank_results in ranks[1]:
        assert rank_results["seed/tp/same_draw_on_both_ranks"]  # replicated regions need equal masks
        assert not rank_results["seed/ddp/same_draw_on_both_ranks"]


def test_the_best_token_of_vocabulary_split_logits_is_the_whole_logits_argmax(ranks):
    """The evaluation's accuracy under the vocabulary-parallel loss: no gather of the logits, and
    torch.argmax's choice (the lowest id) where the maximum sits on both ranks' slices."""
    for rank_results in ranks[1]:
        for dims in ("2d", "3d"):
            assert rank_results[f"argmax/{dims}/equal"]
            assert rank_results[f"argmax/{dims}/ties_across_ranks"] > 0  # the case that needs the rule


def test_cached_decoding_on_sharded_models_gives_one_process_logits_and_tokens(ranks):
    """The end-of-run sample's decoding (GPT.decode with a KVCache) on tensor-parallel (with and
    without the vocabulary-parallel loss) and FSDP2 models: one process's logits and greedy tokens,
    within documents, within a sliding window, and with OLMo 2's projection-wide query and key norms
    (their statistic summed over the tp ranks at each decoded position) too."""
    for rank_results in ranks[1]:
        for kind in ("gpt", "llama", "olmo", "gpt-docs", "llama-window"):
            for mode in ("tp", "tp_loss", "fsdp"):
                assert rank_results[f"generate/{kind}/{mode}/logits"] < 1e-5, (kind, mode)
                assert rank_results[f"generate/{kind}/{mode}/same_tokens"], (kind, mode)
                assert rank_results[f"generate/{kind}/{mode}/cached"], (kind, mode)


# ------------------------------------------------------------------------------ single process
def test_world_size_one_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state = init_distributed(ParallelConfig(dp_mode="fsdp"))
    assert (state.rank, state.world_size, state.dp_size, state.tp_size, state.mesh) == (0, 1, 1, 1, None)
    torch.manual_seed(0)
    model = build_model(cases.tiny("gpt"))
    reference = copy.deepcopy(model)
    assert parallelize(model, state) is model
    for a, b in zip(model.parameters(), reference.parameters()):
        assert type(a) is torch.nn.Parameter and torch.equal(a, b)


@pytest.mark.parametrize("kwargs, field", [
    ({"tp": 0}, "parallel.tp"), ({"dp": -1}, "parallel.dp"), ({"dp_mode": "zero3"}, "parallel.dp_mode"),
    ({"backend": "mpi"}, "parallel.backend"), ({"timeout_s": 0}, "parallel.timeout_s"),
    ({"sequence_parallel": True}, "sequence_parallel"), ({"loss_parallel": True}, "loss_parallel"),
    ({"tp": 2, "dp": 2}, "dp_mode"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_mesh_sizes_must_match_the_launch():
    assert resolve_sizes(ParallelConfig(tp=2, dp_mode="fsdp"), 8) == (1, 4, 2)
    with pytest.raises(ValueError, match="set parallel.dp_mode = 'fsdp'"):
        resolve_sizes(ParallelConfig(tp=2), 8)
    with pytest.raises(ValueError, match="parallel.tp = 3 does not divide the 4 processes"):
        resolve_sizes(ParallelConfig(tp=3), 4)
    with pytest.raises(ValueError, match="2 x 1 = 2, but 4 processes"):
        resolve_sizes(ParallelConfig(dp=2), 4)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use 'gloo'"):
            init_distributed(ParallelConfig(backend="nccl"))


def test_micro_batches_per_rank():
    assert micro_batches_per_rank(64, 8, 2) == 4
    with pytest.raises(ValueError, match=r"multiples of 16\): use a batch of 48 or 64"):
        micro_batches_per_rank(56, 8, 2)


def test_tensor_parallel_size_must_divide_the_model():
    from largebatch.parallel.tensor_parallel import check_divisible

    model = build_model(cases.tiny("gpt"))  # 4 heads, vocab 64
    with pytest.raises(ValueError, match="does not divide model.n_head = 4: choose parallel.tp among"):
        check_divisible(model, 3, False)
    # grouped-query attention: k and v are split by whole K/V heads
    mqa = build_model(replace(cases.tiny("llama"), n_kv_head=1))
    with pytest.raises(ValueError, match=r"parallel.tp = 2 does not divide model.n_kv_head = 1: choose parallel.tp "
                                         r"among the divisors of 1, or change model.n_kv_head"):
        check_divisible(mqa, 2, False)
    check_divisible(build_model(cases.tiny("llama")), 2, True)  # 2 K/V heads over 2 ranks
    state = ParallelState()
    assert state.describe().startswith("rank 0/1 (dp 0/1, tp 0/1)")


def test_fsdp_over_tensor_and_sequence_parallel_on_a_2d_mesh(tmp_path):
    """4 ranks, mesh dp 2 x tp 2: FSDP2 shards the tensor-parallel DTensors again (2-D)."""
    spawn(cases.run_2d, 4, str(tmp_path))
    for rank in range(4):
        results = json.loads((tmp_path / f"results2d_rank{rank}.json").read_text())
        assert "Shard" in results["placements"] and results["placements"].count("Shard") == 2
        assert results["fwd_bwd"] < TOL
        assert results["grad_norm"] < 1e-6
        assert results["lamb"] < TOL
        assert (tmp_path / f"group_alive_at_exit_rank{rank}.txt").read_text() == "False"
    saved = torch.load(tmp_path / "2d_expected.pt", weights_only=False)
    model = build_model(cases.tiny("gpt", bias=False))
    load_distributed(saved["path"], model, None, init_distributed(ParallelConfig()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), saved["model"][name], rtol=0, atol=0)


def test_saved_activation_bytes_counts_saved_inputs_not_parameters():
    from largebatch.parallel.measure import saved_activation_bytes

    lin = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    (y, saved) = saved_activation_bytes(lambda: torch.relu(lin(x)), lin)
    assert saved == 4 * 8 * 4 + 4 * 16 * 4  # the linear's input and the relu's output, fp32


def test_peak_saved_bytes_leave_nothing_alive_after_a_retained_graph():
    """Zero bubble's input-gradient step retains the graph; a saved output (the relu's) that the hook
    returned as itself would close a cycle through its grad_fn and outlive the step."""
    from largebatch.parallel.measure import saved_activation_profile

    lin = torch.nn.Linear(8, 16)

    def run():
        x = torch.randn(4, 8, requires_grad=True)
        y = torch.relu(lin(x)).sum()
        torch.autograd.grad(y, x, retain_graph=True)  # the input gradient, the weights' graph kept
        return None

    _, peak, alive = saved_activation_profile(run, lin)
    assert peak == 4 * 8 * 4 + 4 * 16 * 4 and alive() == {}


def test_compiled_blocks_under_tensor_and_sequence_parallel(ranks):
    """The GPT, and OLMo 2's layers, whose projection norms all-reduce their statistic (they crashed
    compiled: the collective and the split gain in a compiled frame), give one process's gradients."""
    for rank_results in ranks[1]:
        for suffix in ("", "/olmo"):
            assert rank_results[f"compile/all_blocks_compiled{suffix}"]
            assert rank_results[f"compile/grad_diff{suffix}"] < TOL


def test_the_trainer_quiets_fsdps_view_warning_and_nothing_else():
    """FSDP2 with tensor parallel warned, on every rank of every run, that a block "returned a view
    tensor" and that an in-place op on it would give wrong gradients; the trainer's blocks are used
    out of place only. The filter matches torch's message (as torch 2.13 words it) and no other."""
    import warnings

    from largebatch.parallel import quiet_fsdp_view_warning

    torch_message = ("FSDP2-wrapped module (FSDPBlock) returned a view tensor. An in-place op on this view "
                     "(e.g., `x += y`) will silently drop the pre-backward hook and skip the all-gather, which "
                     "can cause backward to fail or produce wrong gradients.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_fsdp_view_warning()
        warnings.warn(torch_message, UserWarning)
        warnings.warn("FSDP2 requires something else", UserWarning)
    assert [str(w.message) for w in caught] == ["FSDP2 requires something else"]


def test_shutdown_leaves_a_process_group_the_caller_made(tmp_path):
    """``largebatch train``'s end (parallel.shutdown) destroyed the default group even when the caller
    had made it before: its later collectives then failed. Only a group init_distributed joined is
    left (a one-process gloo group here, made as a user's script makes it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from largebatch.parallel import shutdown

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        shutdown(ParallelState(mesh=init_device_mesh("cpu", (1,))))
        assert dist.is_initialized()
        total = torch.ones(2)
        dist.all_reduce(total)  # the caller's group still works
        assert total.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def _loaded_state_and_next_step_as_two_ranks(saved: dict, model, opt, state, kind: str) -> None:
    """The parameters and optimizer state one process loaded equal the 2-rank run's to the bit, and
    its next step on the same batch is that run's next step."""
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), saved["expected"]["model"][name], rtol=0, atol=0)
        for key, value in saved["expected"]["optim"][name].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=0, atol=0)
    idx, targets = cases.batch(kind)
    cases.loss_and_backward(model, state, idx, targets)
    opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), saved["after_two"][name], rtol=0, atol=TOL)
