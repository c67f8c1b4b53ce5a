"""``largebatch memory``: the activation-memory table of Korthikanti et al. 2022 (Table 2,
docs/papers.md: memory) for a model, its memory per device, and the recomputation plan with the
least recompute FLOPs that fits a budget.

    largebatch memory --model gpt3-175b --tp 8 --budget-gib 80
    largebatch memory --model demo --micro-batch auto --budget-gib 2 --dtype-bytes 4
    largebatch memory --hf-config path/to/gpt2-medium   # a Hugging Face GPT-2 / BERT / Llama config.json
    largebatch memory --hf-config path/to/gpt2-medium --budget-gib 16   # planned with its eager layers
    largebatch memory --model gpt3-175b --tp 8 --pp 16 --pp-virtual-stages 3   # first stage per schedule
    largebatch memory --model gpt3-175b --tp 8 --pp 16 --pp-schedule zbv   # one schedule's row
    largebatch memory --config bert-large-lans --phase 1 --dp 1536 --budget-gib 32   # one phase of a config

A flag that sets a field of a training config is also spelled as in ``largebatch train``:
``--model.n_layer`` (``--layers``), ``--model.n_embd`` (``--hidden``), ``--model.n_head`` (``--heads``),
``--model.ffn_hidden`` (``--ffn``), ``--model.vocab_size`` (``--vocab``), ``--model.seq_len``,
``--run.micro_batch``, ``--parallel.tp`` / ``pp`` / ``dp`` / ``pp_schedule`` / ``pp_virtual_stages`` /
``sequence_parallel``, ``--optim.name`` (``--optimizer``). The Llama-style layer options too:
``--model.norm rmsnorm`` (``--norm``), ``--model.position rope`` (``--position``), ``--model.activation
swiglu`` (``--activation``), ``--model.n_kv_head`` (``--kv-heads``), ``--model.head_size``
(``--head-size``), ``--model.qk_norm true`` (``--qk-norm``, Qwen3), ``--model.qk_norm_scope projection``
(``--qk-norm-scope``) and ``--model.norm_position reordered`` (``--norm-position``, OLMo 2; ``parallel``:
GPT-NeoX's attention and MLP on the layer input, its input kept once for both norms); and
``--model.document_mask true``
(``--document-mask``: attention within the documents of packed sequences, one s x s mask more).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields, replace

from largebatch.arguments import OneLineParser, finite_float, required_config_file
from largebatch.memory.activations import (
    activation_bytes_per_layer,
    attention_mask_bytes,
    attention_mask_count,
    config_layer_kwargs,
    first_stage_layers,
    model_activation_bytes,
    stages_per_rank,
)
from largebatch.memory.estimate import GIB, OPTIMIZER_STATE_BYTES, rank_policies
from largebatch.memory.hf import config_from_hf, hf_activation, hf_eager_layer_bytes
from largebatch.memory.pipeline_schedule import SCHEDULES, ZERO_BUBBLE, schedule_activation_bytes, walk
from largebatch.memory.planner import (
    Setup,
    cheapest_plan,
    check_plannable,
    counts_hf_terms,
    micro_batch_sweep,
    what_would_fit,
)
from largebatch.models import PRESETS, ModelConfig, preset
from largebatch.models.registry import model_spec
from largebatch.schedules.config import ScheduleConfig
from largebatch.typed_config import from_dict, load_toml, named_as_written

TRAIN_DEFAULTS = {"run.dtype": "fp32", "optim.name": "lamb", "parallel.loss_parallel": False}
"""The trainer's defaults of the fields --config reads beyond the model and mesh (this layer cannot
import the trainer's config; a test holds them equal)."""

OVERRIDES = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "ffn_hidden",
             "vocab": "vocab_size", "kind": "kind", "attention": "attention", "dropout": "dropout",
             "norm": "norm", "position": "position", "activation": "activation", "kv_heads": "n_kv_head",
             "head_size": "head_size", "qk_norm": "qk_norm", "document_mask": "document_mask",
             "sliding_window": "sliding_window", "full_attention_layers": "full_attention_layers",
             "norm_position": "norm_position", "qk_norm_scope": "qk_norm_scope"}
"""Short flag (``--kv-heads``: underscores written as dashes) -> the ModelConfig field it overrides."""


def _kind(text: str) -> str:
    """A registered model kind, or an argparse error naming the flag and the registered kinds."""
    try:
        model_spec(text, key="")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _int_or_none(text: str) -> int | str:
    """--ffn, --kv-heads: a whole number, or "none" (the default width, as many key/value heads as
    query heads), as `largebatch train` takes them."""
    if text.strip().lower() == "none":
        return "none"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, or none") from None


def _layers(text: str) -> tuple[int, ...]:
    """--full-attention-layers: layer indices separated by commas ("3,7,11"), or none."""
    if text.strip().lower() in ("none", "", "[]"):
        return ()
    try:
        return tuple(int(part) for part in text.strip("[] ").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer indices separated by commas (3,7,11), or none") \
            from None


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return text.lower() == "true"


TYPES = {"kind": _kind, "attention": str, "dropout": finite_float, "norm": str, "position": str, "activation": str,
         "ffn": _int_or_none, "kv_heads": _int_or_none, "head_size": _int_or_none, "qk_norm": _boolean,
         "document_mask": _boolean, "sliding_window": _int_or_none, "full_attention_layers": _layers,
         "norm_position": str, "qk_norm_scope": str}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="largebatch memory", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (default demo)")
    p.add_argument("--config", help="a `largebatch train` TOML file or a shipped config's name: its [model], "
                   "[data] vocab_size, [run] micro_batch / dtype / recompute, [optim] name, [schedule] "
                   "batch_size (the pipeline's micro-batches) and [parallel] tp / pp / sequence_parallel / "
                   "dp, so the prediction is per rank of that run (flags given explicitly still override)")
    p.add_argument("--hf-config", help="a Hugging Face GPT-2, BERT (RoBERTa, XLM-R, CamemBERT) or Llama "
                   "(Mistral, Ministral, Qwen2, Qwen3, OLMo 2, OLMo 3) config.json (or a directory holding one); "
                   "also prints what "
                   "transformers' eager layers keep (and a Llama's sdpa layers, with --attention sdpa)")
    for flag, field in OVERRIDES.items():
        p.add_argument(f"--model.{field}", f"--{flag.replace('_', '-')}", dest=flag, type=TYPES.get(flag, int),
                       help=f"override the preset's {field}")
    p.add_argument("--phase", type=int, help="with --config holding [[phases]]: plan phase N (0, 1, ...) "
                   "at its own sequence length and micro-batch (default: the model's context, run.micro_batch)")
    p.add_argument("--model.seq_len", "--seq-len", dest="seq_len", type=int,
                   help="sequence length s (default: the preset's)")
    # the sizes default to None, filled in after a --config has given its own: a flag given on the
    # command line wins even when it equals the built-in default (DEFAULTS)
    p.add_argument("--run.micro_batch", "--micro-batch", dest="micro_batch",
                   help="micro-batch b, or 'auto' to sweep 1, 2, 4, ... (default 1, or the --config's)")
    p.add_argument("--parallel.tp", "--tp", dest="tp", type=int, help="tensor-parallel size t (default 1)")
    p.add_argument("--parallel.pp", "--pp", dest="pp", type=int, help="pipeline-parallel size p (default 1)")
    p.add_argument("--parallel.pp_virtual_stages", "--pp-virtual-stages", dest="pp_virtual_stages", type=int,
                   help="V, stages per rank of the interleaved schedule in the --pp table (default 2)")
    p.add_argument("--pp-micro-batches", type=int,
                   help="m, micro-batches per step in the --pp table: GPipe's activations, every bubble "
                   "(default 2 p)")
    p.add_argument("--parallel.pp_schedule", "--pp-schedule", dest="pp_schedule", default="all",
                   choices=("all",) + SCHEDULES, help="the --pp table's row (default all schedules)")
    p.add_argument("--parallel.dp", "--dp", dest="dp", type=int,
                   help="data-parallel ranks the state is sharded over (matters with --zero-stage): dp, "
                   "or under HSDP dp / dp_replicate (default 1)")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism")
    p.add_argument("--parallel.sequence_parallel", dest="sequence_parallel", type=_boolean, metavar="true|false",
                   help="the same, spelled as in largebatch train")
    p.add_argument("--parallel.loss_parallel", dest="loss_parallel", type=_boolean, metavar="true|false",
                   help="with tp > 1: the logits stay split over the vocabulary (true: the paper's layout, the "
                   "default without --config) or are gathered on every rank (false: the trainer's default)")
    p.add_argument("--run.recompute", dest="run_recompute", metavar="POLICY[,POLICY...]",
                   help="a line for this recomputation beside 'no recompute', spelled as in largebatch train: "
                   "one policy for every layer (selective) or one per layer (full,full,selective,selective); "
                   "overrides a --config's run.recompute")
    p.add_argument("--budget-gib", type=finite_float, help="memory per device in GiB; omit for the table only")
    p.add_argument("--optim.name", "--optimizer", dest="optimizer", choices=sorted(OPTIMIZER_STATE_BYTES),
                   help="sizes its state (default adamw, or the --config's): fp32 bytes per parameter, 8 for "
                   "adamw, lamb and lans, 4 for lars and sgd with momentum (sgd: for planning a loop of your own; "
                   "the trainer does not offer it), and any optimizer register_optimizer declared "
                   "(largebatch.train.optimizer)")
    p.add_argument("--run.ema_decay", dest="ema_decay", type=_decay_or_none, metavar="DECAY",
                   help="the trainer's weight average (default: the --config's): one more fp32 copy of the "
                   "parameters, counted with the optimizer state; none for no average")
    p.add_argument("--dtype-bytes", type=finite_float,
                   help="bytes per activation/parameter (2 = fp16/bf16 with fp32 master, 4 = fp32; default 2, "
                   "or from the --config's run.dtype)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage of the data-parallel sharding (default 0; a --config with parallel.dp_mode "
                   "= 'fsdp' gives 3: FSDP shards parameters, gradients and optimizer state)")
    return p


def _decay_or_none(text: str) -> float | str:
    """--run.ema_decay: a decay in (0, 1), or "none" (no average, over a --config's)."""
    if text.strip().lower() == "none":
        return "none"
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must lie strictly between 0 and 1, or be none")
    return value


MAX_LAYERS = 100_000
DEFAULTS = {"micro_batch": "1", "tp": 1, "pp": 1, "pp_virtual_stages": 2, "dp": 1, "zero_stage": 0,
            "sequence_parallel": False}


def _config(args: argparse.Namespace) -> ModelConfig:
    """The model the flags, --config or --hf-config describe; a bad field is named as it was given
    (--model.dropout on the command line, model.dropout in a config), not as ModelConfig's."""
    try:
        return _model_config(args)
    except ValueError as exc:
        named = named_as_written(str(exc), ModelConfig, "model", {f.name for f in fields(ModelConfig)})
        field = re.match(r"model\.(\w+)", named)
        if field is None:
            raise
        given = {f for flag, f in OVERRIDES.items() if getattr(args, flag) is not None}
        raise ValueError(("--" if field.group(1) in given else "") + named) from None


def _model_config(args: argparse.Namespace) -> ModelConfig:
    changes = {field: None if getattr(args, flag) == "none" else getattr(args, flag)
               for flag, field in OVERRIDES.items() if getattr(args, flag) is not None}
    if args.seq_len is not None:
        changes["seq_len"] = args.seq_len
    if args.config and args.hf_config:
        raise ValueError(f"--config {args.config!r} and --hf-config {args.hf_config!r}: give one.")
    if args.hf_config and args.model:
        raise ValueError(f"--model {args.model!r} and --hf-config {args.hf_config!r}: give one.")
    if args.phase is not None and not args.config:
        raise ValueError(f"--phase {args.phase}: needs --config, a `largebatch train` TOML with [[phases]].")
    if args.hf_config:
        config = config_from_hf(args.hf_config)
        def used(field: str, value):  # (n_kv_head = n_head is the attention None gives; so are heads of h / a)
            if field == "n_kv_head":
                return value or config.n_head
            if field == "head_size":
                return value or config.n_embd // config.n_head
            return value

        layer = {f: v for f, v in changes.items() if f in ("norm", "position", "activation", "n_kv_head",
                                                            "head_size", "qk_norm", "document_mask",
                                                            "sliding_window", "full_attention_layers",
                                                            "norm_position", "qk_norm_scope")
                 and used(f, v) != used(f, getattr(config, f))}
        if layer:  # transformers' layers are what config.json says: no flag turns GPT-2's into Llama's
            flags = ", ".join(f"--model.{f} {v}" for f, v in layer.items())
            first = next(iter(layer))
            raise ValueError(f"{flags} with --hf-config {args.hf_config!r}: transformers' layers of that config "
                             f"compute model.{first}={getattr(config, first)!r}, as its config.json says; drop "
                             "the flag, or describe largebatch's own layers with --model/--layers/--hidden/... "
                             "instead of --hf-config")
        if "n_layer" in changes and config.full_attention_layers:  # (--layers fewer: the pattern's first layers)
            changes["full_attention_layers"] = tuple(i for i in config.full_attention_layers if i < changes["n_layer"])
        return config.replace(**changes)
    if args.config:
        return _from_train_config(args).replace(**changes)
    return preset(args.model or "demo", **changes)


def _from_train_config(args: argparse.Namespace) -> ModelConfig:
    """The model of a trainer config; its micro-batch and mesh fill the flags left at defaults."""
    explicit_micro_batch = args.micro_batch is not None
    tree = load_toml(required_config_file(args.config))  # a file or a shipped config's name
    model = dict(tree.get("model", {}))
    if "vocab_size" in tree.get("data", {}):  # the trainer sizes the model to its tokenizer
        model["vocab_size"] = tree["data"]["vocab_size"]
    config = from_dict(ModelConfig, model, prefix="model")
    run, par = tree.get("run", {}), tree.get("parallel", {})
    if args.micro_batch is None and "micro_batch" in run:
        args.micro_batch = str(run["micro_batch"])
    if args.dtype_bytes is None:
        args.dtype_bytes = 2 if run.get("dtype", TRAIN_DEFAULTS["run.dtype"]) in ("bf16", "fp16") else 4
        if args.dtype_bytes == 2:
            half = run.get("dtype", TRAIN_DEFAULTS["run.dtype"])
            args.notes.append(f"run.dtype = {half!r}: planned as 2-byte activations, the paper's pure 16-bit "
                              f"layout; the trainer's {half} runs under torch.autocast, which keeps fp32 norm "
                              f"inputs, a {half} copy of the Q/K/V input per projection and {half} copies of "
                              "the weights: measured 1.24-1.55x this prediction in bf16 on CPU (docs/memory.md)")
    if args.optimizer is None:
        args.optimizer = tree.get("optim", {}).get("name", TRAIN_DEFAULTS["optim.name"])
    if args.ema_decay is None:
        args.ema_decay = run.get("ema_decay")
        if args.ema_decay not in (None, "none"):
            args.notes.append(f"run.ema_decay = {args.ema_decay}: the weight average, one more fp32 copy of the "
                              "parameters, is counted with the optimizer state")
    recompute = run.get("recompute", ["none"])
    args.config_recompute = recompute[0] if isinstance(recompute, list) and len(recompute) == 1 else recompute
    if args.tp is None:
        args.tp = par.get("tp", 1)
    if args.pp is None:
        args.pp = par.get("pp", 1)
    if args.pp_virtual_stages is None and par.get("pp_virtual_stages", 1) > 1:
        args.pp_virtual_stages = par["pp_virtual_stages"]
    if args.pp_schedule == "all" and "pp_schedule" in par:
        args.pp_schedule = par["pp_schedule"]
    if args.dp is None:  # the ranks the state is sharded over: under HSDP one replica group's
        args.dp = (par.get("dp", 0) or 1) // (par.get("dp_replicate", 1) if par.get("dp_mode") == "fsdp" else 1)
    if args.zero_stage is None and par.get("dp_mode") == "fsdp" and args.dp > 1:
        args.zero_stage = 3  # FSDP2 shards parameters, gradients and optimizer state over those ranks
        args.notes.append(f"parallel.dp_mode = 'fsdp': planned as ZeRO stage 3 over {args.dp} ranks "
                          "(parameters, gradients and optimizer state sharded; --zero-stage changes it)")
    if args.sequence_parallel is None:
        args.sequence_parallel = bool(par.get("sequence_parallel", False))
    if args.loss_parallel is None:
        args.loss_parallel = bool(par.get("loss_parallel", TRAIN_DEFAULTS["parallel.loss_parallel"]))
    split = par.get("pp_split")
    if split and args.pp > 1:  # uneven stages: planned as p stages of the largest (an upper bound)
        bounds = [0, *split, config.n_layer]
        largest = max(b - a for a, b in zip(bounds, bounds[1:])) * max(1, len(bounds) - 1) // args.pp
        args.notes.append(f"parallel.pp_split = {split}: uneven stages, planned as {args.pp} stages of "
                          f"the largest rank's {largest} layers (an upper bound)")
        config = config.replace(n_layer=largest * args.pp)
    if args.phase is not None:
        config = _phase(args, tree, config, explicit_micro_batch)
    if args.pp > 1 and args.pp_micro_batches is None and (args.micro_batch or "1").isdigit():
        # micro-batches per step: the step's batch over micro_batch x the data-parallel ranks
        schedule = dict(tree.get("schedule", {}))
        if args.phase is not None:  # (a valid index: _phase checked it) a phase's own schedule fields
            schedule.update(tree["phases"][args.phase].get("schedule", {}))
        batch = from_dict(ScheduleConfig, schedule, prefix="schedule").batch_size
        ranks = par.get("dp", 0) or 1
        args.pp_micro_batches = max(1, batch // (int(args.micro_batch or "1") * ranks))
        args.notes.append(f"pipeline micro-batches m = {args.pp_micro_batches}: schedule.batch_size {batch} / "
                          f"(micro_batch {args.micro_batch or 1} x dp {ranks}); a schedule that grows the batch "
                          "keeps more at its largest: give --pp-micro-batches for that step")
    return config


def _phase(args: argparse.Namespace, tree: dict, config: ModelConfig, explicit_micro_batch: bool) -> ModelConfig:
    """The model at phase ``args.phase``'s sequence length; its micro-batch fills --micro-batch unless
    given."""
    phases = tree.get("phases") or []
    if not 0 <= args.phase < len(phases):
        have = f"phases 0..{len(phases) - 1}" if phases else "no [[phases]]"
        raise ValueError(f"--phase {args.phase}: {args.config} has {have}; give one of those, or leave "
                         "--phase out to plan at the model's context.")
    phase = phases[args.phase]
    if not explicit_micro_batch and phase.get("micro_batch"):
        args.micro_batch = str(phase["micro_batch"])
    if args.seq_len is None and "seq_len" in phase:
        return config.replace(seq_len=phase["seq_len"])
    return config


def paper_table(config: ModelConfig, s: int, b: int, t: int, dtype_bytes: float) -> list[str]:
    """Korthikanti et al. 2022 Table 2 for this model: per layer and for all L layers."""
    L = config.n_layer
    rows = [("no parallelism", 1, False, "none"), ("tensor parallel", t, False, "none"),
            ("tensor + sequence parallel", t, True, "none"),
            ("tensor parallel + selective recompute", t, False, "selective"),
            ("tensor + sequence parallel + selective", t, True, "selective"),
            ("full recompute (tensor parallel)", t, False, "full"),
            ("full recompute (tensor + sequence parallel)", t, True, "full")]
    kw = config_layer_kwargs(config, dtype_bytes=dtype_bytes)
    per_layer = {name: activation_bytes_per_layer(s, b, tp=tp, sequence_parallel=sp, recompute=rec, **kw)
                 for name, tp, sp, rec in rows}
    reference = per_layer["tensor parallel"]
    width = max(len(r[0]) for r in rows)
    llama = [f"f={config.ffn}"] if config.ffn != 4 * config.n_embd else []
    llama += [f"a_kv={config.kv_heads}"] if config.kv_heads != config.n_head else []
    llama += [f"d_h={config.head_dim}"] if config.attention_width != config.n_embd else []
    llama += [{"head": "q/k norms", "projection": "q/k projection norms"}[config.qk_norm_layout]] if config.qk_norm \
        else []
    llama += ["reordered norms"] if config.norm_position == "reordered" else []
    llama += ["parallel attention and MLP"] if config.norm_position == "parallel" else []
    llama += [f"{config.norm}"] if config.norm != "layernorm" else []
    llama += [f"{config.position} positions"] if config.position != "learned" else []
    llama += [f"{config.activation} MLP"] if config.activation == "swiglu" else []
    llama += [config.window_words()] if config.window_layout != "none" else []
    lines = [f"Activation memory per device (Korthikanti et al. 2022, Table 2): s={s} b={b} "
             f"h={config.n_embd} a={config.n_head} t={t} L={L}" + "".join(f" {x}" for x in llama)
             + f", {dtype_bytes:g}-byte activations"
             + ("" if kw["dropout"] else ", no dropout (no masks; the softmax output is what @V keeps)")
             + (", fused attention (no s^2 term)" if kw["fused_attention"] else ""),
             f"  {'setting':<{width}}  {'per layer':>11}  {f'{L} layers':>11}  tensor parallel / this"]
    for name, _, sp, _ in rows:
        bytes_ = per_layer[name]
        whole = (f"{L * bytes_ / GIB:>7.2f} GiB" if L * bytes_ >= GIB / 100  # small models: MiB, not 0.00 GiB
                 else f"{L * bytes_ / 2**20:>7.2f} MiB")
        refused = sp and t > 1 and s % t  # the formula takes any t; a run cannot split s unevenly
        lines.append(f"  {name:<{width}}  {bytes_ / 2**20:>7.1f} MiB  {whole}  {reference / bytes_:>6.1f}x"
                     + (f"  (t={t} does not divide s={s}: no run splits the sequence so)" if refused else ""))
    if mask := attention_mask_bytes(config, b, s, dtype_bytes):  # not a layer's: one per micro-batch, whichever row
        size = f"{mask / 2**20:.1f} MiB" if mask >= 2**20 else f"{mask / 2**10:.0f} KiB"
        count = attention_mask_count(config, s)
        windowed = any(w is not None for w in config.windows_at(s))  # (a window of s or more: none)
        what = ("the document mask" if not windowed else "the sliding window's mask"
                if not config.document_mask else f"{count} attention masks (documents, and the sliding window's)"
                if count > 1 else "the document mask within the sliding window")
        shape = "s^2 b" if config.document_mask else "s^2"
        lines.append(f"  + {what}, {size} per micro-batch once for all layers "
                     f"({shape} {'bool' if config.attention == 'explicit' else f'{dtype_bytes:g}-byte values'}, "
                     "whole on every tensor-parallel rank; in the totals below)")
    return lines


MEASURED = {"1f1b": 1.008, "interleaved-1f1b": 1.031, "gpipe": 1.006, "interleaved-zb": 1.038, "zbv": 1.038}
"""Peak bytes autograd holds on the first stage's rank over the row's model, 2 gloo ranks, 4-layer
64-wide fp32 GPT, m = 4 (tests/test_pipeline.py, docs/memory.md): torch's received stage inputs."""


def pipeline_table(config: ModelConfig, setup: Setup, virtual: int, m: int, schedule: str = "all") -> list[str]:
    """The first pipeline stage's activations and the bubble per schedule: the closed forms of
    Korthikanti et al. 2022 §4.2.3 for GPipe, 1F1B and interleaved 1F1B, the walk of torch's action
    lists (largebatch.memory.pipeline_schedule) for the zero-bubble schedules and every bubble."""
    p, L = setup.pp, config.n_layer
    if L % p:
        raise ValueError(f"pp={p}: must divide n_layer={L} (each stage holds L/p layers); choose a divisor of {L}")
    if virtual < 1:
        raise ValueError(f"--pp-virtual-stages {virtual}: must be a positive divisor of the {L // p} layers "
                         "per stage")
    skipped = []
    if (L // p) % virtual:  # the interleaved rows cannot be cut so; the other schedules do not need V
        if schedule.startswith("interleaved"):
            raise ValueError(f"--pp-virtual-stages {virtual}: must be a positive divisor of the {L // p} layers "
                             "per stage")
        skipped = [f"  (interleaved rows left out: V = {virtual} does not divide the {L // p} layers per stage; "
                   "--pp-virtual-stages sets V)"]
    if schedule == "zbv" and (L // p) % 2:
        raise ValueError(f"--pp-schedule zbv: holds 2 stages per rank, but the {L // p} layers per rank are odd")
    rows = [("1f1b", 1, f"p micro-batches x L/p = {L}"),
            ("interleaved-1f1b", virtual, f"L (1 + (p-1)/(pV)), V = {virtual}"),
            ("gpipe", 1, f"m L/p, m = {m}"),
            ("interleaved-zb", virtual, f"walk: kept until W, V = {virtual}"),
            ("zbv", 2, "walk: kept until W, V = 2, + output layer")]
    rows = [r for r in rows if schedule in ("all", r[0]) and not (r[0] == "zbv" and (L // p) % 2)
            and not (skipped and r[0].startswith("interleaved"))]
    kw = dict(tp=setup.tp, sequence_parallel=setup.sequence_parallel, dtype_bytes=setup.dtype_bytes,
              loss_parallel=setup.loss_parallel)
    lines = ["", f"First pipeline stage, p = {p}, m = {m}, no recompute (Korthikanti et al. 2022 §4.2.3);",
             "bubble: the idle share of torch's action lists, a forward, input- and weight-gradient 1 slot each:",
             f"  {'schedule':<17} {'layers worth':>12}  {'activations':>13}  {'bubble':>6}  {'measured':>8}  rule",
             *skipped]
    for name, v, rule in rows:
        try:
            walked = walk(name, p, v, m)
        except ValueError as err:
            if schedule != "all":
                raise
            walked, rule = None, f"no walk: {err}"
        if name in ZERO_BUBBLE and walked is None:
            lines.append(f"  {name:<17} {'-':>12}  {'-':>13}  {'-':>6}  {MEASURED[name]:>7.3f}x  {rule}")
            continue
        if name in ZERO_BUBBLE:
            worth = walked.layers_worth(L)
            acts = schedule_activation_bytes(config, setup.micro_batch, name, p, v, m, **kw)
        else:
            worth = first_stage_layers(L, p, name, v, m)
            acts = model_activation_bytes(config, setup.micro_batch, "none", pp=p, schedule=name, virtual_stages=v,
                                          micro_batches=m, **kw)
        bubble = f"{walked.bubble:>6.3f}" if walked else f"{'-':>6}"
        bound = ">=" if name in ZERO_BUBBLE else "  "
        lines.append(f"  {name:<17} {worth:>12.2f}  {bound}{acts / GIB:>7.2f} GiB  {bubble}  {MEASURED[name]:>7.3f}x"
                     f"  {rule}")
    lines.append("  measured: peak bytes on the first stage's rank over the row's model, 2 gloo ranks, 4-layer fp32 "
                 "GPT, V = 2, m = 4")
    if any(name in ZERO_BUBBLE for name, _, _ in rows):
        lines.append("  >= zero bubble: a lower bound -- torch also keeps received stage inputs (docs/memory.md)")
    return lines


def hf_eager_lines(hf_config: str, config: ModelConfig, b: int, dtype_bytes: float) -> list[str]:
    """transformers' layers against the closed form, per layer, no parallelism or recompute: eager
    (GPT-2, BERT, Llama, GPT-NeoX), or a Llama's or GPT-NeoX's sdpa layers under --attention sdpa."""
    s, act = config.seq_len, hf_activation(hf_config)
    closed = activation_bytes_per_layer(s, b, **config_layer_kwargs(config, dtype_bytes=dtype_bytes))
    gpu, cpu = (hf_eager_layer_bytes(config, act, b, seq_len=s, dtype_bytes=dtype_bytes, device=device)
                for device in ("cuda", "cpu" if config.attention == "explicit" else "cuda"))
    if config.activation == "swiglu":  # a Llama-family model (memory/hf.py: llama_layer_bytes)
        if config.attention != "explicit":
            windowed = [i for i, w in enumerate(config.windows_at(s)) if w is not None]
            full = [i for i in range(config.n_layer) if i not in windowed]
            lines = [""]
            if full:
                layer = hf_eager_layer_bytes(config, act, b, seq_len=s, dtype_bytes=dtype_bytes, layer=full[0])
                which = ", full-attention ones" if windowed else ""
                lines.append(f"HF sdpa layers{which}: ~{layer / closed:.2f}x this "
                             f"model's 'no parallelism' row ({layer / 2**20:.1f} MiB per layer; RMSNorm's fp32 input "
                             "and normalised tensor; torch's fused kernel with enable_gqa, measured on CPU without "
                             "dropout, docs/memory.md).")
            if windowed:
                layer = hf_eager_layer_bytes(config, act, b, seq_len=s, dtype_bytes=dtype_bytes, layer=windowed[0])
                lines.append(f"HF sdpa layers with the sliding window ({len(windowed)} of {config.n_layer}): "
                             f"~{layer / closed:.2f}x this model's 'no parallelism' row ({layer / 2**20:.1f} MiB per "
                             "layer; with the window's mask transformers passes no enable_gqa, so K and V are kept "
                             "at all heads, and sdpa keeps a float copy of the mask; measured on CPU without "
                             "dropout, docs/memory.md).")
            return lines
        extras = ("K/V repeated to all heads" if config.kv_heads != config.n_head else "K/V") + \
            (", the fp32 softmax" if dtype_bytes != 4 else "") + ", RMSNorm's fp32 input and normalised tensor" + \
            (" (the q/k norms' too)" if config.qk_norm else "")
        if config.dropout == 0:  # no masks: CPU and GPU keep the same
            return ["", f"HF eager layers: ~{cpu / closed:.2f}x this model's 'no parallelism' row "
                        f"({cpu / 2**20:.1f} MiB per layer; {extras}; terms measured on tiny models on CPU, "
                        "docs/memory.md)."]
        extras += ", float dropout masks"
    elif config.position == "rope":  # GPT-NeoX (memory/hf.py: neox_layer_bytes)
        kernel = "eager" if config.attention == "explicit" else "sdpa"
        extras = ("the fp32 softmax, " if kernel == "eager" else "the fused q/k/v output a view keeps, ") + \
            "rotated q and k copies, LayerNorm statistics" + (", gelu_new intermediates" if act == "gelu_new" else "")
        if config.dropout == 0 or kernel == "sdpa":  # no masks (sdpa with dropout on CPU is refused above)
            return ["", f"HF {kernel} layers: ~{cpu / closed:.2f}x this model's 'no parallelism' row "
                        f"({cpu / 2**20:.1f} MiB per layer; {extras}; terms measured on tiny models on CPU, "
                        "docs/memory.md)."]
        extras += ", float dropout masks"
    else:
        extras = "float dropout masks" + (", gelu_new intermediates" if act == "gelu_new" else "")
    return ["", f"HF eager layers: ~{cpu / closed:.2f}x this model's 'no parallelism' row on CPU "
                f"({cpu / 2**20:.1f} MiB per layer; {extras}; terms measured on tiny models, "
                "docs/memory.md),",
            f"  ~{gpu / closed:.2f}x with the 1-byte bool dropout masks GPUs keep (terms measured on CPU "
            "with that dropout, not on a GPU)."]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.notes, args.config_recompute = [], None
    try:
        if args.budget_gib is not None and args.budget_gib <= 0:
            raise ValueError(f"--budget-gib {args.budget_gib:g}: must be > 0 (memory per device in GiB, "
                             f"e.g. 80)")
        if args.pp_micro_batches is not None and args.pp_micro_batches < 1:
            raise ValueError(f"--pp-micro-batches {args.pp_micro_batches}: must be a positive number of "
                             f"micro-batches per step (default 2 x pp)")
        if args.dtype_bytes is not None and not 0 < args.dtype_bytes <= 8:
            raise ValueError(f"--dtype-bytes {args.dtype_bytes:g}: bytes per stored value, from 1 (fp8) to 8 "
                             f"(fp64); 2 for fp16/bf16, 4 for fp32")
        config = _config(args)
        source = "the config's run.recompute"
        if args.run_recompute is not None:  # (after a --config's, which it overrides)
            names = [name.strip() for name in args.run_recompute.split(",")]
            args.config_recompute, source = (names[0] if len(names) == 1 else names), "--run.recompute"
        if config.n_layer > MAX_LAYERS:  # the estimates keep a policy per layer (time and memory grow with L)
            raise ValueError(f"--layers {config.n_layer:,}: at most {MAX_LAYERS:,} (the estimates go layer by "
                             "layer; the largest trained models have a few hundred)")
        for name, value in DEFAULTS.items():  # what neither the command line nor a --config gave
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.dtype_bytes = 2 if args.dtype_bytes is None else args.dtype_bytes
        args.optimizer = args.optimizer or "adamw"
        args.loss_parallel = True if args.loss_parallel is None else args.loss_parallel
        auto = args.micro_batch == "auto"
        if not auto and (not args.micro_batch.isdigit() or int(args.micro_batch) == 0):
            raise ValueError(f"--micro-batch {args.micro_batch!r}: give a positive integer or 'auto'.")
        # an HF config with eager (explicit) attention is a transformers eager model: its layers
        # keep more than the closed form (memory/hf.py); --attention sdpa describes a fused kernel,
        # whose terms are measured for transformers' Llama layers unsharded (counts_hf_terms)
        hf_terms = bool(args.hf_config) and counts_hf_terms(
            config, hf_activation(args.hf_config), tp=args.tp, pp=args.pp, sequence_parallel=args.sequence_parallel)
        # the estimates and the plan follow one schedule: the one asked for, else 1F1B
        schedule = "1f1b" if args.pp_schedule == "all" else args.pp_schedule
        if schedule == "zbv" and args.pp_virtual_stages not in (None, 2):  # (as largebatch train refuses it)
            raise ValueError(f"--parallel.pp_virtual_stages {args.pp_virtual_stages} with --parallel.pp_schedule "
                             "zbv: the V shape holds exactly 2 stages per rank; give 2 or leave it out")
        virtual = stages_per_rank(schedule, args.pp_virtual_stages)
        setup = Setup(tp=args.tp, pp=args.pp, dp=args.dp, sequence_parallel=args.sequence_parallel,
                      micro_batch=1 if auto else int(args.micro_batch), seq_len=config.seq_len,
                      optimizer=args.optimizer, dtype_bytes=args.dtype_bytes, zero_stage=args.zero_stage,
                      weight_average=args.ema_decay not in (None, "none"),
                      pp_schedule=schedule, pp_virtual_stages=virtual,
                      pp_micro_batches=args.pp_micro_batches or 2 * args.pp, loss_parallel=args.loss_parallel,
                      # transformers' BertForMaskedLM runs its head on every position, not the masked ones
                      mask_fraction=1.0 if args.hf_config and config.kind == "bert" else 0.15,
                      hf_activation=hf_activation(args.hf_config) if hf_terms else None)
        if setup.sequence_parallel and setup.tp == 1:  # as the trainer: with one tp rank it splits nothing
            raise ValueError("--sequence-parallel needs --tp > 1 (it splits the sequence across the "
                             "tensor-parallel ranks; with tp 1 the estimate is the one without it); set "
                             "--tp, or no --sequence-parallel.")
        if setup.sequence_parallel and config.seq_len % setup.tp:  # (the closed form takes any t)
            raise ValueError(f"tp={setup.tp} does not divide seq_len={config.seq_len}: sequence parallelism "
                             "gives each tp rank an equal share of the sequence (the trainer refuses this "
                             "layout); choose a seq_len that tp divides, or no --sequence-parallel.")
        if args.budget_gib is not None:
            check_plannable(config, setup)
        if args.pp > 1 and config.tie_embeddings:
            args.notes.append(f"model.tie_embeddings = true with pp = {args.pp}: pipeline stages cannot share "
                              "the token embedding (first stage) with the output layer (last stage), so the "
                              "trainer refuses it; planned untied, as it would run with "
                              "model.tie_embeddings = false")
        lines = [*args.notes, *paper_table(config, config.seq_len, setup.micro_batch, args.tp, args.dtype_bytes)]
        if args.hf_config and (config.attention == "explicit" or config.activation == "swiglu"):
            lines += hf_eager_lines(args.hf_config, config, setup.micro_batch, args.dtype_bytes)
        if args.pp > 1:
            lines += pipeline_table(config, setup, args.pp_virtual_stages, args.pp_micro_batches or 2 * args.pp,
                                    args.pp_schedule)
        lines += ["", f"Per-layer bytes of the estimates and the plan: {setup.formula}"]
        if args.tp > 1:
            lines.append("Output logits (fp32): " + ("split over the vocabulary across tp (parallel.loss_parallel)"
                                                     if args.loss_parallel else "gathered, the whole vocabulary on "
                                                     "every rank (parallel.loss_parallel = false)"))
        if args.pp > 1:
            lines.append(f"Pipeline schedule of the estimates and the plan: {schedule} (V = {virtual}, "
                         f"m = {setup.pp_micro_batches}; the first stage keeps "
                         f"{first_stage_layers(config.n_layer, args.pp, schedule, virtual, setup.pp_micro_batches):.2f}"
                         f" layers' worth{', a lower bound' if schedule in ZERO_BUBBLE else ''})"
                         + ("; --pp-schedule plans another" if args.pp_schedule == "all" else ""))
        lines.append(f"Per device, no recompute: {setup.estimate(config, 'none')}")
        if args.config_recompute not in (None, ["none"], "none"):
            policies = args.config_recompute
            try:
                slices = rank_policies(policies, config.n_layer, args.pp)
            except ValueError as err:
                where = source if args.run_recompute is not None else f"run.recompute in {args.config}"
                raise ValueError(f"{where} = {policies!r}: {err}") from None
            # the list runs over the whole model: each rank has its own slice (the planner's mixes are
            # one per rank); the rank that needs the most, each slice taken as every rank's
            worst = max((setup.estimate(config, layers) for layers in slices), key=lambda e: e.total)
            lines.append(f"Per device, {source} = {policies}: {worst}")
    except ValueError as err:
        print(f"largebatch memory: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if args.budget_gib is None:
        return 0
    budget = args.budget_gib * GIB
    plans = (micro_batch_sweep(config, setup, budget) if auto
             else [p for p in [cheapest_plan(config, setup, budget)] if p])
    if not plans:
        floor = replace(setup, micro_batch=1).estimate(config, "full")
        if not auto and setup.micro_batch > 1 and floor.total <= budget:  # a smaller micro-batch fits
            print(f"\nNothing fits in {args.budget_gib:g} GiB at micro-batch {setup.micro_batch}; micro-batch 1 "
                  f"with full recomputation needs {floor}: lower --micro-batch, or give --micro-batch auto "
                  f"for the largest that fits.")
            return 1
        print(f"\nNothing fits in {args.budget_gib:g} GiB: micro-batch 1 with full recomputation needs "
              f"{floor}.")
        fixes = what_would_fit(config, setup, budget, micro_batches_asked=args.pp_micro_batches is not None)
        print("Would fit: " + ("; ".join(fixes) if fixes else "no tp/pp/ZeRO setting on this budget; "
                                                              "use devices with more memory."))
        return 1
    print(f"\nCheapest recomputation that fits {args.budget_gib:g} GiB:")
    for plan in plans:
        print("  " + plan.describe())
    if auto:
        least = min(p.recompute_overhead for p in plans)
        pick = max((p for p in plans if p.recompute_overhead <= least + 1e-12),
                   key=lambda p: p.setup.micro_batch)
        print(f"Plan: micro-batch {pick.setup.micro_batch} (largest at the least recompute FLOPs).")
    chosen = pick if auto else plans[0]
    print("apply_recompute policy (each pipeline stage): " + _as_expression(chosen.policies))
    return 0


def _as_expression(policies: list[str]) -> str:
    runs = [(p, policies.count(p)) for p in dict.fromkeys(policies)]
    return " + ".join(f'["{p}"] * {n}' for p, n in runs)
