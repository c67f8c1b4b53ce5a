"""The planner and `largebatch memory`: the paper's 5.4x, least-FLOPs plans, nothing-fits advice."""

from __future__ import annotations

import re

import pytest

from largebatch.memory.activations import first_stage_layers
from largebatch.memory.cli import main
from largebatch.memory.estimate import GIB
from largebatch.memory.planner import Setup, cheapest_plan, mixes
from largebatch.models import flops_per_token, preset


def test_cli_reproduces_gpt3_5_4x(capsys):
    assert main(["--model", "gpt3-175b", "--seq-len", "2048", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "tensor + sequence parallel + selective" in line)
    assert row.rstrip().endswith("5.4x")
    # per layer, in MiB, from docs/papers.md: memory directly: 34 s b h / t and s b h (10 + 24/t + 5as/(ht))
    s, h, a, t = 2048, 12288, 96, 8
    assert f"{34 * s * h / t / 2**20:.1f} MiB" in row
    tp_row = next(line for line in out.splitlines() if line.strip().startswith("tensor parallel  "))
    assert f"{s * h * (10 + 24 / t + 5 * a * s / (h * t)) / 2**20:.1f} MiB" in tp_row


def test_plan_is_the_cheapest_fitting_mix_by_brute_force():
    c = preset("gpt3-175b")
    setup = Setup(tp=8, pp=8, sequence_parallel=True, micro_batch=2)
    budget = 60 * GIB
    plan = cheapest_plan(c, setup, budget)
    assert plan is not None and plan.memory.total <= budget
    # independent check: no fitting mix has fewer recompute FLOPs
    base = flops_per_token(c)
    for policies in mixes(c.n_layer // setup.pp):
        if setup.estimate(c, policies).total <= budget:
            extra = flops_per_token(c, policies * setup.pp) / base - 1
            assert extra >= plan.recompute_overhead - 1e-12
    assert "selective" in plan.policies  # 1 full + 11 selective at these sizes


def test_cli_plan_and_auto_micro_batch(capsys):
    assert main(["--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--sequence-parallel",
                 "--micro-batch", "auto", "--budget-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Plan: micro-batch \d+", out)
    assert 'apply_recompute policy (each pipeline stage): ["none"] * 12' in out


def test_cli_says_what_would_fit(capsys):
    assert main(["--model", "gpt3-175b", "--tp", "8", "--budget-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "Nothing fits in 80 GiB" in out and "Would fit: --tp 8 --sequence-parallel --pp" in out


def _suggestions(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 1
    return re.search(r"Would fit: (.*)", capsys.readouterr().out).group(1).split("; ")


def test_every_suggestion_runs_as_printed(capsys):
    """A larger tp came with --sequence-parallel even where tp does not divide the sequence, which the
    command then refuses (seq 1001: every suggestion); without --pp-micro-batches, the default count
    at pp 1 (2) was carried to the suggested pp as if asked for."""
    base = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--vocab", "1000", "--budget-gib", "0.3"]
    odd = _suggestions(capsys, [*base, "--seq-len", "1001"])
    assert any(fix.startswith("--tp 2 ") for fix in odd) and not any("--sequence-parallel" in fix for fix in odd)
    # asked for sequence parallelism: only a tp that splits the sequence (1002 = 2 x 501)
    even = _suggestions(capsys, [*base, "--seq-len", "1002", "--tp", "2", "--sequence-parallel"])
    assert even and all(fix.startswith("--tp 2 --sequence-parallel ") for fix in even)
    medium = _suggestions(capsys, ["--model", "gpt2-medium", "--budget-gib", "4"])
    assert "--tp 1 --pp 2" in medium and not any("--pp-micro-batches" in fix for fix in medium)
    for argv, fixes in (([*base, "--seq-len", "1001"], odd), ([*base, "--seq-len", "1002"], even),
                        (["--model", "gpt2-medium", "--budget-gib", "4"], medium)):
        for fix in fixes:
            assert main([*argv, *fix.split()]) == 0, fix
            capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--layers", "1000000000"], "--layers 1,000,000,000: at most 100,000"),  # (it ran for minutes before)
    (["--heads", "7"], "n_head=7 does not divide n_embd=256"),
    (["--tp", "3"], "tp=3 does not divide heads=4"),
    (["--tp", "4", "--seq-len", "1001", "--sequence-parallel"], "tp=4 does not divide seq_len=1001"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),  # as the trainer refuses it
    (["--micro-batch", "big"], "--micro-batch 'big'"),
    (["--micro-batch", "0"], "--micro-batch '0': give a positive integer"),  # (was "micro_batch=0")
    (["--model.dropout", "1.5"], "--model.dropout=1.5: must be in [0, 1)"),  # (was "ModelConfig.dropout")
    (["--pp", "3"], "pp=3"),
    (["--pp", "2", "--pp-micro-batches", "0"], "--pp-micro-batches 0: must be a positive"),
    (["--dtype-bytes", "1e30"], "--dtype-bytes 1e+30: bytes per stored value"),
    (["--dtype-bytes", "0"], "--dtype-bytes 0: bytes per stored value")])
def test_cli_bad_input(argv, words, capsys):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_planner_reads_a_training_config(capsys, tmp_path, monkeypatch):
    """`largebatch memory --config run.toml` predicts for that run's model, micro-batch and mesh."""
    from largebatch.memory.cli import main as memory_main

    config = tmp_path / "run.toml"
    config.write_text('[model]\nn_layer = 3\nn_embd = 128\nn_head = 4\nseq_len = 64\n'
                      '[data]\nvocab_size = 2048\n[run]\nmicro_batch = 4\n'
                      '[parallel]\ntp = 2\nsequence_parallel = true\n')
    assert memory_main(["--config", str(config), "--budget-gib", "1"]) == 0
    from_config = capsys.readouterr().out
    assert memory_main(["--layers", "3", "--hidden", "128", "--heads", "4", "--seq-len", "64",
                        "--vocab", "2048", "--micro-batch", "4", "--tp", "2", "--sequence-parallel",
                        "--dtype-bytes", "4", "--optimizer", "lamb", "--parallel.loss_parallel", "false",
                        "--budget-gib", "1"]) == 0
    assert from_config == capsys.readouterr().out
    assert "s=64 b=4 h=128 a=4 t=2 L=3" in from_config
    # a shipped config by name, as `largebatch train` takes it (it was "does not exist" outside the
    # repository root, where configs/ is)
    from largebatch.arguments import shipped_configs

    monkeypatch.chdir(tmp_path)
    assert memory_main(["--config", "bert-large-lans"]) == 0
    by_name = capsys.readouterr().out
    assert memory_main(["--config", str(shipped_configs()["bert-large-lans"])]) == 0
    assert by_name == capsys.readouterr().out and "L=24" in by_name
    # the docs' spelling (a path in the repository) means the shipped file where no such file exists
    for spelling in ("configs/bert-large-lans.toml", "bert-large-lans.toml"):
        assert memory_main(["--config", spelling]) == 0
        assert capsys.readouterr().out == by_name
    (tmp_path / "configs").mkdir()  # a file of the user's own at that path comes first
    (tmp_path / "configs" / "bert-large-lans.toml").write_text("[model]\nn_layer = 3\n")
    assert memory_main(["--config", "configs/bert-large-lans.toml"]) == 0
    assert "L=3" in capsys.readouterr().out
    assert memory_main(["--config", "other/bert-large-lans.toml"]) == 2
    capsys.readouterr()
    assert memory_main(["--config", "bert-large-lasn"]) == 2
    assert "neither a file nor a shipped config; shipped: bert-base" in capsys.readouterr().err


def test_planner_reads_the_run_fields_that_change_the_answer(capsys, tmp_path):
    """`--config` planned every run as 2-byte activations with AdamW's state and no recompute: an fp32
    run (the trainer's default) was predicted at half its activations, a LARS run with 8 bytes of
    state a parameter, a GPipe run at m = 2 pp micro-batches whatever its batch. run.dtype, optim.name,
    run.recompute and the step's micro-batches (schedule.batch_size / (micro_batch x dp)) now count;
    flags given explicitly still win."""
    from largebatch.memory import activation_bytes_per_layer

    def run(text, *flags):
        config = tmp_path / "run.toml"
        config.write_text('[model]\nn_layer = 4\nn_embd = 128\nn_head = 4\nseq_len = 64\n'
                          'dropout = 0.0\nattention = "explicit"\n' + text)
        assert main(["--config", str(config), *flags]) == 0
        return capsys.readouterr().out

    def layer_mib(out):
        return float(re.search(r"no parallelism\s+([\d.]+) MiB", out).group(1))

    # the paper's per-layer count, s b h (34 + 5 a s / h) at 2 bytes, without dropout: less the two
    # 1-byte sbh masks, the a s^2 b mask and the 2 a s^2 b dropout output (the softmax output serves)
    s, b, h, a = 64, 1, 128, 4
    paper = s * b * h * (34 + 5 * a * s / h) - 2 * s * b * h - 3 * a * s * s * b
    assert paper == activation_bytes_per_layer(s, b, h, a, dropout=False)
    assert layer_mib(run("")) == round(2 * paper / 2**20, 1)  # fp32 by default: 4 bytes
    bf16 = run('[run]\ndtype = "bf16"\n')
    assert layer_mib(bf16) == round(paper / 2**20, 1) and "under torch.autocast" in bf16
    assert layer_mib(run('[run]\ndtype = "bf16"\n', "--dtype-bytes", "4")) == round(2 * paper / 2**20, 1)
    state = {}
    for name in ("lamb", "lars", "adamw"):
        out = run(f'[optim]\nname = "{name}"\n')
        big = run(f'[optim]\nname = "{name}"\n', "--hidden", "1024", "--heads", "16")
        state[name] = float(re.search(r"optimizer ([\d.]+)\)", big).group(1))
        assert out == run("", "--optimizer", name)
    assert state["lars"] < state["lamb"] == state["adamw"]  # one buffer against two moments
    out = run('[run]\nrecompute = ["selective"]\n')
    assert "the config's run.recompute = selective:" in out
    out = run('[run]\nrecompute = ["full", "selective", "none", "none"]\n')
    assert "run.recompute = ['full', 'selective', 'none', 'none']:" in out
    # spelled on the command line as largebatch train spells it (it was "unrecognized arguments")
    flag = run('[run]\nrecompute = ["selective"]\n', "--run.recompute=full,selective,none,none")
    assert flag.replace("--run.recompute", "the config's run.recompute") == out
    gpipe = ('tie_embeddings = false\n[run]\nmicro_batch = 1\n[parallel]\npp = 2\npp_schedule = "gpipe"\n'
             '[schedule]\nbatch_size = 16\n')
    out = run(gpipe)
    assert "m = 16" in out and "4.00 layers" not in out
    assert "First pipeline stage, p = 2, m = 16" in out
    assert "m = 4," in run(gpipe, "--pp-micro-batches", "4")
    phases = gpipe + '[[phases]]\ntokens = 1000\n[[phases]]\ntokens = 1000\nschedule = {batch_size = 32}\n'
    assert "m = 16," in run(phases, "--phase", "0") and "m = 32," in run(phases, "--phase", "1")


def test_memory_assumes_the_trainers_defaults():
    """--config fills the fields a TOML leaves out with the trainer's defaults, kept in the memory
    layer (which cannot import the trainer)."""
    from largebatch.memory.cli import TRAIN_DEFAULTS
    from largebatch.train.config import TrainConfig

    cfg = TrainConfig()
    assert TRAIN_DEFAULTS == {"run.dtype": cfg.run.dtype, "optim.name": cfg.optim.name,
                              "parallel.loss_parallel": cfg.parallel.loss_parallel}


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_logits_gathered_without_the_vocabulary_parallel_loss(kind, capsys, tmp_path):
    """The model counted the fp32 logits split over the vocabulary (4 s b v / t, the paper's layout)
    whatever the run did; without parallel.loss_parallel (the trainer's default) every rank holds
    them whole: 4 s b v (1 - 1/t) more (BERT: on the masked positions, mask_fraction of them)."""
    from largebatch.memory import estimate

    c = preset("bert-base" if kind == "bert" else "gpt2-small")
    s, b, v, t = c.seq_len, 4, c.vocab_size, 2
    split = estimate(c, b, tp=t, sequence_parallel=True).activations
    whole = estimate(c, b, tp=t, sequence_parallel=True, loss_parallel=False).activations
    share = 0.15 if kind == "bert" else 1.0
    assert whole - split == pytest.approx(share * s * b * 4 * v * (1 - 1 / t), rel=1e-12)
    assert estimate(c, b, loss_parallel=False).activations == estimate(c, b).activations  # tp = 1
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nkind = "{kind}"\nn_layer = 2\nn_embd = 64\nn_head = 2\nseq_len = 64\n'
                      '[parallel]\ntp = 2\n')
    assert main(["--config", str(config)]) == 0
    assert "Output logits (fp32): gathered, the whole vocabulary on every rank" in capsys.readouterr().out
    config.write_text(config.read_text() + "loss_parallel = true\n")
    assert main(["--config", str(config)]) == 0
    assert "Output logits (fp32): split over the vocabulary" in capsys.readouterr().out


def test_what_would_fit_runs_as_suggested(capsys):
    """The suggestion at another pp kept the asked GPipe micro-batch count, while the command re-run
    with the suggested flags used 2 x the new pp: "Nothing fits" again. It now names m."""
    assert main(["--model", "gpt3-175b", "--pp", "2", "--pp-schedule", "gpipe", "--pp-micro-batches", "4",
                 "--budget-gib", "10"]) == 1
    out = capsys.readouterr().out
    first = re.search(r"Would fit: ([^;\n]+)", out).group(1)
    assert "--pp-micro-batches 4" in first
    assert main(["--model", "gpt3-175b", "--pp-schedule", "gpipe", "--budget-gib", "10", *first.split()]) == 0


def _hand_hf_gpt2_bytes(s, b, h, a, f, v, L, d, policies):
    """A transformers eager GPT-2 (dropout on, 1-byte GPU masks), written from what each op keeps
    (docs/memory.md): per token of a layer, LayerNorm inputs, Q/K/V input, fc1 input (4 h d); Q, K,
    V and the projection input (4 h d); GeLU input and fc2 input (2 f d); gelu_new's tanh output,
    0.5 x and 1 + tanh (3 f d); two residual dropout masks (2 h); softmax output, its mask and its
    dropout output (a s (2 d + 1)). Selective drops the last term, full keeps the input (h d).
    Outside the layers: the embedding dropout mask (h), the final-norm and projection inputs (2 h d)
    and the fp32 logits (4 v); once any layer is recomputed, the causal mask its checkpoint keeps, a
    float (b, 1, s, s) in d bytes (measured: tests/test_memory_hf.py)."""
    none = 8 * h * d + 5 * f * d + 2 * h + a * s * (2 * d + 1)
    per_token = {"none": none, "selective": none - a * s * (2 * d + 1), "full": h * d}
    layers = sum(per_token[p] for p in policies)
    mask = b * s * s * d if any(p != "none" for p in policies) else 0
    return s * b * (layers + h + 2 * h * d + 4 * v) + mask


def test_planner_counts_transformers_eager_layers_by_hand(capsys, tmp_path):
    import json

    from largebatch.memory.hf import config_from_hf

    raw = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 256,
           "vocab_size": 100}  # transformers' defaults: gelu_new, dropout 0.1
    config = config_from_hf(raw)
    s, b, h, a, f, v, d = 256, 2, 64, 4, 256, 100, 2
    eager = Setup(micro_batch=b, seq_len=s, hf_activation="gelu_new")
    closed = Setup(micro_batch=b, seq_len=s)
    for policies in (["none"] * 4, ["full", "selective", "none", "none"], ["full"] * 4):
        hand = _hand_hf_gpt2_bytes(s, b, h, a, f, v, 4, d, policies)
        assert eager.estimate(config, policies).activations == pytest.approx(hand, rel=1e-12)
    # a budget the closed form meets with no recomputation but transformers' layers do not
    fits_closed = closed.estimate(config, "none").total
    assert eager.estimate(config, "none").total > fits_closed
    plan = cheapest_plan(config, eager, fits_closed)
    assert plan is not None and plan.policies != ["none"] * 4
    assert cheapest_plan(config, closed, fits_closed).policies == ["none"] * 4
    # the CLI plans the same way and says so
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert main(["--hf-config", str(path), "--micro-batch", str(b), "--budget-gib",
                 str(fits_closed / GIB)]) == 0
    out = capsys.readouterr().out
    assert "Per-layer bytes of the estimates and the plan: transformers eager layers (gelu_new" in out
    policy = out.strip().splitlines()[-1]
    assert policy.startswith("apply_recompute policy") and not policy.endswith('["none"] * 4')
    assert main(["--hf-config", str(path), "--attention", "sdpa", "--budget-gib", "1"]) == 0
    assert "the plan: closed form" in capsys.readouterr().out
    assert main(["--hf-config", str(path), "--tp", "2", "--budget-gib", "1"]) == 2
    assert "transformers' layers are counted unsharded" in capsys.readouterr().err


def test_cli_takes_the_train_spelling_of_config_fields(capsys):
    """`memory --model.n_layer ... --parallel.tp ... --optim.name` is `--layers ... --tp ... --optimizer`."""
    new = ["--model", "gpt2-medium", "--model.n_layer", "8", "--model.seq_len", "512", "--run.micro_batch", "2",
           "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--optim.name", "lans", "--budget-gib", "4"]
    old = ["--model", "gpt2-medium", "--layers", "8", "--seq-len", "512", "--micro-batch", "2", "--tp", "2",
           "--sequence-parallel", "--optimizer", "lans", "--budget-gib", "4"]
    outputs = []
    for argv in (new, old):
        main(argv)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "Cheapest recomputation" in outputs[0]
    main(old[:2] + old[4:])  # the preset's 24 layers: the override was applied
    assert capsys.readouterr().out != outputs[0]


@pytest.mark.parametrize("schedule, virtual, m", [("interleaved-1f1b", 2, 16), ("interleaved-1f1b", 3, 16),
                                                   ("gpipe", 1, 16), ("gpipe", 1, 64),
                                                   ("interleaved-zb", 2, 16), ("zbv", 2, 16)])
def test_estimates_and_plans_follow_the_pipeline_schedule(schedule, virtual, m, capsys):
    """The first stage's activations scale with the layers' worth its schedule keeps against 1F1B's L
    (Korthikanti et al. 2022 §4.2.3: interleaved L (1 + (p-1)/(pV)), GPipe m L/p; zero bubble: the
    walk of torch's action lists); the parameters, gradients and optimizer state do not; the
    estimate is the larger of that rank and the one holding the last stage (GPipe keeps m
    micro-batches there too, with their logits; ZBV puts the last stage on rank 0); and the CLI
    plans with the schedule it is given."""
    from largebatch.memory.activations import last_rank_activation_bytes, model_activation_bytes
    from largebatch.memory.pipeline_schedule import walk

    c = preset("gpt3-175b")
    p, L = 8, c.n_layer
    one = Setup(tp=8, pp=p, sequence_parallel=True, micro_batch=1)
    other = Setup(tp=8, pp=p, sequence_parallel=True, micro_batch=1, pp_schedule=schedule,
                  pp_virtual_stages=virtual, pp_micro_batches=m)
    worth = {"interleaved-1f1b": L * (1 + (p - 1) / (p * virtual)), "gpipe": m * L / p}.get(schedule)
    if worth is None:
        worth = walk(schedule, p, virtual, m).layers_worth(L)
    kw = dict(tp=8, pp=p, sequence_parallel=True)
    for policies in ("none", "selective", ["full"] * 3 + ["none"] * 9):
        first_a = model_activation_bytes(c, 1, policies, **kw)
        first_b = model_activation_bytes(c, 1, policies, **kw, schedule=schedule, virtual_stages=virtual,
                                         micro_batches=m)
        assert first_b == pytest.approx(first_a * worth / L, rel=1e-12)
        last_b = last_rank_activation_bytes(c, 1, policies, **kw, schedule=schedule, virtual_stages=virtual,
                                            micro_batches=m)
        a, b = one.estimate(c, policies), other.estimate(c, policies)
        assert a.activations == first_a  # 1F1B: the last rank keeps one micro-batch, logits split over tp
        if b.activations == first_b:
            assert (b.parameters, b.gradients, b.optimizer) == (a.parameters, a.gradients, a.optimizer)
        else:
            assert b.activations == last_b > first_b
            assert b.total >= first_b + a.parameters + a.gradients + a.optimizer - 1
    budget = 80 * GIB
    plan = cheapest_plan(c, other, budget)
    argv = ["--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--sequence-parallel", "--budget-gib", "80",
            "--pp-schedule", schedule, "--pp-virtual-stages", str(virtual), "--pp-micro-batches", str(m)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    shown = 2 if schedule == "zbv" else virtual
    assert f"Pipeline schedule of the estimates and the plan: {schedule} (V = {shown}, m = {m}; the first " \
           f"stage keeps {worth:.2f} layers' worth" in out
    assert plan is not None and f"Cheapest recomputation that fits 80 GiB:\n  {plan.describe()}" in out
    if schedule == "gpipe" and m == 64:  # 8 L layers' worth: most layers recomputed in full
        assert plan.policies.count("full") > plan.policies.count("selective") > 0


def test_pipeline_layouts_the_interleaved_default_does_not_fit(capsys, tmp_path):
    """The default V = 2 of the interleaved rows is not the user's choice: gpt2-small (12 layers) on
    pp = 4 has 3 layers a stage, so those rows are left out with a note, not the whole command;
    asking for an interleaved schedule with that V is still an error. A config with uneven stages
    (pp_split) is planned at its largest stage."""
    assert main(["--model", "gpt2-small", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "interleaved rows left out: V = 2 does not divide the 3 layers per stage" in out
    assert re.search(r"^\s+1f1b\s", out, re.M) and not re.search(r"^\s+interleaved-1f1b\s", out, re.M)
    assert main(["--model", "gpt2-small", "--pp", "4", "--pp-schedule", "1f1b"]) == 0
    capsys.readouterr()
    assert main(["--model", "gpt2-small", "--pp", "4", "--pp-schedule", "interleaved-1f1b"]) == 2
    assert "--pp-virtual-stages 2: must be a positive divisor of the 3 layers" in capsys.readouterr().err
    config = tmp_path / "run.toml"
    config.write_text('[model]\nn_layer = 3\nn_embd = 64\nn_head = 2\nseq_len = 32\ntie_embeddings = false\n'
                      '[parallel]\npp = 2\npp_split = [1]\n')
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "pp_split = [1]: uneven stages, planned as 2 stages of the largest rank's 2 layers" in out
    assert " L=4, " in out  # the table of 2 x 2 layers


def test_the_memory_command_plans_without_torch():
    """`largebatch memory` is arithmetic on a config: the model kinds declare their memory terms
    without torch (models/kinds.py), so planning imports it only for what torch itself defines (the
    interleaved pipeline schedules' orders, under --pp); it was ~2 s of a ~2 s command. Building a
    model imports it, on first use."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from largebatch.cli import main\n"
            "assert main(['memory', '--model', 'gpt2-small', '--budget-gib', '8']) == 0\n"
            "assert main(['memory', '--model', 'bert-large', '--tp', '2', '--sequence-parallel']) == 0\n"
            "assert 'torch' not in sys.modules, 'the memory command imported torch'\n"
            "from largebatch.models import GPT, build_model, preset\n"
            "assert 'torch' in sys.modules and isinstance(build_model(preset('demo')), GPT)\n")
    from processes import src_env

    env = src_env()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_rank_with_the_last_stage_must_fit_too(capsys):
    """gpt2-small on tp 4 (SP) x pp 4, micro-batch 8, logits gathered (parallel.loss_parallel's
    default false): the planner checked the first stage only and planned 0.84 GiB, while the last
    stage keeps the gathered fp32 logits, 4 s b v bytes. Under 1F1B the last rank keeps one
    micro-batch: with full recomputation its L/p layers keep their inputs, s b h d / t each (SP),
    and the output layer its norm's input (s b h d / t), its projection's gathered input (s b h d) and
    the logits (by hand here)."""
    c = preset("gpt2-small")
    s, b, h, v, t, p, d = c.seq_len, 8, c.n_embd, c.vocab_size, 4, 4, 2
    setup = Setup(tp=t, pp=p, sequence_parallel=True, micro_batch=b, loss_parallel=False)
    last = (c.n_layer // p) * s * b * h * d / t + s * b * (h * d / t + h * d + 4 * v)
    full = setup.estimate(c, "full")
    assert full.activations == pytest.approx(last, rel=1e-12)
    plan = cheapest_plan(c, setup, 1.2 * GIB)
    assert plan is None or plan.memory.total <= 1.2 * GIB and plan.memory.activations >= last
    assert main(["--model", "gpt2-small", "--tp", "4", "--sequence-parallel", "--pp", "4", "--micro-batch", "8",
                 "--parallel.loss_parallel", "false", "--budget-gib", "1.2"]) == 1
    assert "Nothing fits in 1.2 GiB at micro-batch 8" in capsys.readouterr().out


def test_flags_given_on_the_command_line_win_over_the_config_even_at_their_defaults(tmp_path, capsys):
    """`--micro-batch 1` against a config's micro_batch 16 planned b = 16 (a flag equal to its default
    counted as not given), and `--parallel.sequence_parallel false` could not turn the config's SP
    off; a config with parallel.dp_mode = 'fsdp' was planned with nothing sharded."""
    config = tmp_path / "tp.toml"
    config.write_text('[model]\nkind = "gpt"\nn_layer = 8\nn_embd = 256\nn_head = 8\nseq_len = 256\n'
                      '[run]\nmicro_batch = 4\n[parallel]\ntp = 4\npp = 2\nsequence_parallel = true\n')
    assert main(["--config", str(config), "--tp", "1", "--pp", "1", "--parallel.sequence_parallel", "false",
                 "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "b=1 h=256 a=8 t=1 L=8" in out and "Pipeline schedule" not in out
    assert main(["--config", "gpt2-small", "--micro-batch", "1"]) == 0
    assert "s=1024 b=1 " in capsys.readouterr().out
    fsdp = tmp_path / "fsdp.toml"
    fsdp.write_text('[model]\nkind = "gpt"\nn_layer = 8\nn_embd = 2048\nn_head = 16\nseq_len = 256\n'
                    '[parallel]\ndp = 8\ndp_mode = "fsdp"\n')

    def state(argv):  # the no-recompute line's (parameters, gradients, optimizer) in GiB
        assert main(argv) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("Per device, no recompute"))
        return out, [float(re.search(f"{part} ([0-9.]+)", line).group(1))
                     for part in ("parameters", "gradients", "optimizer")]

    out, sharded = state(["--config", str(fsdp)])
    _, whole = state(["--config", str(fsdp), "--zero-stage", "0"])
    assert "planned as ZeRO stage 3 over 8 ranks" in out
    assert whole[2] > 2 and all(abs(a - b / 8) <= 0.01 for a, b in zip(sharded, whole))


@pytest.mark.parametrize("call, fragment", [
    (lambda c: cheapest_plan(c, Setup(), float("nan")), "budget_bytes=nan"),
    (lambda c: Setup(pp=2, pp_schedule="gpipe", pp_micro_batches=-4).estimate(c, "none"), "micro_batches=-4"),
    (lambda c: first_stage_layers(96, 8, "interleaved-1f1b", 0), "virtual_stages=0"),
    (lambda c: first_stage_layers(96, 0), "pp=0: must be a positive integer"),
    (lambda c: first_stage_layers(96, 7), "pp=7: must divide n_layer=96"),
    (lambda c: Setup(dtype_bytes=float("inf")).estimate(c, "none"), "dtype_bytes=inf"),
])
def test_the_python_api_refuses_what_it_cannot_plan(call, fragment):
    """(A NaN budget planned no recomputation; -4 micro-batches gave -27.9 GB of activations; V = 0
    divided by zero; pp = 0 or 7 of 96 layers gave 96 layers' worth.)"""
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call(preset("gpt2-small"))


def test_the_table_says_which_rows_no_run_takes_and_small_totals_in_mib(capsys):
    """The sequence-parallel rows were printed for a t that does not divide s, which
    --sequence-parallel (and the trainer) refuse; and a small model's L-layer column read 0.00 GiB."""
    assert main(["--model", "gpt3-175b", "--tp", "8", "--seq-len", "1001"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "does not divide s=1001" in line]
    assert [r.split("  ")[1].strip() for r in rows] == [
        "tensor + sequence parallel", "tensor + sequence parallel + selective",
        "full recompute (tensor + sequence parallel)"]
    assert main(["--model", "demo"]) == 0
    out = capsys.readouterr().out
    table = out[:out.index("\n\n")] if "\n\n" in out else out
    assert "0.00 GiB" not in table and "    4.50 MiB" in table and "does not divide" not in table


def test_zbv_with_another_virtual_stage_count_is_refused_as_train_refuses_it(capsys):
    """``--parallel.pp_virtual_stages 3`` with zbv was planned silently with V = 2."""
    assert main(["--model", "gpt2-small", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv",
                 "--parallel.pp_virtual_stages", "3"]) == 2
    err = capsys.readouterr().err
    assert "pp_virtual_stages 3 with --parallel.pp_schedule zbv" in err and "Traceback" not in err, err
    assert main(["--model", "gpt2-small", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv",
                 "--parallel.pp_virtual_stages", "2"]) == 0


def test_tied_embeddings_under_pp_are_planned_untied_with_a_note(capsys, tmp_path):
    """The trainer refuses tied embeddings under pp > 1 (the first stage's embedding and the last
    stage's output layer sit on different ranks). gpt2-small (tied) at pp 2 was planned with the
    output layer's v x h parameters on no rank: "3 selective, 3 none; 1.90 GiB" in a 2 GiB budget,
    which the untied model it must run as needs 2.30 GiB of. Now it is planned untied, with a note,
    as the same config written untied: the last stage's rank holds its 6 layers, the final norm and
    the output layer (counted here by hand), and the plan is the untied config's."""
    c = preset("gpt2-small")
    h, v, L = c.n_embd, c.vocab_size, c.n_layer
    setup = Setup(pp=2, micro_batch=1, pp_micro_batches=8)
    last_stage = (L // 2) * (12 * h * h + 13 * h) + 2 * h + v * h  # layers, ln_f, untied lm_head
    assert setup.estimate(c, "full").parameters == last_stage * setup.dtype_bytes  # the last rank: the larger
    assert setup.estimate(c, "full") == setup.estimate(c.replace(tie_embeddings=False), "full")
    argv = ["--pp", "2", "--pp-micro-batches", "8", "--budget-gib", "2", "--dtype-bytes", "2", "--optimizer", "adamw"]
    assert main(["--model", "gpt2-small", *argv]) == 0
    tied = capsys.readouterr().out
    config = tmp_path / "untied.toml"
    config.write_text("[model]\nn_layer = {}\nn_embd = {}\nn_head = {}\nseq_len = {}\nvocab_size = {}\n"
                      "tie_embeddings = false\n".format(c.n_layer, c.n_embd, c.n_head, c.seq_len, c.vocab_size))
    assert "model.tie_embeddings = true with pp = 2" in tied and "planned untied" in tied
    assert main(["--config", str(config), *argv]) == 0
    untied = capsys.readouterr().out
    plan = [re.search(r"micro-batch 1: (.*)", out).group(1) for out in (tied, untied)]
    assert plan[0] == plan[1] and "6 full" in plan[0], plan
