"""Every bad input of every command is one line naming the field, the value and the fix, exit code 2,
no traceback, found before any work starts: inf/nan numbers, unwritable outputs (a file where a
directory goes, a missing directory, a real read-only file system), an unknown device, a non-JSON
tokenizer, a model whose state exceeds the machine's memory, a resume that would load checkpoint
state into another shape or optimizer. A checkpoint save on a read-only disk reports its own error
and keeps the previous checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from largebatch.cli import main as cli_main
from largebatch.train.config import load_config
from test_train import tiny_overrides

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
    [str(Path(__file__).parents[1] / "src"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`largebatch ARGV` in this process: (exit code, stdout, stderr); argparse's exit included."""
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and " error: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "tokenizer.json").write_text("this is not JSON")
    import gzip

    (tmp_path / "web.jsonl.gz").write_bytes(gzip.compress(b'\n{"content": "a page", "url": "x"}\n'))
    (tmp_path / "table.parquet").write_bytes(b"PAR1")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "plays").mkdir()
    for name in ("hamlet.txt", "acts/macbeth.txt.gz"):
        (tmp_path / "plays" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "plays" / name).write_bytes(gzip.compress(b"a play") if name.endswith(".gz") else b"a play")
    return tmp_path


CASES = [  # (argv with {tmp} for the test's directory, what the line must name)
    (["schedule", "--total-tokens", "inf", "--seq-len", "64"], ["--total-tokens", "'inf'", "finite"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--ratio", "nan"], ["--ratio", "'nan'"]),
    # a token count past 2**53 printed float noise as digits (1,000,000,000,000,000,019,884,...)
    (["schedule", "--total-tokens", "1e30", "--seq-len", "64"], ["--total-tokens", "'1e30'", "at most 2**53"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "{tmp}/missing/x.png"],
     ["--plot", "missing", "does not exist; create it first"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "{tmp}/x.txt"], ["--plot", ".png"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "{tmp}/seesaw.png/"],
     ["--plot", "seesaw.png/'", "ends in '/'", "e.g. {tmp}/seesaw.png"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "{tmp}/"],
     ["--plot", "is a directory", "give a file name"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", ""], ["--plot ''", "empty"]),
    (["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "{tmp}/file/x.png"],
     ["--plot", "file is a file, not a directory"]),
    (["memory", "--budget-gib", "nan"], ["--budget-gib", "'nan'", "finite"]),
    (["memory", "--budget-gib", "-1"], ["--budget-gib -1", "must be > 0"]),
    (["memory", "--dtype-bytes", "inf"], ["--dtype-bytes", "'inf'"]),
    (["memory", "--model.kind", "t5"], ["--model.kind", "'t5'", "register_model"]),
    (["experiment", "seesaw", "--smoke", "--out", "{tmp}/file"], ["--out", "is a file"]),
    (["experiment", "all", "--smoke", "--out", "{tmp}/file"], ["--out", "file/seesaw", "is a file"]),
    (["train", "--run.out_dir={tmp}/file"], ["run.out_dir", "is a file, not a directory"]),
    (["train", "--run.out_dir={tmp}/file/run"], ["run.out_dir", "is a file, so the directory cannot"]),
    (["train", "--run.out_dir=runs/{foo}"], ["run.out_dir", "{foo}", "use only {time} and {kind}"]),
    # file systems that look writable (to root) but refuse new directories: --check probes for real
    (["train", "--run.out_dir=/sys/x", "--check"], ["run.out_dir = '/sys/x'", "choose a writable directory"]),
    (["train", "--run.out_dir=/proc/x", "--check"], ["run.out_dir = '/proc/x'", "choose a writable directory"]),
    (["train", "--run.out_dir=runs/{time"], ["run.out_dir", "'runs/{time'"]),
    (["train", "--run.device=tpu"], ["run.device", "'tpu'", "'cuda:N'"]),
    (["train", "--data.tokenizer_file={tmp}/tokenizer.json"], ["tokenizer_file", "not a tokenizer.json"]),
    (["train", "--optim.weight_decay=nan"], ["optim.weight_decay", "nan", "finite"]),
    # the corpus, before the run directory is made: a wrong path or JSON field is known in a second
    (["train", "--data.corpus={tmp}/missing.txt"], ["data.corpus = '{tmp}/missing.txt' does not exist"]),
    # one text file is one document: said from the path, not after the file is read whole
    (["train", "--data.corpus={tmp}/file"], ["data.corpus = '{tmp}/file' is one text file", "at least 2 documents",
                                              "data.document_separator", "data.val_corpus"]),
    (["train", "--data.val_corpus={tmp}/missing"], ["data.val_corpus = '{tmp}/missing' does not exist"]),
    (["train", "--data.corpus={tmp}/web.jsonl.gz"],
     ["web.jsonl.gz' line 2 has no field data.text_field='text' (its fields: 'content', 'url')"]),
    (["train", "--data.corpus={tmp}", "--data.text_field=content"],
     ["table.parquet' is not a readable .parquet file", "re-create it"]),
    # a validation document the corpus does not hold: named before the corpus is read (it was found
    # after the run directory was made and the text read)
    (["train", "--data.corpus={tmp}/plays", "--data.val_documents=othello"],
     ["data.val_documents: no unique document named 'othello'", "known: ['acts/macbeth', 'hamlet']"]),
    (["train", "--data.corpus={tmp}/plays", '--data.val_documents=["hamlet", "macbeth"]'],
     ["data.val_documents lists every document"]),
    (["train", "--run.total_tokens=1e30"], ["run.total_tokens = 1e+30", "above 2**53", "write its digits"]),
    (["train", "--run.total_tokens=" + "1" + "0" * 28], ["run.total_tokens = 1" + "0" * 28, "at most 2**53"]),
    (["train", "--run.checkpoint_every_seconds=inf"], ["run.checkpoint_every_seconds", "inf"]),
    (["train", "--parallel.step_timeout_s=0"], ["parallel.step_timeout_s = 0", "at least 0.001 seconds", "or none"]),
    (["train", "--parallel.shared_fs_wait_s=-1"], ["parallel.shared_fs_wait_s = -1", "[0, 86400]"]),
    (["train", "--parallel.shared_fs_wait_s=nan"], ["parallel.shared_fs_wait_s = nan", "finite"]),
    (["train", "--model.n_layer=1e8"], ["model.n_layer=100000000", "GiB", "available", "lower model.n_layer"]),
    # a name longer than the filesystem allows (255 bytes): Python 3.11's Path.exists() raises on it,
    # and every command ended in a traceback; --check said "ok" when a parent was still to be made
    (["train", "--check", "--run.out_dir={tmp}/new/" + "z" * 256], ["run.out_dir", "is 256 bytes", "shorten it"]),
    (["train", "--resume", "{tmp}/" + "z" * 256], ["too long for its filesystem (at most 255 bytes", "shorten it"]),
    (["train", "--data.corpus={tmp}/" + "z" * 256], ["too long for its filesystem"]),
    (["export", "{tmp}/" + "z" * 256, "{tmp}/out", "--format", "hf"], ["too long for its filesystem"]),
    (["memory", "--config", "{tmp}/" + "z" * 256], ["too long for its filesystem"]),
    # OUT a link to nothing (or a loop): refused up front, not a traceback after the whole export
    (["export", "{tmp}/plays", "{tmp}/dangling", "--format", "hf"],
     ["OUT '{tmp}/dangling' is a symbolic link to '{tmp}/nowhere'", "missing or a loop of links"]),
]
if os.path.isdir("/proc/self"):  # a file system that refuses new files whatever the permission bits say
    CASES.append((["schedule", "--total-tokens", "1e6", "--seq-len", "64", "--plot", "/proc/x.png"],
                  ["--plot '/proc/x.png'", "cannot write a file there"]))


@pytest.mark.parametrize("argv, needles", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_bad_input_is_one_line(argv, needles, paths, capsys, monkeypatch):
    monkeypatch.chdir(paths)  # a default run directory would go here; none may be made
    before = sorted(paths.rglob("*"))
    start = time.perf_counter()
    code, out, err = run_cli([a.replace("{tmp}", str(paths)) for a in argv], capsys)
    assert_one_line_error(code, out, err, *(n.replace("{tmp}", str(paths)) for n in needles))
    assert sorted(paths.rglob("*")) == before  # refused before any work: nothing was created
    assert time.perf_counter() - start < 15  # n_layer=1e8 is refused from the config, not by building


NAMED_ONCE = [  # (train overrides or a config file's text, how the error line must begin)
    (["--run.device=tpu"], "run.device = 'tpu': "),
    (["--run.micro_batch=0"], "run.micro_batch = 0: "),
    (["--optim.weight_decay=-1"], "optim.weight_decay = -1.0: "),
    (["--parallel.tp=0"], "parallel.tp = 0: "),
    (["--data.seed=-1"], "data.seed=-1 is invalid: "),
    (["--data.mlm_probability=2"], "data.mlm_probability=2.0 is invalid: "),
    (["--model.n_head=3"], "model.n_head=3 does not divide"),
    ("[[phases]]\nseq_len = 64\ntotal_tokens = 1000\n[[phases]]\nseq_len = 0\ntotal_tokens = 1000\n",
     "phases[1].seq_len = 0: "),
]


@pytest.mark.parametrize("args, start", NAMED_ONCE, ids=[str(a)[:40] for a, _ in NAMED_ONCE])
def test_a_config_error_names_the_field_once_as_the_config_writes_it(args, start, tmp_path, capsys):
    """``run.device``, ``data.seed``: the section and the field once, as in the TOML file and the
    override -- not ``[run] run.device`` nor ``DataConfig.seed``."""
    if isinstance(args, str):
        (tmp_path / "phases.toml").write_text(args)
        args = [str(tmp_path / "phases.toml")]
    code, out, err = run_cli(["train", *args], capsys)
    assert_one_line_error(code, out, err)
    message = err.strip().split(" error: ", 1)[1]
    assert message.startswith(start), message
    field = start.split("=")[0].strip()
    assert message.count(field) == 1 and "Config." not in message, message


def test_state_estimate_is_the_real_model_and_optimizer(tmp_path):
    """The refusal's numbers are the real ones: parameters of the built model, and fp32 parameters +
    gradients + optimizer state summed over the tensors a real optimizer step leaves (LAMB keeps
    two moments per parameter, LARS one momentum buffer)."""
    from largebatch.models import build_model
    from largebatch.train.optimizer import build_optimizer
    from largebatch.train.preflight import estimate_state

    for kind, optim in (("gpt", "lamb"), ("bert", "lars")):
        cfg = load_config(None, {"model.kind": kind, "model.n_layer": 2, "model.n_embd": 32,
                                 "model.n_head": 2, "model.seq_len": 16, "data.vocab_size": 512,
                                 "optim.name": optim, "run.micro_batch": 8})
        model = build_model(cfg.model.replace(vocab_size=cfg.data.vocab_size))
        optimizer = build_optimizer(model, cfg.optim)
        idx = torch.randint(0, 512, (2, 16))
        model(idx, idx)[1].backward()
        optimizer.step()
        params = list(model.parameters())
        state = [t for s in optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.numel() > 1]
        real = sum(t.numel() * t.element_size() for t in params + [p.grad for p in params] + state)
        est = estimate_state(cfg)
        assert est.parameters == sum(p.numel() for p in params)
        assert est.bytes == real, (kind, optim, est.bytes, real)
        assert 0 < est.available


def test_state_estimate_counts_one_pipeline_rank_and_one_fsdp_shard(monkeypatch):
    """Under parallel.pp = 2 a rank holds half the layers (the first stage: also the embeddings; the
    last: the output layer; under ZBV rank 0 both), and FSDP over 2 ranks half of everything: counted
    from the real model's named parameters."""
    from largebatch.models import build_model
    from largebatch.train.preflight import estimate_state

    base = {"model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 16,
            "model.tie_embeddings": False, "data.vocab_size": 512, "optim.name": "lamb"}
    model = build_model(load_config(None, base).model.replace(vocab_size=512))
    first_stage = sum(p.numel() for name, p in model.named_parameters()
                      if name.startswith(("tok_emb.", "pos_emb.", "blocks.0.", "blocks.1.")))
    whole = sum(p.numel() for p in model.parameters())
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert estimate_state(load_config(None, {**base, "parallel.pp": 2})).parameters == first_stage
    # ZBV (2 stages a rank, V-shaped): rank 0 holds the first stage and the last, the output layer
    # with it; it was counted as the first stage alone (1.7x too few here, as in `largebatch memory`)
    zbv_rank0 = sum(p.numel() for name, p in model.named_parameters()
                    if name.startswith(("tok_emb.", "pos_emb.", "blocks.0.", "blocks.3.", "ln_f.", "lm_head.")))
    zbv = load_config(None, {**base, "parallel.pp": 2, "parallel.pp_schedule": "zbv",
                             "parallel.pp_virtual_stages": 2, "run.micro_batch": 2})
    assert estimate_state(zbv).parameters == zbv_rank0
    split = load_config(None, {**base, "parallel.pp": 2, "parallel.pp_split": [3]})
    assert estimate_state(split).parameters > first_stage  # 3 layers on one rank (an upper bound)
    fsdp = estimate_state(load_config(None, {**base, "parallel.dp_mode": "fsdp"}))
    assert fsdp.parameters == whole / 2
    assert estimate_state(load_config(None, base)).parameters == whole  # DDP replicates


def test_train_check_under_torchrun_reports_once(paths, capsys, monkeypatch):
    """Every rank of `torchrun ... train --check` runs the checks; only rank 0 prints its line."""
    monkeypatch.chdir(paths)
    monkeypatch.setenv("WORLD_SIZE", "2")
    outputs = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        code, out, err = run_cli(["train", "--check", "--model.n_layer=2", "--model.n_embd=64",
                                  "--run.out_dir=runs/shared"], capsys)
        assert code == 0, err
        outputs[rank] = out
    assert outputs["0"].startswith("ok: ") and outputs["1"] == ""


@pytest.mark.parametrize("args, needle", [
    (["--model.n_head=3", "--model.n_embd=48"], "parallel.tp = 2 does not divide model.n_head = 3: choose parallel.tp"),
    (["--model.ffn_hidden=33"], "model.ffn_hidden (the MLP width) = 33"),
    (["--model.seq_len=33", "--parallel.sequence_parallel=true"],
     "model.seq_len = 33: sequence parallel splits every sequence"),
    (["bert-lans-demo", "--model.n_head=4", "--phases.0.seq_len=17", "--parallel.sequence_parallel=true"],
     "phases[0].seq_len = 17: sequence parallel splits every sequence"),
], ids=["n_head", "ffn", "seq_len_sp", "phase_seq_len_sp"])
def test_what_tensor_parallel_splits_is_checked_before_any_work(args, needle, paths, capsys, monkeypatch):
    """tp must divide the heads, the MLP width and, under sequence parallel, every
    sequence length (each phase's too: an indivisible one aborted gloo at the first evaluation). Each
    is one line from --check, as from the run, before the tokenizer is trained or the run directory made."""
    monkeypatch.chdir(paths)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config, flags = (args[:1], args[1:]) if not args[0].startswith("--") else ([], args)
    code, out, err = run_cli(["train", *config, "--check", "--model.n_layer=2", "--parallel.tp=2",
                              "--run.out_dir=runs/tp", *flags], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (paths / "runs").exists()


def test_a_tensor_parallel_size_that_cannot_split_the_heads_is_named_before_the_launch_size(paths, capsys,
                                                                                            monkeypatch):
    """One process, --parallel.tp=3 on 4 heads: the error asked to "launch a multiple of 3
    processes", and the relaunch then failed on the heads. The heads come first."""
    monkeypatch.chdir(paths)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = run_cli(["train", "--check", "--model.n_layer=2", "--model.n_head=4", "--parallel.tp=3",
                              "--run.out_dir=runs/tp"], capsys)
    assert code == 2 and "parallel.tp = 3 does not divide model.n_head = 4" in err, err
    assert "processes started" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL runs where CUDA does")
def test_nccl_without_a_gpu_is_refused_by_check(paths, capsys, monkeypatch):
    """Under torchrun, --parallel.backend=nccl on a machine without CUDA passed --check and failed in
    every rank once the run had started."""
    monkeypatch.chdir(paths)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, out, err = run_cli(["train", "--check", "--model.n_layer=2", "--parallel.backend=nccl",
                              "--run.out_dir=runs/nccl"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "parallel.backend = 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on CPU" in err


def test_the_adaptive_seesaw_cap_is_refused_where_no_noise_scale_is_measured(paths, capsys, monkeypatch):
    """FSDP over several replicas measures no gradient noise scale (docs/parallel.md), so the cap at
    schedule.noise_scale_multiple x B_simple never applied and the batch grew past it, silently: it
    is refused naming the way out; under DDP the same config is accepted."""
    monkeypatch.chdir(paths)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    seesaw = ["train", "--check", "--model.n_layer=2", "--schedule.batch_policy=seesaw",
              "--schedule.noise_scale_multiple=2", "--run.out_dir=runs/noise"]
    code, out, err = run_cli([*seesaw, "--parallel.dp_mode=fsdp"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "schedule.noise_scale_multiple = 2.0: the adaptive Seesaw cap needs the gradient noise scale" in err
    assert "parallel.dp_mode = 'ddp'" in err
    code, out, err = run_cli(seesaw, capsys)
    assert code == 0 and out.startswith("ok: "), err
    # one replica measures it from 2+ micro-batches per step: a start of one micro-batch has none
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, out, err = run_cli([*seesaw, "--schedule.batch_size=8", "--run.micro_batch=8"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("the starting batch of 8 is one micro-batch (run.micro_batch = 8), so the first milestone would "
            "grow the batch with no estimate to cap it; use a run.micro_batch below 8 (e.g. 4)") in err
    code, out, err = run_cli([*seesaw, "--schedule.batch_size=8", "--run.micro_batch=4"], capsys)
    assert code == 0 and out.startswith("ok: "), err


def test_train_check_reports_and_creates_nothing(paths, capsys, monkeypatch):
    monkeypatch.chdir(paths)
    code, out, err = run_cli(["train", "--check", "--model.n_layer=2", "--model.n_embd=64"], capsys)
    assert code == 0 and out.startswith("ok: runs/") and "a new run" in out and "parameters" in out, err
    assert "\nmodel: gpt, 2 layers x 64 hidden, seq " in out, out  # the layout it would build
    assert not (paths / "runs").exists()
    # the activations at a step's peak (stored + backward's working set, the closed form), which
    # --check did not count: a config needing ~180 GiB of them passed as "ok" with nothing said
    from largebatch.memory import estimate
    from largebatch.models import ModelConfig
    from largebatch.train.cli import resolve_config
    from largebatch.train.progress import human_bytes

    config = load_config(resolve_config(None), {"model.n_layer": 2, "model.n_embd": 64})  # the default recipe
    model = ModelConfig(**{**config.model.__dict__, "vocab_size": config.data.vocab_size})
    e = estimate(model, config.run.micro_batch, recompute="none", dtype_bytes=4, device="cpu")
    assert f"activations at a step's peak ~{human_bytes(e.activations + e.backward)} (fp32; closed form" in out
    assert "`largebatch memory --config FILE` breaks the activations down" in out and "warning" not in err
    # the schedule as the run takes it (gpt-demo: Seesaw from batch 16, micro-batch 8), the table
    # `largebatch schedule` prints for the same numbers (which it needs given by hand)
    from largebatch.schedules.cli import main as schedule_main

    assert schedule_main(["--run.total_tokens", str(config.run.total_tokens), "--model.seq_len",
                          str(config.model.seq_len), "--run.micro_batch", "8", "--schedule.batch_policy", "seesaw",
                          "--schedule.batch_size", "16", "--schedule.ratio", "0.5", "--schedule.peak_lr", "1e-2",
                          "--schedule.warmup", "0.05", "--schedule.final_lr", "0.1"]) == 0
    table = capsys.readouterr().out.strip()
    assert out.strip().endswith(table) and "milestone 1" in table and "micro_batch 8 x dp 1" in table
    code, out, err = run_cli(["train", "--check", "--model.n_layer=2", "--model.n_embd=64", "--model.seq_len=4096",
                              "--run.micro_batch=64", "--schedule.batch_size=64", "--schedule.batch_policy=constant"],
                             capsys)
    assert code == 0 and "largebatch train: warning: the state and the predicted activations" in err, err
    assert "exceed the" in err and "set run.recompute" in err and not (paths / "runs").exists()


def test_resume_that_changes_the_state_is_refused(reference_run, tmp_path, capsys):
    """A --resume override of the optimizer would load LANS/LAMB moments into AdamW; one of the
    model's shape would fail with a size-mismatch traceback; one of the schedule (its budget, LR,
    batch policy, micro-batch) is refused by the schedule's saved state; one of the data order
    would silently repeat and skip samples. All are refused in one line naming the field, before
    anything is written."""
    import shutil

    _, ref, _ = reference_run
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    saved_optim = load_config(out / "config.toml").optim.name
    for override, needle in ((["--optim.name=adamw"], f"optim.name: '{saved_optim}' -> 'adamw'"),
                             (["--model.n_embd=64"], "model.n_embd: 32 -> 64"),
                             (["--data.vocab_size=1024"], "data.vocab_size: 512 -> 1024"),
                             (["--run.total_tokens=12288"], "run.total_tokens: 6144 -> 12288 changes the schedule"),
                             (["--schedule.peak_lr=0.01"], "schedule.peak_lr: 0.03 -> 0.01 changes the schedule"),
                             (["--run.micro_batch=2"], "run.micro_batch: 4 -> 2 changes the schedule"),
                             (["--data.seed=5"], "data.seed: 0 -> 5 changes the sample order")):
        code, stdout, err = run_cli(["train", "--resume", str(out), *override], capsys)
        assert_one_line_error(code, stdout, err, f"--resume {out}", needle, "another --run.out_dir")
        assert "lr_schedule=" not in err  # (the schedule's own state, as it refused it before)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


READ_ONLY_DRIVER = """
import json, subprocess, sys
from pathlib import Path
from largebatch.checkpoint import CheckpointError, load_checkpoint
from largebatch.train.cli import main
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

overrides, disk, report = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
cfg = load_config(None, overrides)
trainer = Trainer(cfg, overrides["run.out_dir"], log=lambda *_: None)
trainer.train_step()
first = trainer.save()
# the checkpoints' own file system goes read-only (the run directory's open files live above it)
subprocess.run(["mount", "-o", "remount,ro", str(first.parent)], check=True)
trainer.train_step()
try:
    trainer.save()
    error = None
except CheckpointError as exc:
    error = str(exc)
intact = load_checkpoint(first)["progress"]["step"]
trainer._close()  # its lock and metrics files are open for writing: a remount would be busy
metrics = Path(overrides["run.out_dir"], "metrics.jsonl")
records = metrics.read_text()
again = main(["--resume", overrides["run.out_dir"]])  # continued, its checkpoints still read-only
untouched = metrics.read_text() == records
subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
code = main([f"--{k}={json.dumps(v)}" for k, v in {**overrides, "run.out_dir": str(disk / "new")}.items()])
report.write_text(json.dumps({"error": error, "first": str(first), "intact_step": intact, "code": code,
                              "again": again, "untouched": untouched}))
"""


def test_read_only_disk_is_one_line_and_keeps_the_previous_checkpoint(reference_run, tmp_path):
    """Real read-only file systems (tmpfs remounted ro in a private mount namespace): a checkpoint
    save reports EROFS itself (the cleanup of its temporary used to raise instead) and names the
    intact previous checkpoint; a new run into a read-only disk is refused before it starts."""
    cache, _, _ = reference_run
    disk, report, driver = tmp_path / "disk", tmp_path / "report.json", tmp_path / "driver.py"
    disk.mkdir()
    o = tiny_overrides(cache, disk / "run")
    driver.write_text(textwrap.dedent(READ_ONLY_DRIVER))
    ckdir = disk / "run" / "checkpoints"
    script = (f"mount -t tmpfs -o size=16m tmpfs {disk} && mkdir -p {ckdir} && "
              f"mount -t tmpfs -o size=16m tmpfs {ckdir} && "
              f"exec {sys.executable} {driver} '{json.dumps(o)}' {disk} {report}")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and report.is_file(), done.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["error"] and "Read-only file system" in r["error"], r
    assert f"the previous checkpoint {r['first']} is intact" in r["error"] and "Make it writable" in r["error"]
    assert r["intact_step"] == 1 and r["code"] == 2 and r["again"] == 2, r
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2 and "run.out_dir" in errors[1] and "not writable" in errors[1], done.stderr
    # continued, its checkpoints still read-only: refused before any step, naming the directory and
    # the fix (it trained to its first save, then lost those steps)
    assert f"its checkpoints directory {r['first'].rsplit('/', 1)[0]} cannot be written (Read-only file system)" \
        in errors[0] and "make it writable and run the same command again" in errors[0], errors[0]
    assert r["untouched"], r  # nothing trained, nothing written
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_output_file_that_is_a_named_pipe_is_refused_without_opening_it(tmp_path):
    """Opening a FIFO to probe it would block until a reader came; it is refused from its type."""
    import threading

    from largebatch.arguments import check_output_file

    pipe = tmp_path / "pipe.png"
    os.mkfifo(pipe)
    outcome = []

    def check():
        try:
            check_output_file(str(pipe), "--plot", suffixes=(".png",))
            outcome.append(None)
        except ValueError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # blocked opening the pipe: a reader releases it before the test fails
        os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("check_output_file blocked opening a named pipe")
    assert outcome[0] is not None and "pipe.png' exists and is not a regular file" in outcome[0]


def test_output_file_that_is_a_dangling_symbolic_link(tmp_path):
    """A link whose target's directory is missing is named as such (it was a bare "No such file or
    directory"); one whose target's directory exists is writable, and the probe leaves no file."""
    from largebatch.arguments import check_output_file

    broken = tmp_path / "broken.png"
    broken.symlink_to(tmp_path / "gone" / "plot.png")
    with pytest.raises(ValueError) as error:
        check_output_file(str(broken), "--plot", suffixes=(".png",))
    assert str(error.value) == (f"--plot {str(broken)!r} is a symbolic link to {tmp_path / 'gone' / 'plot.png'}, "
                                f"whose directory {tmp_path / 'gone'} does not exist; create it, or choose "
                                f"another name")
    pending = tmp_path / "pending.png"
    pending.symlink_to(tmp_path / "later.png")
    check_output_file(str(pending), "--plot", suffixes=(".png",))
    assert pending.is_symlink() and not (tmp_path / "later.png").exists()

