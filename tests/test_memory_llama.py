"""The memory model of the Llama-style layer options (RMSNorm, rotary positions, the SwiGLU MLP,
grouped-query attention; largebatch.models.layers) against an independent float64 transcription of
the per-layer formula (docs/papers.md: memory; Korthikanti et al. 2022, Table 2, extended) and against
the bytes a real tiny model keeps for backward (largebatch.memory.measure, on CPU), under recompute
none / selective / op / full; the parameter count against the built model's."""

from __future__ import annotations

import itertools

import pytest
import torch

from largebatch.memory import (
    activation_bytes_per_layer,
    apply_recompute,
    config_layer_kwargs,
    estimate,
    measure_forward_bytes,
    model_activation_bytes,
)
from largebatch.memory.estimate import stage_parameters
from largebatch.models import BERT, GPT, ModelConfig
from largebatch.models.kinds import block_tp_plan

LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", ffn_hidden=96, n_kv_head=2)
OPTIONS = {
    "head_size": dict(head_size=24),  # heads of 24 on a 64-wide stream of 4 heads
    "qk_norm": dict(qk_norm=True),  # LayerNorm over each head (the model's norm)
    "qwen3": dict(LLAMA, head_size=24, qk_norm=True),
    # OLMo 2: each sub-layer's output normalised, the whole q (96 values) and k (48) projections normalised
    "olmo": dict(LLAMA, head_size=24, qk_norm=True, qk_norm_scope="projection", norm_position="reordered"),
    # GPT-NeoX (Pythia): attention and MLP in parallel on the layer input, a quarter of each head rotated
    "neox": dict(position="rope", rope_fraction=0.25, norm_position="parallel"),
    "rmsnorm": dict(norm="rmsnorm"),
    "rope": dict(position="rope"),
    "swiglu": dict(activation="swiglu", ffn_hidden=96),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "llama": LLAMA,
}
S, B, H, A = 64, 4, 64, 4
BASE = dict(n_embd=H, n_head=A, seq_len=S, vocab_size=32, bias=False)


def reference_layer(c: ModelConfig, s: int, b: int, d: float, policy: str, *, t: int = 1, sp: bool = False,
                    dropout: bool, fused: bool) -> float:
    """Bytes one layer keeps, written in float64 from the formula of docs/papers.md (memory, the
    Llama-style terms), not from the code under test: per token, at d bytes per value and 1-byte
    masks, with f = ffn, a_kv key/value heads, heads of d_h values (head_size; h / a by default),
    w = a d_h,
        replicated (/ t under sequence parallel): 2 norm inputs h d (LayerNorm or RMSNorm) + Q/K/V
            input h d + MLP input h d + 2 h masks
        split by t: Q w d, K and V 2 a_kv d_h d, projection input w d, with qk_norm the q and k
            norms' inputs (a + a_kv) d_h d and their per-head statistics (a + a_kv) 4 bytes
            (RMSNorm) or 8 (LayerNorm) (not under op), MLP 2 f d (GeLU: its input,
            fc2's input) or 4 f d (SwiGLU: gate output, SiLU output, fc1 output, fc2 input)
        with qk_norm_scope="projection" (OLMo 2) one 4-byte statistic a token for q and one for k
            in place of the per-head ones, whole on every rank (each rank's norm divides by the
            statistic of the whole projection)
        norm_position="reordered" keeps the same values: the norms' inputs are the sub-layers'
            outputs, and the Q/K/V and MLP inputs the stream itself
        norm_position="parallel" keeps one h d less: both norms read the layer input, kept once
        core (split by t): a s (2 d + 1) with dropout, a s d without, 4 a fused
    selective: all but the core; op: layer input, projection and fc2 outputs (3 h d, replicated), q,
    k, v, the attention output and the fc1 (and gate) outputs, the scores a s d (fused: 4 a); full:
    the layer input h d."""
    s, b, d, t = float(s), float(b), float(d), float(t)
    h, a, f, a_kv = float(c.n_embd), float(c.n_head), float(c.ffn), float(c.kv_heads)
    dh = h / a if c.head_size is None else float(c.head_size)
    gated = c.activation == "swiglu"
    t_rep = t if sp else 1.0
    m = 1.0 if dropout else 0.0
    if policy == "full":
        return s * b * h * d / t_rep
    if policy == "op":
        core = 4 * a if fused else a * s * d
        return s * b * (3 * h * d / t_rep + (2 * a * dh + 2 * a_kv * dh + (2 if gated else 1) * f) * d / t
                        + core / t)
    norm_inputs = 1 if c.norm_position == "parallel" else 2
    replicated = (norm_inputs * h * d + h * d + h * d + 2 * h * m) / t_rep
    projection = c.qk_norm and c.qk_norm_scope == "projection"
    qk = (a + a_kv) * (dh * d + (0.0 if projection else 4.0 if c.norm == "rmsnorm" else 8.0)) if c.qk_norm else 0.0
    split = (a * dh * d + 2 * a_kv * dh * d + a * dh * d + qk + (4 if gated else 2) * f * d) / t
    split += 2 * 4.0 if projection else 0.0
    core = 4 * a if fused else a * s * ((2 * d + m) if dropout else d)
    per_token = replicated + split + (0.0 if policy == "selective" else core / t)
    return s * b * per_token


def held_per_layer(config: ModelConfig, b: int, policies: tuple[str, ...], dtype: torch.dtype) -> dict[str, float]:
    """Measured bytes of one layer per policy: (3-layer model - 1-layer model) / 2, so the embedding
    and output terms and any constant overhead cancel (tests/test_memory.py does the same)."""
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (b, config.seq_len))
    held = {}
    for n_layer in (1, 3):
        model = GPT(config.replace(n_layer=n_layer)).to(dtype)
        for policy in policies:
            apply_recompute(model, policy)
            measure_forward_bytes(lambda: model(idx, idx))  # warm-up
            held[n_layer, policy] = measure_forward_bytes(lambda: model(idx, idx))[1].tensor_bytes
    return {p: (held[3, p] - held[1, p]) / 2 for p in policies}


POLICIES = ("none", "selective", "op", "full")
# (option, dtype, attention, dropout): every option alone and together in fp32 with dropout (the
# masks and the s^2 terms); the fused kernel (no s^2 term, the op policy's log-sum-exp); bf16,
# where an RMSNorm written op by op would keep an fp32 copy of its input
CASES = ([(name, torch.float32, "explicit", 0.1) for name in OPTIONS]
         + [(name, torch.float32, "sdpa", 0.0) for name in ("gqa", "llama", "qwen3", "olmo", "neox")]
         + [(name, torch.bfloat16, "explicit", 0.1) for name in ("rmsnorm", "llama", "qwen3", "olmo", "neox")])


@pytest.mark.parametrize("name, dtype, attention, dropout", CASES,
                         ids=[f"{n}-{str(d)[6:]}-{a}-{p}" for n, d, a, p in CASES])
def test_each_option_keeps_what_the_formula_counts(name, dtype, attention, dropout):
    c = ModelConfig(**BASE, **OPTIONS[name], attention=attention, dropout=dropout)
    d = 4 if dtype == torch.float32 else 2
    kw = config_layer_kwargs(c, dtype_bytes=d, device="cpu")
    measured = held_per_layer(c, B, POLICIES, dtype)
    for policy in POLICIES:
        reference = reference_layer(c, S, B, d, policy, dropout=dropout > 0, fused=attention == "sdpa")
        assert activation_bytes_per_layer(S, B, recompute=policy, **kw) == pytest.approx(reference, rel=1e-12), policy
        # measured within 1% (the norms' per-token statistics, 4-8 bytes, are not counted); each
        # option's own term is >= 3.5% of the layer's bytes here (a_kv = a/2: 4%, SwiGLU's 2 f d:
        # 13%; an RMSNorm keeping its normalised tensor too, h d per norm: 7%), so a term counted
        # wrong fails this
        assert measured[policy] == pytest.approx(reference, rel=0.01), (name, policy, measured[policy], reference)


def test_each_new_term_is_large_enough_for_the_measurement_to_see():
    """The 1% tolerance above would miss a term smaller than it: each option's term is >= 3.5% of
    its layer's bytes (no recompute, fp32, dropout), against the same layer without the option."""
    plain = ModelConfig(**BASE, dropout=0.1)
    for name in ("swiglu", "gqa", "head_size", "qk_norm", "neox"):
        c = plain.replace(**OPTIONS[name])
        without = plain.replace(ffn_hidden=c.ffn_hidden)
        new, old = (reference_layer(x, S, B, 4, "none", dropout=True, fused=False) for x in (c, without))
        assert abs(new - old) / new > 0.035, name


def test_rope_keeps_nothing_and_rmsnorm_keeps_what_layernorm_keeps():
    """Two claims verified by measurement, in bytes: rotary positions add nothing (fp32 and bf16: the
    tables are buffers, the rotation's multiplications keep only them; a partial rotation too); an
    RMSNorm keeps its input, as a LayerNorm: in bf16 exactly a LayerNorm's bytes (its fp32 1/rms, 4
    bytes a token, against LayerNorm's two bf16 statistics), in fp32 4 bytes a token less (one fp32 statistic, not two).
    Written op by op it kept 6 h bytes per token in bf16 (an fp32 copy of the input, the bf16
    normalised tensor), 8 h per token per norm in fp32 (the normalised tensor besides)."""
    plain = ModelConfig(**BASE, dropout=0.0)
    none = ("none",)
    layernorm = {dtype: held_per_layer(plain, B, none, dtype)["none"] for dtype in (torch.float32, torch.bfloat16)}
    for dtype in (torch.float32, torch.bfloat16):
        assert held_per_layer(plain.replace(position="rope"), B, none, dtype)["none"] == layernorm[dtype]
        # a quarter of each head rotated (GPT-NeoX) keeps nothing either, under sdpa too: its output keeps
        # the layout of its input, so the attention output's reshape stays a view (a concatenated one made
        # the output projection's input a copy, h values a token)
        partial = plain.replace(position="rope", rope_fraction=0.25)
        assert held_per_layer(partial, B, none, dtype)["none"] == layernorm[dtype]
        sdpa = [held_per_layer(c.replace(attention="sdpa"), B, none, dtype)["none"]
                for c in (plain.replace(position="rope"), partial)]
        assert sdpa[0] == sdpa[1]
    rms = {dtype: held_per_layer(plain.replace(norm="rmsnorm"), B, none, dtype)["none"]
           for dtype in (torch.float32, torch.bfloat16)}
    assert rms[torch.bfloat16] == layernorm[torch.bfloat16]
    assert rms[torch.float32] == layernorm[torch.float32] - 2 * 4 * S * B  # two norms a layer


@pytest.mark.parametrize("t, sp, layout", [(2, False, "llama"), (2, True, "llama"), (2, True, "qwen3"),
                                           (2, False, "olmo"), (2, True, "olmo")])
def test_tensor_parallel_splits_k_v_and_the_gate_by_t(t, sp, layout):
    """K and V (a_kv / t heads per rank) and the gate's outputs split by t (Qwen3's q and k norms'
    inputs too; OLMo 2's projection norms' statistics whole on each rank), the RMSNorm inputs
    replicated unless sequence parallel: the code against the reference, at the paper's 16 bits."""
    c = ModelConfig(**BASE, **OPTIONS[layout], dropout=0.1)
    kw = config_layer_kwargs(c, dtype_bytes=2)
    for policy in POLICIES:
        reference = reference_layer(c, S, B, 2, policy, t=t, sp=sp, dropout=True, fused=False)
        got = activation_bytes_per_layer(S, B, tp=t, sequence_parallel=sp, recompute=policy, **kw)
        assert got == pytest.approx(reference, rel=1e-12), policy
    with pytest.raises(ValueError, match=r"tp=4 does not divide kv_heads=2 \(model.n_kv_head\)"):
        activation_bytes_per_layer(S, B, tp=4, **kw)


def test_the_paper_notation_at_16_bits():
    """docs/papers.md's per-layer line for a Llama-style layer at 16 bits with dropout:
    s b (14 h + 4 h a_kv / a + 8 f) + 5 a s^2 b."""
    s, b, h, a, a_kv, f = 2048, 1, 4096, 32, 8, 14336
    c = ModelConfig(n_layer=1, n_embd=h, n_head=a, seq_len=s, vocab_size=32000, dropout=0.1, **{
        **LLAMA, "n_kv_head": a_kv, "ffn_hidden": f})
    got = activation_bytes_per_layer(s, b, **config_layer_kwargs(c, dtype_bytes=2))
    assert got == s * b * (14 * h + 4 * h * a_kv / a + 8 * f) + 5 * a * s * s * b
    gpt = ModelConfig(n_layer=1, n_embd=h, n_head=a, seq_len=s, vocab_size=32000, dropout=0.1)
    assert activation_bytes_per_layer(s, b, **config_layer_kwargs(gpt, dtype_bytes=2)) == \
        s * b * h * (34 + 5 * a * s / h)


def test_the_whole_model_with_its_final_rmsnorm_matches_the_measurement():
    """model_activation_bytes (blocks, embedding mask, final RMSNorm, output layer) against what the
    whole 2-layer model keeps, fp32 and bf16, and a BERT with RMSNorms (embedding, head)."""
    b = 4
    c = ModelConfig(n_layer=2, **BASE, **LLAMA, dropout=0.1)
    idx = torch.randint(0, c.vocab_size, (b, c.seq_len))
    for dtype, d in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = GPT(c).to(dtype)
        for policy in ("none", "full"):
            apply_recompute(model, policy)
            measure_forward_bytes(lambda: model(idx, idx))
            _, held = measure_forward_bytes(lambda: model(idx, idx))
            predicted = model_activation_bytes(c, b, policy, dtype_bytes=d, device="cpu")
            assert held.tensor_bytes == pytest.approx(predicted, rel=0.02), (dtype, policy)
    bert = ModelConfig(kind="bert", n_layer=2, **BASE, norm="rmsnorm", position="rope", n_kv_head=2, dropout=0.1)
    model = BERT(bert)
    labels = torch.full_like(idx, -100)
    labels[:, ::8] = idx[:, ::8]
    measure_forward_bytes(lambda: model(idx, labels))
    _, held = measure_forward_bytes(lambda: model(idx, labels))
    predicted = model_activation_bytes(bert, b, dtype_bytes=4, device="cpu", mask_fraction=1 / 8)
    assert held.tensor_bytes == pytest.approx(predicted, rel=0.02)


def test_parameter_counts_match_the_built_models():
    """estimate's parameters (4 bytes each at dtype_bytes=4) = sum(p.numel()) of the built model, for
    every combination of the options with bias and tied embeddings."""
    small = dict(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50)
    for norm, position, activation, kv, bias, tie in itertools.product(
            ("layernorm", "rmsnorm"), ("learned", "rope"), ("gelu", "swiglu"), (None, 2, 1), (True, False),
            (True, False)):
        c = ModelConfig(**small, norm=norm, position=position, activation=activation, n_kv_head=kv, bias=bias,
                        tie_embeddings=tie, ffn_hidden=88 if activation == "swiglu" else None)
        n = sum(p.numel() for p in GPT(c).parameters())
        assert estimate(c, 1, dtype_bytes=4).parameters == 4 * n, c
    for norm, position, kv, post in itertools.product(("layernorm", "rmsnorm"), ("learned", "rope"), (None, 2),
                                                      ("pre", "post")):
        c = ModelConfig(kind="bert", **small, norm=norm, position=position, n_kv_head=kv, norm_position=post)
        assert estimate(c, 1, dtype_bytes=4).parameters == 4 * sum(p.numel() for p in BERT(c).parameters()), c
    for norm, head_size, qk_norm, bias, kind in itertools.product(("layernorm", "rmsnorm"), (None, 12), (False, True),
                                                                  (True, False), ("gpt", "bert")):
        c = ModelConfig(**{**small, "kind": kind}, norm=norm, head_size=head_size, qk_norm=qk_norm, bias=bias,
                        n_kv_head=2, norm_position="post" if kind == "bert" else "pre")
        n = sum(p.numel() for p in (GPT if kind == "gpt" else BERT)(c).parameters())
        assert estimate(c, 1, dtype_bytes=4).parameters == 4 * n, c
    # OLMo 2's layout: gains as wide as the q and k projections, reordered norms (as many as pre-LN's)
    for head_size, kv, tp in itertools.product((None, 12), (None, 2), (1, 2)):
        c = ModelConfig(**small, **LLAMA | {"ffn_hidden": 88, "n_kv_head": kv}, head_size=head_size, qk_norm=True,
                        qk_norm_scope="projection", norm_position="reordered", bias=False)
        n = sum(p.numel() for p in GPT(c).parameters())
        assert estimate(c, 1, dtype_bytes=4).parameters == 4 * n, c
        if tp == 2:  # per rank: the projections' gains split with q and k, where each head's are replicated
            gains = sum(p.numel() for name, p in GPT(c).named_parameters() if name.endswith(("q_norm.weight",
                                                                                             "k_norm.weight")))
            head = c.replace(qk_norm_scope="head")
            saved = {cfg.qk_norm_scope: (estimate(cfg, 1, dtype_bytes=4).parameters
                                         - estimate(cfg, 1, dtype_bytes=4, tp=2).parameters) / 4 for cfg in (c, head)}
            assert saved["projection"] - saved["head"] == gains / 2, c


@pytest.mark.parametrize("bias", [True, False])
def test_stage_parameters_under_tp_and_pp_follow_the_module_shapes(bias):
    """A pipeline rank's parameters per device (tp = 2, pp = 2) against a count of the built model's
    own tensors: a column-parallel linear (q, k, v, fc1, the gate) split by t with its bias, a
    row-parallel one (proj, fc2) its weight split, the bias whole; norms whole; the token embedding
    and the output layer split over the vocabulary."""
    t, pp = 2, 2
    c = ModelConfig(n_layer=4, n_embd=32, n_head=4, seq_len=16, vocab_size=50, bias=bias, tie_embeddings=False,
                    **{**LLAMA, "ffn_hidden": 88})
    model = GPT(c)
    roles = {name.removeprefix("blocks.*."): role for name, role in block_tp_plan(c).items()}
    block = 0.0
    for name, p in model.blocks[0].named_parameters():
        module, kind = name.rsplit(".", 1)
        role = roles.get(module)
        split = role == "colwise" or (role == "rowwise" and kind == "weight")
        block += p.numel() / t if split else p.numel()
    per_rank = c.n_layer // pp * block
    first = per_rank + model.tok_emb.weight.numel() / t + sum(p.numel() for p in model.pos_emb.parameters())
    last = per_rank + sum(p.numel() for p in model.ln_f.parameters()) + model.lm_head.weight.numel() / t
    assert stage_parameters(c, t, pp, first=True, last=False) == pytest.approx(first, rel=1e-12)
    assert stage_parameters(c, t, pp, first=False, last=True) == pytest.approx(last, rel=1e-12)


@pytest.mark.parametrize("s, b, h, a, v, dropout, attention, policy, ffn", [
    (128, 8, 256, 4, 4096, 0.1, "explicit", "full", 704),   # logits-bound
    (64, 8, 256, 4, 512, 0.0, "sdpa", "full", 1024),        # MLP-bound: SwiGLU's backward
    (64, 8, 256, 4, 512, 0.0, "sdpa", "none", 1024),
])
def test_the_peak_of_a_llama_step_is_stored_plus_backward_working_set(s, b, h, a, v, dropout, attention, policy,
                                                                      ffn):
    """As tests/test_memory.py's GPT and BERT cases: what a forward and backward of the Llama-style GPT
    hold at their peak (every op, measure_peak_bytes) against the stored activations plus
    backward_working_bytes, within the same 0.97-1.4 (measured 1.30, 1.08, 1.05)."""
    from largebatch.memory import backward_working_bytes, measure_peak_bytes

    torch.manual_seed(0)
    c = ModelConfig(n_layer=2, n_embd=h, n_head=a, seq_len=s, vocab_size=v, dropout=dropout, attention=attention,
                    **{**LLAMA, "ffn_hidden": ffn})
    model = GPT(c).train()
    apply_recompute(model, policy)
    idx = torch.randint(0, v, (b, s))

    def step():
        model(idx, idx)[1].backward()

    step()
    peak = measure_peak_bytes(step)
    kw = dict(dtype_bytes=4, device="cpu")
    ratio = (model_activation_bytes(c, b, policy, **kw) + backward_working_bytes(c, b, policy, **kw)) / peak
    assert 0.97 <= ratio <= 1.4, ratio


def test_the_memory_command_takes_the_llama_fields(capsys):
    """`largebatch memory --model.norm rmsnorm --model.position rope --model.activation swiglu
    --model.n_kv_head 2` (and the short spellings) prints the Llama-style layer's bytes."""
    from largebatch.memory.cli import main

    argv = ["--model", "demo", "--model.ffn_hidden", "688", "--model.seq_len", "1024", "--micro-batch", "4"]
    llama = ["--model.norm", "rmsnorm", "--model.position", "rope", "--model.activation", "swiglu",
             "--model.n_kv_head", "2"]
    short = ["--norm", "rmsnorm", "--position", "rope", "--activation", "swiglu", "--kv-heads", "2"]
    outputs = []
    for extra in (llama, short, []):
        assert main(argv + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]
    assert "f=688 a_kv=2 rmsnorm rope positions swiglu MLP" in outputs[0]
    row = next(line for line in outputs[0].splitlines() if line.strip().startswith("no parallelism"))
    c = ModelConfig(n_layer=4, n_embd=256, n_head=4, seq_len=1024, vocab_size=4096, ffn_hidden=688, **{
        k: v for k, v in LLAMA.items() if k != "ffn_hidden"})
    reference = reference_layer(c, 1024, 4, 2, "none", dropout=False, fused=False)
    assert float(row.split()[2]) == pytest.approx(reference / 2**20, abs=0.051)
    assert main(argv + ["--model.n_kv_head", "2", "--tp", "4"]) == 2
    assert "tp=4 does not divide kv_heads=2 (model.n_kv_head)" in capsys.readouterr().err
    # none, as `largebatch train` takes it: multi-head attention and the default width again
    assert main(["--config", "llama-demo", "--kv-heads", "none", "--ffn", "none"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "a_kv" not in header and "f=" not in header and "swiglu" in header, header


def test_layer_flags_do_not_turn_a_transformers_gpt2_config_into_llama(tmp_path, capsys):
    """--hf-config describes transformers' own layers: a Llama-style flag beside a GPT-2 config.json
    is refused naming it (it was counted as GPT-2's eager layer while the closed form moved)."""
    import json

    from largebatch.memory.cli import main

    transformers = pytest.importorskip("transformers")
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                                       bos_token_id=0, eos_token_id=0).to_dict()))
    for flag in (["--kv-heads", "1"], ["--norm", "rmsnorm"], ["--model.position", "rope"], ["--head-size", "8"],
                 ["--qk-norm", "True"]):
        assert main(["--hf-config", str(path)] + flag) == 2, flag
        err = capsys.readouterr().err
        assert flag[1] in err and "--hf-config" in err and "transformers' layers of that config" in err, err
    # what it is (heads of 64 / 4 values, no q/k norms)
    assert main(["--hf-config", str(path), "--kv-heads", "4", "--model.norm", "layernorm", "--head-size", "16",
                 "--qk-norm", "false"]) == 0
