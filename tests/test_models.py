"""GPT and BERT against transformers' GPT2LMHeadModel / BertForMaskedLM (same weights, same
logits), the loss reductions, FLOP counts against the paper's closed form, and bad input."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from largebatch.models import BERT, GPT, ModelConfig, build_model, flops_per_token, preset, utilization

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TINY = dict(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50)


def _hf_gpt2_from(model: GPT) -> torch.nn.Module:
    c = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.seq_len, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, n_inner=c.ffn, activation_function="gelu", resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=c.norm_eps, tie_word_embeddings=True,
        attn_implementation="eager"))
    sd = {"transformer.wte.weight": model.tok_emb.weight, "transformer.wpe.weight": model.pos_emb.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias,
          "lm_head.weight": model.lm_head.weight}
    for i, b in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        a = b.attn
        # transformers' Conv1D stores (in, out): the transpose of nn.Linear's weight
        sd[p + "attn.c_attn.weight"] = torch.cat([a.q.weight, a.k.weight, a.v.weight]).t()
        sd[p + "attn.c_attn.bias"] = torch.cat([a.q.bias, a.k.bias, a.v.bias])
        sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = a.proj.weight.t(), a.proj.bias
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = b.mlp.fc1.weight.t(), b.mlp.fc1.bias
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = b.mlp.fc2.weight.t(), b.mlp.fc2.bias
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            sd[p + theirs + ".weight"] = getattr(b, ours).weight
            sd[p + theirs + ".bias"] = getattr(b, ours).bias
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()},
                                             strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), missing
    return hf.eval()


def _hf_bert_from(model: BERT) -> torch.nn.Module:
    c = model.config
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, intermediate_size=c.ffn, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=c.seq_len,
        type_vocab_size=1, layer_norm_eps=c.norm_eps, tie_word_embeddings=True,
        attn_implementation="eager"))
    e = "bert.embeddings."
    zero = torch.zeros(1, c.n_embd)  # token-type embedding 0 is added everywhere: keep it zero
    sd = {e + "word_embeddings.weight": model.tok_emb.weight,
          e + "position_embeddings.weight": model.pos_emb.weight,
          e + "token_type_embeddings.weight": zero,
          e + "LayerNorm.weight": model.emb_norm.weight, e + "LayerNorm.bias": model.emb_norm.bias}
    for i, b in enumerate(model.blocks):
        p = f"bert.encoder.layer.{i}."
        names = {"attention.self.query": b.attn.q, "attention.self.key": b.attn.k,
                 "attention.self.value": b.attn.v, "attention.output.dense": b.attn.proj,
                 "attention.output.LayerNorm": b.ln1, "intermediate.dense": b.mlp.fc1,
                 "output.dense": b.mlp.fc2, "output.LayerNorm": b.ln2}
        for theirs, module in names.items():
            sd[p + theirs + ".weight"], sd[p + theirs + ".bias"] = module.weight, module.bias
    h = "cls.predictions."
    sd.update({h + "transform.dense.weight": model.head.dense.weight,
               h + "transform.dense.bias": model.head.dense.bias,
               h + "transform.LayerNorm.weight": model.head.norm.weight,
               h + "transform.LayerNorm.bias": model.head.norm.bias,
               h + "decoder.weight": model.head.decoder.weight, h + "bias": model.head.decoder.bias,
               h + "decoder.bias": model.head.decoder.bias})
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()},
                                             strict=False)
    assert not unexpected, unexpected
    assert all("position_ids" in k or "token_type_ids" in k for k in missing), missing
    return hf.eval()


def _randomise(model: torch.nn.Module) -> None:
    # non-trivial LayerNorm and bias values so a mis-mapped parameter cannot hide
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_gpt_matches_transformers_gpt2(attention):
    model = GPT(ModelConfig(kind="gpt", attention=attention, **TINY)).eval()
    _randomise(model)
    hf = _hf_gpt2_from(model)
    idx = torch.randint(0, 50, (3, 16))
    ours, _ = model(idx)
    theirs = hf(input_ids=idx).logits
    assert ours.shape == (3, 16, 50)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_bert_post_ln_matches_transformers_bert(attention):
    config = ModelConfig(kind="bert", attention=attention, norm_position="post", norm_eps=1e-12, **TINY)
    model = BERT(config).eval()
    _randomise(model)
    hf = _hf_bert_from(model)
    ids = torch.randint(0, 50, (3, 16))
    theirs = hf(input_ids=ids).logits  # (B, T, v)
    ours_all, _ = model(ids)
    torch.testing.assert_close(ours_all, theirs, atol=1e-5, rtol=1e-5)
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    ours_masked, loss = model(ids, labels)
    keep = labels != -100
    torch.testing.assert_close(ours_masked, theirs[keep], atol=1e-5, rtol=1e-5)
    ref = F.cross_entropy(theirs[keep].double(), ids[keep])
    assert abs(loss.item() - ref.item()) < 1e-5


def test_sum_reduction_normalises_across_micro_batches():
    model = GPT(ModelConfig(**TINY)).eval()
    idx = torch.randint(0, 50, (4, 16))
    targets = torch.randint(0, 50, (4, 16))
    targets[0, :7] = -100
    _, mean = model(idx, targets)
    sums = [model(idx[i:i + 2], targets[i:i + 2], reduction="sum")[1] for i in (0, 2)]
    tokens = (targets != -100).sum()
    torch.testing.assert_close(sum(sums) / tokens, mean, atol=1e-6, rtol=1e-6)


def test_pre_ln_bert_predicts_only_masked_positions():
    model = build_model(ModelConfig(kind="bert", **TINY))
    ids = torch.randint(0, 50, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 9] = 7, 8
    logits, loss = model(ids, labels)
    assert logits.shape == (2, 50) and loss.ndim == 0
    loss.backward()
    assert model.head.dense.weight.grad is not None


def _flops_reference(c: ModelConfig, s: int) -> tuple[float, float]:
    """Korthikanti et al. 2022, per iteration / (B s): model and full-recompute hardware FLOPs."""
    L, h, v = c.n_layer, c.n_embd, c.vocab_size
    model = 72.0 * L * h * h * (1 + s / (6 * h) + v / (12 * h * L))
    full = 96.0 * L * h * h * (1 + s / (6 * h) + v / (16 * h * L))
    return model, full


def test_flops_match_the_paper_formula():
    for name in ("gpt3-175b", "mtnlg-530b", "demo"):
        c = preset(name)
        model, full = _flops_reference(c, c.seq_len)
        assert flops_per_token(c) == pytest.approx(model, rel=1e-12)
        assert flops_per_token(c, "full") == pytest.approx(full, rel=1e-12)
        sel = flops_per_token(c, "selective") - flops_per_token(c)
        assert sel == pytest.approx(c.n_layer * 4.0 * c.seq_len * c.n_embd, rel=1e-12)
    demo = GPT(preset("demo"))
    mix = demo.flops_per_token(["full", "full", "selective", "none"])
    assert demo.flops_per_token() < mix < demo.flops_per_token("full")
    # 6N + 12 L h s, with N the matmul weights (tied output projection counted once as a matmul)
    c = demo.config
    n_matmul = c.n_layer * (4 * c.n_embd ** 2 + 2 * c.n_embd * c.ffn) + c.n_embd * c.vocab_size
    assert demo.flops_per_token() == 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.seq_len


@pytest.mark.parametrize("options", [dict(n_kv_head=2), dict(n_kv_head=1), dict(activation="swiglu", ffn_hidden=88),
                                     dict(norm="rmsnorm", position="rope", activation="swiglu", ffn_hidden=88,
                                          n_kv_head=2)])
def test_flops_of_the_llama_style_options_follow_the_module_shapes(options):
    """Dense FLOPs per token from the built layer's own linears (2 x in x out each: the narrower k and
    v, the gate), core attention 4 s h (Q K^T and @V over every query head, grouped or not), the
    output layer 2 h v; and torch's FLOP counter on a real forward agrees (rotary and RMSNorm are
    pointwise: not counted, as the paper counts no pointwise op)."""
    from torch.utils.flop_counter import FlopCounterMode

    c = ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=16, vocab_size=96, attention="explicit", **options)
    model = GPT(c)
    linears = [m for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)]
    dense = sum(2.0 * m.in_features * m.out_features for m in linears)
    core = 2 * 2.0 * c.seq_len * model.blocks[0].attn.q.out_features
    head = 2.0 * model.lm_head.in_features * model.lm_head.out_features
    assert flops_per_token(c) == 3 * (c.n_layer * (dense + core) + head)
    assert flops_per_token(c, "full") - flops_per_token(c) == c.n_layer * (dense + core)
    b = 2
    idx = torch.randint(0, c.vocab_size, (b, c.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(idx)
    assert counter.get_total_flops() / (b * c.seq_len) == flops_per_token(c) / 3


@pytest.mark.parametrize("kind, norm, dropout, policy, skipped", [
    ("gpt", "pre", 0.0, "selective", "pv"), ("gpt", "pre", 0.1, "selective", "pv"),
    ("gpt", "pre", 0.0, "full", "fc2"), ("gpt", "pre", 0.1, "full", None),
    ("bert", "post", 0.0, "full", None), ("bert", "pre", 0.0, "full", "fc2")])
def test_recompute_runs_at_most_the_papers_extra_forward(kind, norm, dropout, policy, skipped):
    """Hardware FLOPs count one more forward of the recomputed region (the paper's, and Megatron's,
    recomputation). torch's checkpoint stops once the tensors backward needs are rebuilt, so the
    region's last matmul does not run again when nothing after it saves its output: probs @ V in
    core attention; fc2 in a pre-norm layer without dropout (a dropout mask or a post-norm
    LayerNorm needs it). Counted by torch's FLOP counter on a real forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from largebatch.memory import apply_recompute

    c = ModelConfig(kind=kind, n_layer=2, n_embd=64, n_head=4, seq_len=16, vocab_size=96, dropout=dropout,
                    norm_position=norm, attention="explicit")
    b, s, h = 4, c.seq_len, c.n_embd
    idx = torch.randint(0, c.vocab_size, (b, s))
    targets = idx if kind == "gpt" else torch.where(torch.arange(s) % 8 == 0, idx, -100)  # 1 in 8 predicted
    counted = {}
    for name in ("none", policy):
        torch.manual_seed(0)
        model = build_model(c).train()
        if name != "none":
            apply_recompute(model, name)
        with FlopCounterMode(display=False) as counter:
            model(idx, targets)[1].backward()
        counted[name] = counter.get_total_flops() / (b * s)
    per_layer = {"pv": 2.0 * s * h, "fc2": 2.0 * h * c.ffn, None: 0.0}[skipped]
    papers_extra = flops_per_token(c, policy, mask_fraction=1 / 8) - flops_per_token(c, mask_fraction=1 / 8)
    assert counted[policy] - counted["none"] == papers_extra - c.n_layer * per_layer


def test_utilization_is_achieved_over_peak():
    c = preset("gpt3-175b")
    # the paper's headline arithmetic: MFU = tokens/s * 72 L h^2 (1 + s/6h + v/12hL) / peak
    model, full = _flops_reference(c, 2048)
    assert utilization(c, 1000.0, 1e18) == pytest.approx(1000.0 * model / 1e18, rel=1e-12)
    assert utilization(c, 1000.0, 1e18, "full") == pytest.approx(1000.0 * full / 1e18, rel=1e-12)
    with pytest.raises(ValueError, match="peak_flops_per_second=0"):
        utilization(c, 1.0, 0)


def test_num_params_counts_tied_weights_once():
    model = GPT(ModelConfig(**TINY))
    h, v, s, L = 32, 50, 16, 2
    per_layer = 4 * (h * h + h) + 2 * (4 * h * h) + 4 * h + h + 4 * h  # attn, mlp, ln
    assert model.num_params() == v * h + s * h + L * per_layer + 2 * h
    assert model.num_params(non_embedding=True) == L * per_layer + 2 * h


def test_generate_extends_and_respects_context():
    model = GPT(ModelConfig(**TINY)).eval()
    idx = torch.randint(0, 50, (2, 12))
    out = model.generate(idx, max_new_tokens=10, top_k=5)
    assert out.shape == (2, 22) and torch.equal(out[:, :12], idx)
    greedy = model.generate(idx, 3, temperature=0)
    assert torch.equal(greedy, model.generate(idx, 3, temperature=0))
    # a temperature below float32's range divided the logits to inf and sampled from NaN (torch's
    # "probability tensor contains either inf, nan"): it is greedy, as 0 is
    for tiny in (1e-40, 5e-324):
        assert torch.equal(model.generate(idx, 3, temperature=tiny), greedy)


@pytest.mark.parametrize("args, kwargs, words", [
    ((torch.zeros(1, 0, dtype=torch.long), 2), {}, r"shape \(1, 0\); give token ids of shape \(batch, T\) with T >= 1"),
    ((torch.zeros(4, dtype=torch.long), 2), {}, r"1-D torch.int64 tensor of shape \(4,\).*ids\[None\]"),
    ((torch.zeros(1, 4), 2), {}, r"torch.float32 tensor"),
    ((torch.zeros(1, 4, dtype=torch.long), -3), {}, r"max_new_tokens=-3: must be a whole number >= 0"),
    ((torch.zeros(1, 4, dtype=torch.long), 2.5), {}, r"max_new_tokens=2.5"),
    ((torch.zeros(1, 4, dtype=torch.long), 2), {"temperature": float("nan")}, r"temperature=nan: must be a finite"),
    ((torch.zeros(1, 4, dtype=torch.long), 2), {"temperature": -1.0}, r"temperature=-1.0"),
    ((torch.zeros(1, 4, dtype=torch.long), 2), {"top_k": 2.5}, r"top_k=2.5: must be a positive integer"),
    ((torch.zeros(1, 4, dtype=torch.long), 2), {"top_k": 0}, r"top_k=0")])
def test_generate_refuses_bad_arguments_by_name(args, kwargs, words):
    """An empty prompt failed inside the attention ("cannot reshape tensor of 0 elements"), a 1-D one
    with an IndexError, a fractional top_k in torch.topk, a NaN temperature in torch.multinomial, and
    a negative max_new_tokens returned the prompt as if it were allowed."""
    with pytest.raises(ValueError, match=words):
        GPT(ModelConfig(**TINY)).eval().generate(*args, **kwargs)


@pytest.mark.parametrize("field, value, words", [
    ("n_head", 5, "divide n_embd"), ("attention", "flash", "'explicit', 'sdpa'"),
    ("kind", "t5", "'gpt', 'bert'"), ("dropout", 1.0, "[0, 1)"), ("n_layer", 0, "positive"),
    ("norm_position", "sandwich", "'pre', 'post'"), ("ffn_hidden", -3, "positive")])
def test_bad_config_names_field_value_and_fix(field, value, words):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**TINY, field: value})
    assert f"ModelConfig.{field}" in str(err.value) and words in str(err.value)


def test_bad_inputs():
    model = GPT(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="seq_len is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='none'"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), "none")
    with pytest.raises(ValueError, match="kind='gpt'"):
        GPT(ModelConfig(kind="bert", **TINY))
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        preset("gpt5")


def test_the_peak_matmul_is_sized_to_its_kernel_and_counts_the_models_linear():
    """MFU's measured peak: bf16 on a CPU without bf16 units ran three 2048^3 torch.mm products at
    ~1.4 GFLOP/s (minutes before step 1), while the model's F.linear ran ~6x faster, so MFU read
    above 1000%. The size now shrinks for a slow kernel, and the peak is the best of mm and linear."""
    import time

    import torch.nn.functional as F

    from largebatch.models.flops import matmul_size, measure_peak_flops

    # a product at 256 taking 20 ms (1.7 GFLOP/s): 2048 would take 10 s; a budget of 0.75 s allows 512
    assert matmul_size(0.02, 0.75) == 512 and matmul_size(0.02, 0.75, smallest=1024) == 1024
    assert matmul_size(2e-6, 0.75) == 2048 and matmul_size(1.0, 0.75) == 256
    peak = measure_peak_flops(torch.device("cpu"), torch.bfloat16, seconds=0.3)
    a, b = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    F.linear(a, b)
    t0 = time.perf_counter()
    for _ in range(3):
        F.linear(a, b)
    linear_rate = 3 * 2 * 256**3 / (time.perf_counter() - t0)
    # the peak counts linear's kernel: not far below its rate at a small size (mm alone was 6x below)
    assert peak > 0.5 * linear_rate, (peak, linear_rate)


def test_an_n_head_that_does_not_divide_n_embd_names_the_nearest_divisor():
    """The refusal names the divisor of n_embd nearest n_head (the smaller on a tie), checked against
    every divisor by brute force for small widths; for n_embd = 10^12 + 2 it is one line at once (the
    divisors were listed by trying all 10^12 numbers: a fuzzed --model.n_embd=100000000 held the
    test suite for many minutes)."""
    from largebatch.models.config import _nearest_divisor

    for n in range(1, 300):
        for near in (1, 2, 3, 5, 7, 12, 50, 500):
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            assert _nearest_divisor(n, near) == min(divisors, key=lambda d: (abs(d - near), d)), (n, near)
    with pytest.raises(ValueError, match=r"n_head=5 does not divide n_embd=1000000000002: .*\(e\.g\. 6\)"):
        ModelConfig(n_embd=10**12 + 2, n_head=5)
    # a width near 10^18 (sqrt 10^9: listing divisors to the root took minutes), and a large prime
    # past the search's reach: the nearer of 1 and itself
    with pytest.raises(ValueError, match=r"n_head=7 does not divide n_embd=1000000000000000002: .*\(e\.g\. 6\)"):
        ModelConfig(n_embd=10**18 + 2, n_head=7)
    prime = 2**61 - 1  # a Mersenne prime: no divisor but 1 and itself
    assert _nearest_divisor(prime, 10**9) == 1 and _nearest_divisor(prime, prime - 10**9) == prime
    assert _nearest_divisor(12, 1000) == 12 and _nearest_divisor(12, 0) == 1
