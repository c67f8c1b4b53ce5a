"""The Llama-style layer options against float64 references written from their papers' formulas, and
the whole model against transformers' LlamaForCausalLM (Qwen3's options against Qwen3ForCausalLM and a
float64 attention written from their formulas).

RMSNorm (Zhang & Sennrich 2019, eq. 4), rotary embeddings (Su et al. 2021, eq. 34, written here in
its complex form: pair i of a head is one complex number, multiplied by exp(j m theta_i)), SwiGLU
(Shazeer 2020, eq. 6) and grouped-query attention (Ainslie et al. 2023: K/V head k serves query heads
k g .. k g + g - 1, the reference repeats it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from largebatch.models import build_model
from largebatch.models.config import ModelConfig
from largebatch.models.layers import Attention, CoreAttention, Rotary, norm_layer

LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", bias=False)


def _cfg(**changes) -> ModelConfig:
    base = dict(kind="gpt", n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=64, ffn_hidden=48)
    return ModelConfig(**{**base, **changes})


def test_rmsnorm_matches_its_formula_and_has_no_bias():
    torch.manual_seed(0)
    cfg = _cfg(norm="rmsnorm", norm_eps=1e-6)  # bias=True is ignored: RMSNorm has a gain only
    norm = norm_layer(cfg).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 32, dtype=torch.float64) * 3 + 1
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), ref, rtol=1e-12, atol=1e-12)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    # bf16 input: normalised in fp32, rounded to bf16, then scaled (bf16 gain: bf16 out; fp32 gain: fp32)
    xb = x[:1, :1].to(torch.bfloat16)
    ref_b = xb.double() / torch.sqrt((xb.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    out = norm_layer(cfg).to(torch.bfloat16)(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_b, rtol=1e-2, atol=1e-2)
    out = norm_layer(cfg)(xb)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_b.to(torch.bfloat16).double(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, gain_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_rmsnorm_gradients_match_the_formula_and_backward_keeps_its_input_only(dtype, gain_dtype):
    """The gradients of y = g x / sqrt(mean(x^2) + eps) against float64 autograd through that formula
    (a 16-bit input's are rounded: bf16's 8 bits); what backward keeps: the input (the same storage,
    no copy), the gain and the per-token 1/rms (fp32 for a 16-bit input), nothing h-wide besides --
    the op-by-op form kept an fp32 copy of a 16-bit input and the normalised tensor too."""
    torch.manual_seed(0)
    norm = norm_layer(_cfg(norm="rmsnorm", norm_eps=1e-6)).to(gain_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 5, 32, dtype=torch.float64) * 3 + 1).to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.to(y.dtype))
    x64 = x.detach().double().requires_grad_()
    g64 = norm.weight.detach().double().requires_grad_()
    (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * g64).backward(grad)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * x64.grad.abs().max().item())
    torch.testing.assert_close(norm.weight.grad.double(), g64.grad, rtol=tol,
                               atol=tol * g64.grad.abs().max().item())
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == gain_dtype
    assert len(saved) == 3 and saved[0] is x and saved[1] is norm.weight, [t.shape for t in saved]
    stat_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    assert saved[2].shape == (3, 5, 1) and saved[2].dtype == stat_dtype


def test_rmsnorm_takes_what_torch_s_takes():
    """The arguments torch's nn.RMSNorm takes give its values and gradients: a 2-D normalized_shape,
    a 1-D input, no gain (elementwise_affine=False), eps=None (the finfo eps of the dtype the norm
    works in: fp32 for a 16-bit input); second derivatives (backward is written in differentiable
    ops: a Hessian-vector product, a gradient penalty) and torch.func's grad and vmap."""
    from largebatch.models.layers import RMSNorm

    torch.manual_seed(0)
    for shape, x_shape, affine in (((4, 8), (3, 4, 8), True), (8, (8,), True), (8, (3, 8), False)):
        ours, theirs = RMSNorm(shape, elementwise_affine=affine), torch.nn.RMSNorm(shape, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                ours.weight.uniform_(0.5, 1.5)
                theirs.weight.copy_(ours.weight)
        x = torch.randn(x_shape, dtype=torch.float64).float().requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        grad = torch.randn(x_shape)
        ours(x).backward(grad)
        theirs(x2).backward(grad)
        torch.testing.assert_close(ours(x), theirs(x2), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
        if affine:
            torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, 8, dtype=torch.bfloat16) * 1e-3  # eps decides here: bf16's finfo eps is 7.8e-3
    expected = torch.nn.functional.rms_norm(x.float(), (8,)).to(torch.bfloat16)
    assert torch.equal(RMSNorm(8, elementwise_affine=False)(x), expected)
    ours, theirs = RMSNorm((4, 8)).double(), torch.nn.RMSNorm((4, 8)).double()
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    second = []
    for norm in (ours, theirs):  # d/d(x, g) of |dL/dx|^2, L = sum(y^2)
        (first,) = torch.autograd.grad(norm(x).pow(2).sum(), x, create_graph=True)
        second.append(torch.autograd.grad(first.pow(2).sum(), (x, norm.weight)))
    for a, b in zip(*second):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert torch.autograd.gradgradcheck(lambda x, g: _rms(x, g), (x, ours.weight.detach().requires_grad_()))
    f = lambda v: ours(v).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(x.detach()), torch.autograd.grad(f(x), x)[0], rtol=0, atol=0)
    assert torch.equal(torch.func.vmap(ours)(x.detach()), ours(x.detach()))


def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    from largebatch.models.layers import _RMSNormFunction

    return _RMSNormFunction.apply(x, g, 1e-6, 2)[0]


def _rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x (..., T, d) float64: dimension i and i + d/2 form z = x_i + j x_{i+d/2}; z * exp(j m theta_i)."""
    T, d = x.shape[-2:]
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angle = torch.tensor([[m * theta ** (-2.0 * i / d) for i in range(half)] for m in range(T)],
                         dtype=torch.float64)
    out = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([out.real, out.imag], dim=-1)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rotary_matches_the_complex_form_and_is_relative(theta):
    torch.manual_seed(1)
    cfg = _cfg(position="rope", rope_theta=theta, n_embd=64, n_head=4)  # head size 16
    rot = Rotary(cfg)
    x = torch.randn(2, 4, 16, 16, dtype=torch.float64)
    # the tables are fp32 (as transformers' inv_freq): agreement to fp32 rounding of the angles
    torch.testing.assert_close(rot(x), _rope_reference(x, theta), rtol=0, atol=2e-5)
    # shorter inputs use the first rows of the tables
    torch.testing.assert_close(rot(x[..., :5, :]), _rope_reference(x[..., :5, :], theta), rtol=0, atol=2e-5)
    # q_m . k_n depends on m - n only: the same vectors at every position give a Toeplitz score matrix
    q = torch.randn(16, dtype=torch.float64).expand(1, 1, 16, 16)
    k = torch.randn(16, dtype=torch.float64).expand(1, 1, 16, 16)
    scores = (rot(q) @ rot(k).transpose(-2, -1))[0, 0]
    for shift in (1, 3, 7):
        diag = torch.diagonal(scores, offset=shift)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=0, atol=1e-4)


def test_swiglu_mlp_matches_its_formula():
    torch.manual_seed(2)
    cfg = _cfg(activation="swiglu", bias=True)
    mlp = build_model(cfg).blocks[0].mlp.double()
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    g = x @ mlp.gate.weight.T + mlp.gate.bias
    u = x @ mlp.fc1.weight.T + mlp.fc1.bias
    ref = (g / (1 + torch.exp(-g)) * u) @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), ref, rtol=1e-12, atol=1e-12)
    assert mlp.gate.weight.shape == (48, 32) and mlp.fc1.weight.shape == (48, 32)


def _attention_reference(q, k, v, causal: bool) -> torch.Tensor:
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        T = q.size(-2)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_grouped_query_attention_matches_repeated_heads(kind, attention, n_kv_head):
    torch.manual_seed(3)
    cfg = _cfg(kind=kind, attention=attention, n_kv_head=n_kv_head)
    core = CoreAttention(cfg).double()
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, n_kv_head, 16, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, n_kv_head, 16, 8, dtype=torch.float64, requires_grad=True)
    out = core(q, k, v)
    ref = _attention_reference(q, k, v, causal=kind == "gpt")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_grouped_attention_module_shapes_and_parameter_count():
    cfg = _cfg(n_kv_head=2, **LLAMA)
    attn = Attention(cfg)
    assert attn.k.weight.shape == (16, 32) and attn.v.weight.shape == (16, 32) and attn.q.weight.shape == (32, 32)
    model = build_model(cfg)
    h, f, v, L, kv = 32, 48, 64, 2, 16
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h  # q, proj, k, v, gate/fc1/fc2, two RMSNorm gains
    assert model.num_params() == v * h + L * per_layer + h  # tied embedding, no position weights, final norm
    assert model.num_params(non_embedding=True) == L * per_layer + h
    assert not any("pos_emb" in n for n, _ in model.named_parameters())


def _copy_into_transformers(ours, theirs, n_layer: int, qk_norm: bool = False) -> None:
    """``ours``'s weights into transformers' Llama-family ``theirs`` under its names (written here, not
    the export's table), every one of its weights filled."""
    names = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "ln_f.weight",
             "lm_head.weight": "lm_head.weight"}
    pairs = [("self_attn.q_proj", "attn.q"), ("self_attn.k_proj", "attn.k"), ("self_attn.v_proj", "attn.v"),
             ("self_attn.o_proj", "attn.proj"), ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.fc1"),
             ("mlp.down_proj", "mlp.fc2"), ("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")]
    if qk_norm:
        pairs += [("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm")]
    for i in range(n_layer):
        for hf, mine in pairs:
            names[f"model.layers.{i}.{hf}.weight"] = f"blocks.{i}.{mine}.weight"
    state = ours.state_dict()
    result = theirs.load_state_dict({hf: state[mine] for hf, mine in names.items()}, strict=False)
    assert not result.missing_keys and not result.unexpected_keys


def test_llama_style_gpt_matches_transformers_llama():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    L = 2
    for attention in ("explicit", "sdpa"):
        cfg = _cfg(n_layer=L, n_embd=64, n_kv_head=2, norm_eps=1e-6, rope_theta=500000.0, tie_embeddings=False,
                   attention=attention, seq_len=24, vocab_size=100, ffn_hidden=96, **LLAMA)
        ours = build_model(cfg).double().eval()
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=24, rms_norm_eps=1e-6, rope_theta=500000.0,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False)).double().eval()
        _copy_into_transformers(ours, theirs, L)
        idx = torch.randint(0, 100, (2, 24))
        # fp32 rotary tables on both sides: agreement to fp32 rounding of the angles
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=0, atol=1e-6)


def _reference_qk_norm_attention(x, attn, d_h, eps):
    """Causal attention of one layer with Qwen3's options, in float64 from the formulas (docs/papers.md:
    Llama-style layers), not from the module: q = x W_q^T cut into heads of d_h values, each head
    normalised, x_hat = q / sqrt(mean(q^2) + eps) times the gain; the same for k; rotated in the
    complex form (pair i is q[i] + j q[i + d_h/2], times exp(j m theta^(-2i/d_h))); key/value head
    floor(i / g) for query head i; softmax(q . k / sqrt(d_h)) over j <= m; heads joined; W_o."""
    B, T, _ = x.shape
    a, a_kv = attn.q.out_features // d_h, attn.k.out_features // d_h
    w = {n: getattr(attn, n).weight.detach().double() for n in ("q", "k", "v", "proj")}
    q = (x @ w["q"].T).view(B, T, a, d_h)
    k = (x @ w["k"].T).view(B, T, a_kv, d_h)
    v = (x @ w["v"].T).view(B, T, a_kv, d_h)

    def normed(t, gain):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * gain.detach().double()

    q, k = normed(q, attn.q_norm.weight), normed(k, attn.k_norm.weight)
    half = d_h // 2
    pairs = torch.arange(half, dtype=torch.float64)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * pairs / d_h)
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # (1, T, 1, d_h/2)

    def rotated(t):
        z = torch.complex(t[..., :half], t[..., half:]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    q, k = rotated(q), rotated(k)
    g = a // a_kv
    out = torch.empty(B, T, a, d_h, dtype=torch.float64)
    for i in range(a):
        scores = torch.einsum("bmd,bnd->bmn", q[:, :, i], k[:, :, i // g]) / math.sqrt(d_h)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, i] = torch.softmax(scores, -1) @ v[:, :, i // g]
    return out.reshape(B, T, a * d_h) @ w["proj"].T


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_qk_norm_with_its_own_head_size_matches_the_formulas(attention):
    """Heads of 24 values on a 32-wide stream (q is 96 wide, k and v 48), each query and key head
    normalised with gains far from 1: the module (fp64, its rotary tables fp32) against the reference, and the
    shapes; without the norms the same weights give other outputs (the reference would see it)."""
    torch.manual_seed(6)
    cfg = _cfg(n_kv_head=2, head_size=24, qk_norm=True, norm_eps=1e-6, attention=attention, **LLAMA)
    attn = Attention(cfg).double().eval()
    assert (attn.q.weight.shape, attn.k.weight.shape, attn.proj.weight.shape) == ((96, 32), (48, 32), (32, 96))
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (24,)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    expected = _reference_qk_norm_attention(x, attn, 24, 1e-6)
    # (the module's rotary tables are fp32, as transformers' are: ~3e-8 here; a wrong norm is ~1e-1)
    torch.testing.assert_close(attn(x), expected, rtol=0, atol=1e-6)
    plain = Attention(cfg.replace(qk_norm=False)).double().eval()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "_norm" not in k})
    assert (plain(x) - expected).abs().max() > 1e-2


def test_qk_norm_keeps_the_projections_dtype_under_autocast():
    """Under bf16 autocast the fp32 gains would make q and k fp32 (the rotation in fp32, a KV cache of
    fp32 keys beside bf16 values): the norms' outputs go on in the projections' dtype, and the cache
    holds both in bf16."""
    from largebatch.models.layers import KVCache

    torch.manual_seed(8)
    cfg = _cfg(n_kv_head=2, head_size=12, qk_norm=True, **LLAMA)
    model = build_model(cfg).eval()
    idx = torch.randint(0, 64, (2, 8))
    cache = KVCache(cfg.n_layer, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, cache=cache)
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.bfloat16


def test_qwen3_layout_matches_transformers_qwen3():
    """A GPT with Qwen3's layers (no biases, q/k norms, heads of 24 on a 64-wide stream, 2 K/V heads,
    theta 1e6, untied) with its weights copied into transformers' Qwen3ForCausalLM gives its logits
    in float64, explicit and sdpa alike."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    L = 2
    for attention in ("explicit", "sdpa"):
        cfg = _cfg(n_layer=L, n_embd=64, n_kv_head=2, head_size=24, qk_norm=True, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=False, attention=attention, seq_len=24, vocab_size=100, ffn_hidden=96, **LLAMA)
        ours = build_model(cfg).double().eval()
        with torch.no_grad():
            for name, p in ours.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 2.0)
        theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=24, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
            attention_bias=False)).double().eval()
        _copy_into_transformers(ours, theirs, L, qk_norm=True)
        idx = torch.randint(0, 100, (2, 24))
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=0, atol=1e-6)


def test_flops_count_the_attention_width_of_heads_of_any_size():
    """flops_per_token against an independent count: 6 x (the blocks' matmul weights, read off the
    built model) + 3 x 4 s a d_h per layer (Q K^T and P V at the attention's own width, forward and
    twice in backward) + the output layer, for heads of n_embd / n_head values and of another size."""
    from largebatch.models.flops import flops_per_token

    for head_size in (None, 24):
        cfg = _cfg(n_kv_head=2, head_size=head_size, qk_norm=head_size is not None, **LLAMA)
        model = build_model(cfg)
        matmuls = sum(m.weight.numel() for n, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear))
        width = cfg.n_head * (head_size or cfg.n_embd // cfg.n_head)
        expected = 6 * matmuls + cfg.n_layer * 3 * 4 * cfg.seq_len * width + 6 * cfg.n_embd * cfg.vocab_size
        assert flops_per_token(cfg) == expected


@pytest.mark.parametrize("changes, words", [
    (dict(n_kv_head=3), ["n_kv_head=3", "n_head=4", "divisor"]),
    (dict(head_size=0), ["head_size=0", "positive"]),
    (dict(position="rope", head_size=9), ["head_size=9", "even", "change head_size"]),
    (dict(n_head=3), ["n_head=3", "n_embd=32", "or set head_size"]),
    (dict(n_kv_head=0), ["n_kv_head=0", "positive"]),
    (dict(position="rope", n_embd=36, n_head=4, ffn_hidden=None), ["rope", "head size", "9", "even"]),
    (dict(position="rope", rope_theta=0.5), ["rope_theta=0.5", "> 1"]),
    (dict(rope_theta=float("nan")), ["rope_theta", "nan", "finite"]),
    (dict(kind="bert", activation="swiglu"), ["swiglu", "bert", "gelu"]),
    (dict(norm="batchnorm"), ["norm", "batchnorm", "rmsnorm"]),
    (dict(position="alibi"), ["position", "alibi", "rope"]),
])
def test_bad_llama_options_name_the_field_and_the_fix(changes, words):
    with pytest.raises(ValueError) as err:
        _cfg(**changes)
    message = str(err.value)
    for word in words:
        assert word in message, (word, message)


def test_llama_style_model_trains_and_generates():
    torch.manual_seed(5)
    cfg = _cfg(n_kv_head=1, **LLAMA)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(30):
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # memorises four sequences
    assert model.generate(idx[:1, :3], 5, temperature=0).shape == (1, 8)


def test_a_llama_style_run_resumes_to_the_bit_and_refuses_another_layout(tmp_path, tiny_data_cache, capsys):
    """The trainer end to end: a Llama-style run stopped before a Seesaw batch change and continued
    gives the uninterrupted run's losses to the last bit; continuing it as another layout is refused
    before any work, naming the fields."""
    from largebatch.train.cli import main
    from test_train import _run, _train_losses, tiny_overrides

    llama = {"model.norm": "rmsnorm", "model.position": "rope", "model.activation": "swiglu",
             "model.n_kv_head": 1, "model.bias": False, "model.ffn_hidden": 88}
    ref_dir, out = tmp_path / "ref", tmp_path / "stopped"
    ref = _run(tiny_overrides(tiny_data_cache, ref_dir, **llama))
    assert ref["final_val_loss"] < ref["unigram_val_loss"] + 1.0
    losses = _train_losses(ref_dir)
    _run(tiny_overrides(tiny_data_cache, out, **llama, **{"run.max_steps": 5}))
    _run(tiny_overrides(tiny_data_cache, out, **llama), resume=True)
    assert _train_losses(out) == losses
    capsys.readouterr()
    assert main(["--resume", str(out), "--model.norm=layernorm", "--model.position=learned"]) == 2
    err = capsys.readouterr().err
    assert "model.norm" in err and "model.position" in err and "does not fit" in err, err
    # Qwen3's two fields hold tensors too (the norms' gains; q and the projection's shapes); the heads
    # written as the size they are already (32 / 2) are the same network
    assert main(["--resume", str(out), "--model.qk_norm=true", "--model.head_size=12"]) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm: False -> True" in err and "model.head_size: 16 -> 12" in err and "does not fit" in err, err
    # said first, before the checks of the new settings (an export type qk_norm no longer fits would
    # name a fix that cannot work: the layout cannot change anyway)
    assert main(["--resume", str(out), "--model.qk_norm=true", "--model.hf_model_type=llama"]) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm: False -> True does not fit" in err and "hf_model_type" not in err, err
    assert main(["--resume", str(out), "--model.head_size=16", "--check"]) == 0, capsys.readouterr().err
    # OLMo 2's two fields: the norms sit elsewhere, and the q/k gains are as wide as the projections
    assert main(["--resume", str(out), "--model.norm_position=reordered", "--model.qk_norm=true",
                 "--model.qk_norm_scope=projection"]) == 2
    err = capsys.readouterr().err
    assert "model.norm_position: 'pre' -> 'reordered'" in err and "model.qk_norm_scope: 'head' -> 'projection'" in err


def test_the_run_header_names_the_layer_options():
    def options(cfg: ModelConfig) -> str:
        return ", ".join(cfg.layer_options())

    assert options(_cfg(ffn_hidden=None)) == ""  # (GPT-2's layout)
    assert options(_cfg()) == "MLP 48 wide"
    assert options(_cfg(ffn_hidden=None, activation="gelu_tanh", bias=False, tie_embeddings=False)) == \
        "tanh GeLU, no biases, untied output layer"
    assert options(_cfg(n_kv_head=2, rope_theta=5e5, **LLAMA)) == \
        "RMSNorm, rope (theta 500000), SwiGLU, MLP 48 wide, 2 key/value heads for 4, no biases"
    assert "1 key/value head for 4" in options(_cfg(n_kv_head=1))
    assert options(_cfg(head_size=12, qk_norm=True, **LLAMA)).endswith(", heads of 12, q/k norms, no biases")
    assert "heads of" not in options(_cfg(head_size=8, **LLAMA))  # (32 / 4: the default heads)
    olmo = _cfg(qk_norm=True, qk_norm_scope="projection", norm_position="reordered", **LLAMA)
    assert "reordered norms" in olmo.layer_options() and options(olmo).endswith(", q/k projection norms, no biases")
    assert olmo.layout_words().startswith(f"{olmo.n_layer} layers x {olmo.n_embd} hidden, seq {olmo.seq_len}, ")
    assert _cfg(kind="bert", norm_position="post", ffn_hidden=None).layer_options() == ["post-LN"]


def test_resume_takes_n_kv_head_as_used_and_names_the_way_to_another_rotary_context(tmp_path, tiny_data_cache, capsys):
    """n_kv_head = n_head is the attention None gives (so is ffn_hidden = 4 n_embd the default
    width): a resume that writes it the other way is not refused. A rotary run's seq_len holds no
    tensor's shape, but the samples its data position counts: refused, naming phases and the export."""
    from largebatch.train.cli import main
    from test_train import _run, tiny_overrides

    out = tmp_path / "run"
    rope = {"model.position": "rope", "model.norm": "rmsnorm"}
    _run(tiny_overrides(tiny_data_cache, out, **rope, **{"run.max_steps": 2}))
    capsys.readouterr()
    assert main(["--resume", str(out), "--model.n_kv_head=2", "--model.ffn_hidden=128", "--check"]) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    # qkv_bias = bias is what None gives; q/k/v biases the run has not are other tensors: refused
    assert main(["--resume", str(out), "--model.qkv_bias=true", "--check"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["--resume", str(out), "--model.qkv_bias=false", "--check"]) == 2
    assert "model.qkv_bias: True -> False" in capsys.readouterr().err
    assert main(["--resume", str(out), "--model.seq_len=64", "--check"]) == 2
    err = capsys.readouterr().err
    assert "model.seq_len: 32 -> 64" in err and "[[phases]]" in err and "--model.init_from=hf:OUT" in err, err
    assert "does not fit the model" not in err
