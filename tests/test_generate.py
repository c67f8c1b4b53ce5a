"""Generation with a KV cache (largebatch.models.layers.KVCache, GPT.decode / generate) and the
`largebatch generate` command: each cached step's logits against the model's whole-context forward
in float64, greedy tokens against transformers' own generate on the exported run, the nucleus
against a numpy reference, and the command on a real tiny run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.export import load_run
from largebatch.models import ModelConfig, build_model
from largebatch.models.gpt import sampling_logits
from largebatch.models.layers import KVCache

SEP = 3
LAYOUTS = {
    "gpt2": {},
    "explicit": {"attention": "explicit"},
    "llama-gqa": {"norm": "rmsnorm", "position": "rope", "activation": "swiglu", "n_kv_head": 2},
    "llama-gqa-explicit": {"position": "rope", "n_kv_head": 2, "attention": "explicit"},
    "llama3-scaled": {"position": "rope", "rope_scaling": "llama3", "rope_factor": 8.0,
                      "rope_original_seq_len": 8},
    "documents": {"document_mask": True, "separator_id": SEP},
    # GPT-NeoX's: attention and MLP in parallel, a quarter of each head of 8 rotated (at each cached offset)
    "neox": {"position": "rope", "rope_fraction": 0.25, "norm_position": "parallel"},
    "documents-rope-explicit": {"document_mask": True, "separator_id": SEP, "position": "rope",
                                "attention": "explicit", "n_kv_head": 2},
}


def _model(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(kind="gpt", vocab_size=50, n_layer=2, n_head=4, n_embd=32, seq_len=16, dropout=0.0, **extra)
    model = build_model(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights far from the init: logits of order 1, which pick distinct tokens
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_cached_step_gives_the_whole_context_logits(layout):
    """A prompt of 5 positions, then one position at a time up to seq_len: each step's logits equal
    the last row of the whole-context forward (float64, to rounding). Past seq_len, generate reads
    the last seq_len tokens afresh: its greedy tokens equal the cache-less loop's (the context
    window read whole for every token)."""
    model = _model(**LAYOUTS[layout])
    idx = torch.randint(4, 50, (3, 5), generator=torch.Generator().manual_seed(2))
    idx[0, 2] = idx[1, 0] = SEP  # documents start inside the prompt (and at its first position)
    tokens = torch.cat([idx, torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(3))], 1)
    tokens[2, 9] = SEP  # and inside the decoded part
    cache = model.cache()
    with torch.no_grad():
        whole = model(tokens)[0]  # (3, 16, v)
        steps = [model.decode(tokens[:, :5], cache)]
        steps += [model.decode(tokens[:, t:t + 1], cache) for t in range(5, 16)]
    assert cache.offset == 16 and not cache.room(1)
    for t, logits in zip(range(4, 16), steps):
        torch.testing.assert_close(logits, whole[:, t], rtol=0, atol=1e-12)
    greedy = model.generate(idx, 30, temperature=0)  # 35 tokens: the window moves 19 times
    assert greedy.shape == (3, 35) and torch.equal(greedy, model.generate(idx, 30, temperature=0, use_cache=False))
    drawn = []  # and drawn at temperature 1 from the same random state: the same draws
    for use_cache in (True, False):
        torch.manual_seed(4)
        drawn.append(model.generate(idx, 30, use_cache=use_cache))
    assert torch.equal(*drawn) and len(set(drawn[0][:, 5:].flatten().tolist())) > 10


def test_the_cache_holds_each_layers_keys_and_values_once_and_refuses_what_does_not_fit():
    model = _model(position="rope", n_kv_head=2)
    cache = model.cache()
    model.decode(torch.randint(0, 50, (3, 6)), cache)
    # 2 L B a_kv s d values, allocated once at the model's seq_len
    assert sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values)) == 2 * 2 * 3 * 2 * 16 * 8
    pointers = [layer.keys.data_ptr() for layer in cache.layers]
    model.decode(torch.randint(0, 50, (3, 1)), cache)
    assert [layer.keys.data_ptr() for layer in cache.layers] == pointers and cache.offset == 7
    with pytest.raises(ValueError, match=r"decode: 7 cached positions \+ 10 new exceed the model's seq_len 16"):
        model.decode(torch.randint(0, 50, (3, 10)), cache)
    with pytest.raises(ValueError, match="a cache serves one batch of sequences; reset it"):
        model.decode(torch.randint(0, 50, (2, 1)), cache)
    cache.reset()
    model.decode(torch.randint(0, 50, (2, 4)), cache)  # another batch after a reset
    assert cache.offset == 4 and cache.layers[0].keys.shape == (2, 2, 16, 8)
    with pytest.raises(ValueError, match="capacity=0"):
        KVCache(2, 0)
    small = KVCache(2, 8)  # one of the user's own, shorter than the model's context
    model.decode(torch.randint(0, 50, (1, 5)), small)
    with pytest.raises(ValueError, match="5 cached positions \\+ 5 new exceed the cache's capacity 8"):
        model.decode(torch.randint(0, 50, (1, 5)), small)
    with pytest.raises(ValueError, match="a KVCache of capacity 32 for a model of seq_len 16"):
        model.decode(torch.randint(0, 50, (1, 5)), KVCache(2, 32))
    model.float()  # the cache holds float64 keys; the next step's are float32
    with pytest.raises(ValueError, match="held as .*torch.float64.*one dtype \\(the same autocast\\)"):
        model.decode(torch.randint(0, 50, (1, 1)), small)
    model.double()
    for bad in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool), torch.zeros(2)):
        with pytest.raises(ValueError, match="give integer ids of shape \\(batch, T\\) with T >= 1"):
            model.decode(bad, model.cache())
    fresh = model.cache()
    with torch.enable_grad():  # decoding keeps no graph, whatever the caller's mode
        assert not model.decode(torch.randint(0, 50, (1, 3)), fresh).requires_grad
    assert not fresh.layers[0].keys.requires_grad



def _nucleus_reference(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float) -> np.ndarray:
    """Which tokens may be drawn, written from the definition: the top_k most likely (ties at the
    k-th kept), then the most likely ones while the mass of those before stays below top_p."""
    z = logits / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    mass = 0.0
    for i in np.argsort(-p, kind="stable"):
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += p[i]
    return keep


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, 0.9), (0.7, None, 0.5), (1.3, 20, 0.8),
                                                       (1.0, 5, 1.0), (1.0, None, 1e-9), (2.0, 40, 0.999)])
def test_the_nucleus_and_top_k_keep_the_tokens_the_definition_keeps(temperature, top_k, top_p):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    kept = torch.isfinite(sampling_logits(logits, temperature, top_k, top_p))
    for row in range(4):
        expected = _nucleus_reference(logits[row].numpy(), temperature, top_k, top_p)
        assert kept[row].numpy().tolist() == expected.tolist()
    assert bool(kept.any(dim=1).all())  # the most likely token always stays
    # what stays keeps its temperature-scaled value: the draw is from the renormalised softmax
    torch.testing.assert_close(sampling_logits(logits, temperature, top_k, top_p)[kept], (logits / temperature)[kept])


def test_draws_follow_the_nucleus_distribution():
    """10,000 draws from one row: every token drawn is in the nucleus, and each one's frequency is
    its renormalised probability (to 4.5 binomial standard deviations)."""
    model = _model()
    logits = torch.tensor([[4.0, 3.0, 2.5, 2.0, 0.0, -1.0]], dtype=torch.float64)
    from largebatch.models.gpt import sample_next

    torch.manual_seed(0)
    draws = torch.cat([sample_next(logits.expand(1000, -1), 1.0, None, 0.8) for _ in range(10)]).flatten()
    p = torch.softmax(logits[0], 0)
    nucleus = p[:3] / p[:3].sum()  # 0.53 + 0.20 < 0.8 <= 0.53 + 0.20 + 0.12
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[3:].sum() == 0
    sd = (nucleus * (1 - nucleus) / 10000).sqrt()
    assert ((counts[:3] / 10000 - nucleus).abs() < 4.5 * sd).all(), (counts, nucleus)
    assert model is not None


def test_a_row_that_draws_the_stop_token_ends_and_generation_ends_with_the_last_row():
    model = _model()
    idx = torch.randint(4, 50, (2, 3), generator=torch.Generator().manual_seed(7))
    free = model.generate(idx, 12, temperature=0)
    stop = int(free[0, 5])  # the token row 0 draws third
    out = model.generate(idx, 12, temperature=0, stop_id=stop)
    first = {row: (free[row, 3:] == stop).nonzero() for row in range(2)}
    for row in range(2):  # up to its stop token as without one, then the stop token only
        end = 3 + int(first[row][0]) if len(first[row]) else out.size(1)
        assert torch.equal(out[row, :end + 1], free[row, :end + 1][: out.size(1)])
        assert bool((out[row, end:] == stop).all())
    if len(first[1]) == 0:  # row 1 never stops: all 12 tokens
        assert out.shape == (2, 15)
    with pytest.raises(ValueError, match=r"stop_id=50: must be a token id in \[0, 50\)"):
        model.generate(idx, 2, stop_id=50)
    with pytest.raises(ValueError, match=r"top_p=0: must be a number in \(0, 1\]"):
        model.generate(idx, 2, top_p=0)


def test_layers_compiled_in_place_generate_without_compiling():
    """The trainer compiles each block in place (run.compile); a cached decode would compile again for
    every length. generate runs them eagerly: no frame is compiled, and the tokens are the eager ones."""
    from torch._dynamo.utils import counters

    model = _model(position="rope")
    idx = torch.randint(0, 50, (1, 4))
    eager = model.generate(idx, 6, temperature=0)
    for block in model.blocks:
        block.compile()
    counters.clear()
    assert torch.equal(model.generate(idx, 6, temperature=0), eager)
    assert not counters["frames"]["ok"]


# --- the command, on a real tiny run ------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_run(tiny_data_cache, tmp_path_factory):
    from test_export import tiny, train

    return train(tiny(tiny_data_cache, tmp_path_factory.mktemp("runs") / "gpt", **{
        "run.sample_tokens": 20, "run.sample_prompt": "ROMEO:", "model.seq_len": 64,
        "run.total_tokens": 64 * 8 * 12}))


def generate(capsys, *args) -> tuple[int, str, str]:
    code = cli_main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_draws_the_runs_own_sample_and_transformers_greedy_tokens(gpt_run, tmp_path, capsys):
    """With the trainer's defaults (its run.sample_tokens among them) the command writes summary.json's
    sample again; greedy, the tokens are the ones transformers' generate (its own KV cache) picks on
    the exported run."""
    from transformers import AutoModelForCausalLM

    sample = json.loads((gpt_run / "summary.json").read_text())["sample"]
    code, out, err = generate(capsys, gpt_run, "--prompt", "ROMEO:")
    assert code == 0 and out == sample + "\n", (out, sample, err)
    assert "step 12 (step_00000012.pt): 1 sample(s)" in err and "tokens/s" in err

    code, out, err = generate(capsys, gpt_run, "--prompt", "ROMEO:", "--max-new-tokens", 40, "--temperature", 0,
                              "--no-stop", "--json")
    assert code == 0, err
    result = json.loads(out)
    ours = result["samples"][0]["new_ids"]
    assert len(ours) == 40 and result["step"] == 12 and result["seed"] == 1337
    assert cli_main(["export", str(gpt_run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf.generation_config.eos_token_id = None  # (--no-stop)
    prompt = torch.tensor([load_run(gpt_run).tokenizer.encode("ROMEO:").ids])
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    assert theirs[0, prompt.size(1):].tolist() == ours


def test_samples_prompts_from_files_and_the_separator(gpt_run, tmp_path, capsys, monkeypatch):
    code, out, err = generate(capsys, gpt_run, "--samples", 3, "--max-new-tokens", 30, "--top-p", 0.9, "--seed", 4,
                              "--json")
    result = json.loads(out)
    rows = result["samples"]
    assert code == 0 and len(rows) == 3 and result["prompt_tokens"] == 1  # empty: from <|endoftext|>
    assert len({tuple(r["new_ids"]) for r in rows}) == 3  # three draws, one batch
    for r in rows:
        assert r["ended_at_separator"] == (r["new_ids"][-1] == 0) and 0 not in r["new_ids"][:-1]
        assert len(r["new_ids"]) <= 30
    (tmp_path / "p.txt").write_text("KING HENRY:\n")
    code, out, _ = generate(capsys, gpt_run, "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 5,
                            "--temperature", 0)
    assert code == 0 and out.startswith("KING HENRY:\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("KING HENRY:\n"))
    code, piped, _ = generate(capsys, gpt_run, "--prompt-file", "-", "--max-new-tokens", 5, "--temperature", 0)
    assert code == 0 and piped == out


@pytest.mark.parametrize("args, words", [
    (["--top-p", "0"], "--top-p 0: must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature -1: must be >= 0"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--max-new-tokens", "2.5"], "'2.5' is not a whole number"),
    (["--prompt", "a", "--prompt-file", "x"], "not allowed with argument"),
    (["--prompt-file", "{tmp}/missing.txt"], "missing.txt': cannot be read"),
    (["--device", "cuda:9"], "--device cuda:9"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--checkpoint", "999"], "999"),
    (["--ema"], "weight average"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--prompt-file", "{tmp}/latin1.txt"], "latin1.txt': cannot be read (not UTF-8 text)"),
    (["--seed", str(2**64)], "--seed must be in [-2^63, 2^64)"),
    (["--prompt", "ROM\udcc9O:"], "--prompt is not UTF-8 text"),  # a terminal's latin-1 bytes, as Python passes them
])
def test_bad_input_gives_one_line_errors(gpt_run, tmp_path, capsys, args, words):
    (tmp_path / "latin1.txt").write_bytes("ROMÉO:".encode("latin-1"))
    code, out, err = generate(capsys, gpt_run, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err, err
    assert err.startswith("largebatch generate: error:")


def test_the_prompt_is_encoded_as_the_training_text_was(gpt_run, tmp_path, capsys):
    """Without the special tokens a tokenizer's post-processor adds (a Llama tokenizer's <s>, BERT's
    [CLS] ... [SEP]): the training stream never held them. Here the run's own vocabulary with a
    post-processor that puts the separator around the text: the prompt is still the text's tokens."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(str(gpt_run / "tokenizer.json"))
    plain = tokenizer.encode("ROMEO:").ids
    tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A <|endoftext|>",
                                                  special_tokens=[("<|endoftext|>", 0)])
    assert tokenizer.encode("ROMEO:").ids == [0, *plain, 0]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    code, out, err = generate(capsys, gpt_run, "--prompt", "ROMEO:", "--max-new-tokens", 20, "--json",
                              "--tokenizer", tmp_path / "tokenizer.json")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == len(plain)
    code, again, _ = generate(capsys, gpt_run, "--prompt", "ROMEO:", "--max-new-tokens", 20, "--json")
    assert json.loads(out)["samples"] == json.loads(again)["samples"]


def test_a_failed_step_leaves_the_cache_as_it_was():
    model = _model(document_mask=True, separator_id=SEP)
    cache = model.cache()
    model.decode(torch.tensor([[SEP, 5, 6], [7, SEP, 8]]), cache)
    documents, start = cache.documents.clone(), cache.start
    with pytest.raises(ValueError, match="3 sequences after 3 cached positions of 2: a cache serves one batch"):
        model.decode(torch.tensor([[1], [2], [3]]), cache)
    assert torch.equal(cache.documents, documents) and cache.start is start and cache.offset == 3
    model.decode(torch.tensor([[9], [SEP]]), cache)  # and it goes on
    assert cache.documents.tolist() == [[1, 1, 1, 1], [0, 1, 1, 2]]


def test_a_run_directory_that_is_missing_or_a_transformers_export(tmp_path, capsys):
    code, _, err = generate(capsys, tmp_path / "nothing")
    assert code == 2 and "is not a directory" in err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    code, _, err = generate(capsys, tmp_path / "hf")
    assert code == 2 and "is a transformers directory" in err


def test_generate_is_listed(capsys):
    assert cli_main([]) == 0 and "generate" in capsys.readouterr().out
    assert cli_main(["generate", "--help"]) == 0 and "--top-p" in capsys.readouterr().out
    assert Path(__file__).exists()


def test_a_checkpoint_in_a_short_phase_reads_the_positions_it_trained(tiny_data_cache, tmp_path, capsys):
    """[[phases]] at 16 then 48 tokens: the checkpoint in the first phase has trained 16 positions only,
    so the command's model reads the last 16 tokens (greedy: the tokens of a loop that reads them)."""
    from test_export import tiny

    phases = tmp_path / "phases.toml"
    phases.write_text("[[phases]]\nseq_len = 16\ntotal_tokens = 1536\n\n[[phases]]\nseq_len = 48\n"
                      "total_tokens = 1536\n")
    overrides = tiny(tiny_data_cache, tmp_path / "run", **{"run.checkpoint_every_tokens": 1024,
                                                           "run.keep_checkpoints": 5})
    from largebatch.train.cli import resolve_config
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer

    Trainer(load_config(resolve_config(str(phases)), overrides), tmp_path / "run", log=lambda *_: None).fit()
    code, out, err = generate(capsys, tmp_path / "run", "--prompt", "ROMEO:", "--checkpoint", 8, "--temperature", 0,
                              "--max-new-tokens", 30, "--no-stop", "--json")
    assert code == 0 and "trained sequences of 16 tokens only" in err, err
    loaded = load_run(tmp_path / "run", checkpoint=8)
    model = loaded.model.eval()
    ids = loaded.tokenizer.encode("ROMEO:", add_special_tokens=False).ids
    with torch.no_grad():
        for _ in range(30):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0][0, -1].argmax()))
    result = json.loads(out)
    assert result["samples"][0]["new_ids"] == ids[-30:] and result["context"] == 16
    code, out, err = generate(capsys, tmp_path / "run", "--prompt", "ROMEO:", "--max-new-tokens", 5, "--json")
    assert code == 0 and "trained sequences" not in err and json.loads(out)["context"] == 48  # every position
