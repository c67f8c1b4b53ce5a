"""Sliding-window attention (ModelConfig.sliding_window, full_attention_layers): each position attends
to the W latest positions, itself included, on every layer but the full-attention ones.

The references are independent of the mask's code: the attention written out position by position
in float64 from the definition (i - W < j <= i, same document), a one-layer model against the same
model without a window run on the last W tokens alone, and the reach of an L-layer stack, L (W - 1)
positions. transformers' own Mistral, Ministral, Qwen2 and Qwen3 masks are the peers in
tests/test_hf_llama.py; the parallel layouts in tests/test_parallel.py and tests/test_pipeline.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.memory import apply_recompute, model_activation_bytes
from largebatch.memory.activations import attention_mask_bytes
from largebatch.models import ModelConfig, build_model
from largebatch.models.flops import flops_per_token
from largebatch.models.layers import AttentionMask, CoreAttention
from test_document_mask import kept_for_backward

SEP = 0
LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", bias=False)


def _reference(q, k, v, W, documents=None):
    """softmax(q_i k_j / sqrt(d)) v_j over the keys j with i - W < j <= i (and in i's document), in
    float64, one query at a time; q (B, a, Tq, d) holds the last Tq of the Tk positions; grouped
    query heads read K/V head h // (a / a_kv)."""
    B, a, Tq, d = q.shape
    Tk, group = k.size(2), a // k.size(1)
    out = torch.zeros(B, a, Tq, d, dtype=torch.float64)
    for b, h, r in itertools.product(range(B), range(a), range(Tq)):
        i = Tk - Tq + r
        keys = [j for j in range(Tk) if j <= i and (W is None or j > i - W)
                and (documents is None or documents[b, j] == documents[b, i])]
        scores = torch.stack([q[b, h, r].double() @ k[b, h // group, j].double() / math.sqrt(d) for j in keys])
        weights = torch.softmax(scores, 0)
        out[b, h, r] = sum(w * v[b, h // group, j].double() for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("attention, kv, W, docs, Tq", [
    (attention, kv, W, docs, Tq) for attention, kv, W, docs, Tq in itertools.product(
        ("explicit", "sdpa"), (4, 2), (1, 3, 40), (False, True), (12, 1)) if not (W == 40 and docs)])
def test_attention_within_the_window_is_the_definition(attention, kv, W, docs, Tq):
    """The core attention through the model's AttentionMask: W = 1 (each position itself), 3, and one
    longer than the sequence (the causal attention); grouped queries; within documents too; the last
    Tq = 1 of 12 positions (a decoding step's mask) as well as all of them."""
    torch.manual_seed(0)
    B, a, T, d = 2, 4, 12, 8
    config = ModelConfig(n_layer=1, n_embd=a * d, n_head=a, n_kv_head=kv, seq_len=T, attention=attention,
                         sliding_window=W, document_mask=docs, separator_id=SEP if docs else None, vocab_size=20)
    core = CoreAttention(config, window=W).double().eval()
    q, k, v = torch.randn(B, a, Tq, d).double(), torch.randn(B, kv, T, d).double(), torch.randn(B, kv, T, d).double()
    ids = torch.randint(1, 20, (B, T))
    ids[:, [3, 4, 9]] = SEP  # documents: [0, 3), [3], [4, 9), [9, 12)
    documents = (ids == SEP).cumsum(1) if docs else None
    if Tq == T:
        mask = AttentionMask(ids if docs else None, SEP, True, (W,), length=T, device=ids.device)
    else:
        mask = AttentionMask.decoding(documents, Tq, T, True, (W,), ids.device)
    mask.prepare(attention, q)
    torch.testing.assert_close(core(q, k, v, mask), _reference(q, k, v, W, documents), rtol=0, atol=1e-12)


def test_a_window_longer_than_the_keys_reads_no_mask_and_no_mask_is_refused():
    """A layer whose window covers every key computes the plain causal attention, bit for bit (no
    mask is made); one that needs its mask and is called without it says so."""
    config = ModelConfig(n_layer=1, n_embd=32, n_head=4, seq_len=16, sliding_window=16)
    q = k = v = torch.randn(1, 4, 16, 8)
    assert torch.equal(CoreAttention(config, window=16)(q, k, v), CoreAttention(config)(q, k, v))
    assert AttentionMask(None, None, True, (16,), length=16).reads(16) is False
    with pytest.raises(ValueError, match="sliding window 4 over 16 positions needs the model's AttentionMask"):
        CoreAttention(config, window=4)(q, k, v)


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_one_windowed_layer_reads_only_the_last_w_tokens(attention):
    """A one-layer rotary model with window W: the logits at each position are those of the same
    weights without a window run on the W tokens ending there (rotary positions are relative, so up
    to the rotary tables' fp32 rounding); without the window they are not."""
    torch.manual_seed(0)
    W, T = 4, 20
    config = ModelConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, seq_len=T, vocab_size=50, attention=attention,
                         sliding_window=W, **LLAMA)
    windowed = build_model(config).double().eval()
    plain = build_model(config.replace(sliding_window=None)).double().eval()
    plain.load_state_dict(windowed.state_dict())
    idx = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        logits = windowed(idx)[0]
        for i in range(T):
            alone = plain(idx[:, max(0, i - W + 1):i + 1])[0][:, -1]
            torch.testing.assert_close(logits[:, i], alone, rtol=0, atol=1e-8)
        assert (plain(idx)[0][:, W:] - logits[:, W:]).abs().max() > 1e-3


@pytest.mark.parametrize("full, reach", [((), 3 * 3), ((1,), None)])
def test_each_layer_reaches_w_minus_1_positions_further(full, reach):
    """Changing token j changes the logits at positions j .. j + L (W - 1) exactly, and no other, with
    the window on all L = 3 layers (W = 4); one full-attention layer carries it to the end."""
    torch.manual_seed(0)
    T, j = 32, 5
    config = ModelConfig(n_layer=3, n_embd=32, n_head=4, seq_len=T, vocab_size=50, sliding_window=4,
                         full_attention_layers=full, **LLAMA)
    model = build_model(config).double().eval()
    idx = torch.randint(1, 50, (1, T))
    other = idx.clone()
    other[0, j] = (idx[0, j] % 49) + 1
    with torch.no_grad():
        changed = (model(idx)[0] - model(other)[0]).abs().amax(-1)[0] > 0
    last = T - 1 if reach is None else j + reach
    assert changed.nonzero().flatten().tolist() == list(range(j, last + 1))


LAYOUTS = [dict(attention=attention, n_kv_head=kv, document_mask=docs, separator_id=SEP if docs else None,
                full_attention_layers=full, **extra)
           for attention, kv, docs, full, extra in itertools.product(
               ("explicit", "sdpa"), (None, 2), (False, True), ((), (1,)), ({}, {"position": "learned"}))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_decoding_with_a_cache_is_the_whole_forward(layout):
    """A prompt and then one token at a time through a KVCache give the logits of one forward over
    the whole sequence, with the window on every layer or on layers 0 and 2 only, within documents
    too, grouped queries, learned or rotary positions; greedy generation past seq_len (every token
    reading its last seq_len afresh) is the uncached one's."""
    torch.manual_seed(0)
    config = ModelConfig(n_layer=3, n_embd=32, n_head=4, seq_len=24, vocab_size=50, sliding_window=5,
                         **{**LLAMA, **layout})
    model = build_model(config).double().eval()
    idx = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        whole = model(idx)[0]
        cache = model.cache()
        steps = [model.decode(idx[:, :7], cache)] + [model.decode(idx[:, t:t + 1], cache) for t in range(7, 24)]
    torch.testing.assert_close(torch.stack(steps, 1), whole[:, 6:], rtol=0, atol=1e-12)
    prompt = idx[:1, :10]
    cached = model.generate(prompt, 30, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 30, temperature=0, use_cache=False))


def test_flops_count_the_window_columns_a_query_reads():
    """Training FLOPs per token: 3 x (L dense + the core of each layer at its own context + the output
    layer), a windowed layer's core 4 min(s, W) w, written out from the shapes; selective
    recomputation adds each recomputed layer's own core."""
    h, a, kv, d, f, s, v, W, L = 64, 4, 2, 16, 96, 256, 100, 32, 4
    config = ModelConfig(n_layer=L, n_embd=h, n_head=a, n_kv_head=kv, ffn_hidden=f, seq_len=s, vocab_size=v,
                         sliding_window=W, full_attention_layers=(3,), **LLAMA)
    w = a * d
    dense = 2 * (2 * h * w + 2 * h * kv * d + 3 * h * f)
    cores = [4 * W * w] * 3 + [4 * s * w]
    assert flops_per_token(config) == 3 * (L * dense + sum(cores) + 2 * h * v)
    assert flops_per_token(config, ["selective", "none", "none", "selective"]) == \
        3 * (L * dense + sum(cores) + 2 * h * v) + cores[0] + cores[3]
    # a window at least s long is the full attention
    assert flops_per_token(config.replace(sliding_window=s)) == \
        flops_per_token(config.replace(sliding_window=None, full_attention_layers=()))


@pytest.mark.parametrize("attention, docs, full", [("explicit", False, ()), ("sdpa", False, (1,)),
                                                   ("explicit", True, (1,)), ("sdpa", True, ())])
def test_the_memory_model_counts_the_masks_the_layers_keep(attention, docs, full):
    """Bytes kept for backward with the windows, less those of the same model without them, per
    recomputation policy: one s x s mask (every sequence alike) for the windowed layers without
    documents; with documents one of s x s b per distinct window (the full layers' documents-only mask
    and the windowed layers'), as bool (explicit) or fp32 values with rows padded to 8 (sdpa); the
    model's count of them."""
    b, s = 4, 60
    plain = ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=s, vocab_size=64, attention=attention,
                        document_mask=docs, separator_id=SEP if docs else None)
    windowed = plain.replace(sliding_window=7, full_attention_layers=full)
    torch.manual_seed(0)
    models = {c: build_model(c) for c in (plain, windowed)}
    models[windowed].load_state_dict(models[plain].state_dict())
    ids = torch.randint(1, 64, (b, s))
    ids[:, ::10] = SEP
    one = s * s if attention == "explicit" else s * 64 * 4
    sequences = b if docs else 1
    expected = one * sequences * (2 if docs and full else 1) - (one * sequences if docs else 0)  # (docs: one before)
    assert attention_mask_bytes(windowed, b, dtype_bytes=4) - attention_mask_bytes(plain, b, dtype_bytes=4) == expected
    for policy in ("none", "selective", "op", "full"):
        held = kept_for_backward(models, ids, policy)
        assert held[windowed] - held[plain] == expected, policy
        modelled = (model_activation_bytes(windowed, b, policy, dtype_bytes=4, device="cpu")
                    - model_activation_bytes(plain, b, policy, dtype_bytes=4, device="cpu"))
        assert modelled == expected


def test_compiled_blocks_take_the_windows_masks_without_a_graph_break():
    """Windowed and full-attention layers, within documents, compiled (the graphs, aot_eager) inside
    selective recomputation (the mask an argument of the recomputed region; the other policies:
    tests/test_document_mask.py): no graph break, and eager mode's loss and gradients."""
    policy = "selective"
    import torch._dynamo

    torch.manual_seed(0)
    config = ModelConfig(n_layer=3, n_embd=32, n_head=4, n_kv_head=2, seq_len=24, vocab_size=50, attention="sdpa",
                         sliding_window=5, full_attention_layers=(1,), document_mask=True, separator_id=SEP, **LLAMA)
    eager, compiled = build_model(config), build_model(config)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_recompute(model, policy)
    for block in compiled.blocks:
        block.compile(backend="aot_eager")
    ids = torch.randint(1, 50, (2, 24))
    ids[:, ::7] = SEP
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = [model(ids, ids)[1] for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_bf16_autocast_keeps_one_mask_in_the_queries_dtype():
    """Under bf16 autocast sdpa reads the mask in bf16 (the queries' dtype), made once for the layers."""
    config = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=50, attention="sdpa", sliding_window=3,
                         **LLAMA)
    model = build_model(config)
    idx = torch.randint(0, 50, (2, 16))
    mask = model.attention_mask(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = model.embed_input(idx)
        mask.prepare("sdpa", x)
        out = model.output_logits(model.run_blocks(x, mask))
    assert set(mask._made) == {(torch.bfloat16, 3)} and mask._made[torch.bfloat16, 3].shape == (1, 1, 16, 16)
    assert torch.isfinite(out.float()).all()


def test_bad_windows_name_the_field_and_the_fix(tmp_path, capsys):
    for fields, words in [
            ({"sliding_window": 0}, "sliding_window=0: must be a positive number of positions"),
            ({"sliding_window": 4, "kind": "bert"}, "sliding_window=4 with kind='bert': the window is the causal one"),
            ({"full_attention_layers": (1,)}, "full_attention_layers=[1] without sliding_window"),
            ({"sliding_window": 4, "full_attention_layers": (4,)}, "4 is not a layer index; give 0-based indices "
                                                                   "below n_layer=4"),
            ({"sliding_window": 4, "full_attention_layers": (1, 1)}, "names layer 1 twice"),
            ({"sliding_window": 4, "n_layer": 2, "full_attention_layers": (0, 1)}, "names every one of the 2 "
                                                                                   "layers, so sliding_window=4 "
                                                                                   "applies nowhere")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ModelConfig(**fields)
    # from the command line: one line before anything runs
    assert cli_main(["train", "--model.sliding_window=0", f"--run.out_dir={tmp_path}", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sliding_window=0" in err, err


def test_a_windowed_run_trains_reports_its_window_and_resumes_exactly(tiny_data_cache, tmp_path):
    """The trainer on real text with the window on 2 of 3 layers (sdpa): the log names it, the loss
    falls, and a run stopped after 4 steps and resumed ends on the uninterrupted run's losses. (That
    the window changes what the model computes: the tests above.)"""
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer
    from largebatch.train.metrics import read_metrics

    def fit(out, resume=False, lines=None, **extra) -> dict:
        o = {"model.n_layer": 3, "model.n_embd": 32, "model.n_head": 4, "model.seq_len": 32, "model.bias": False,
             "model.norm": "rmsnorm", "model.position": "rope", "model.activation": "swiglu",
             "model.attention": "sdpa", "model.sliding_window": 8, "model.full_attention_layers": [2],
             "data.cache_dir": str(tiny_data_cache), "data.vocab_size": 512, "schedule.peak_lr": 1e-2,
             "schedule.batch_size": 8, "run.micro_batch": 8, "run.total_tokens": 32 * 8 * 8, "run.eval_tokens": 512,
             "run.eval_every_tokens": 32 * 8 * 4, "run.tensorboard": False, "run.progress": "off",
             "run.sample_tokens": 0, "run.plots": False, "run.out_dir": str(out), "run.peak_flops": 1e11, **extra}
        log = (lambda *_: None) if lines is None else lines.append
        return Trainer(load_config(resolve_config(None), o), out, resume=resume, log=log).fit()

    lines: list[str] = []
    summary = fit(tmp_path / "whole", lines=lines)
    assert any("sliding window 8 on 2 of 3 layers" in line for line in lines), lines[:5]
    losses = [r["loss"] for r in read_metrics(tmp_path / "whole") if r["kind"] == "train"]
    assert losses[-1] < losses[0]
    assert fit(tmp_path / "split", **{"run.max_steps": 4})["stopped_early"]
    resumed = fit(tmp_path / "split", resume=True)
    assert resumed["final_val_loss"] == summary["final_val_loss"]
    assert [r["loss"] for r in read_metrics(tmp_path / "split") if r["kind"] == "train"] == losses


def test_the_memory_command_plans_the_window_and_keeps_a_transformers_configs_own(tmp_path, capsys):
    """`largebatch memory --sliding-window W --full-attention-layers ...` names the window in its header
    and the masks under its table, in its totals; a transformers config.json's windows are its own
    (another one given beside --hf-config is refused, as the other layer flags are)."""
    from transformers import MistralConfig

    from largebatch.memory.cli import main as memory_main

    base = ["--model", "llama3-8b", "--attention", "sdpa", "--seq-len", "8192"]
    assert memory_main(base + ["--sliding-window", "1024", "--full-attention-layers", "3,7"]) == 0
    out = capsys.readouterr().out
    assert "sliding window 1024 on 30 of 32 layers" in out.splitlines()[0]
    assert "+ the sliding window's mask, 128.0 MiB per micro-batch" in out  # 8192 x 8192 x 2 bytes
    docs = ["--document-mask", "true", "--micro-batch", "2"]  # (b = 2 masks of s x s a window)
    assert memory_main(base + ["--sliding-window", "1024"] + docs) == 0
    assert "+ the document mask within the sliding window, 256.0 MiB" in capsys.readouterr().out
    assert memory_main(base + ["--sliding-window", "1024", "--full-attention-layers", "3,7"] + docs) == 0
    assert "+ 2 attention masks (documents, and the sliding window's), 512.0 MiB" in capsys.readouterr().out
    MistralConfig(num_hidden_layers=2, sliding_window=4096, max_position_embeddings=32768).save_pretrained(tmp_path)
    assert memory_main(["--hf-config", str(tmp_path), "--seq-len", "8192"]) == 0
    assert "sliding window 4096" in capsys.readouterr().out.splitlines()[0]
    # fewer layers of a pattern: the pattern's first ones
    from transformers import MinistralConfig

    pattern = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    MinistralConfig(num_hidden_layers=6, sliding_window=512, layer_types=pattern, head_dim=128).save_pretrained(
        tmp_path / "ministral")
    assert memory_main(["--hf-config", str(tmp_path / "ministral"), "--layers", "3", "--seq-len", "4096"]) == 0
    assert "sliding window 512 on 2 of 3 layers" in capsys.readouterr().out.splitlines()[0]
    assert memory_main(["--hf-config", str(tmp_path), "--sliding-window", "512"]) == 2
    err = capsys.readouterr().err
    assert "--model.sliding_window 512 with --hf-config" in err and "compute model.sliding_window=4096" in err, err
