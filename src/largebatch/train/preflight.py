"""Checks before any work starts: what would otherwise fail after the data, the model or hours of
training are built is refused in one line naming the field, the value and the fix.

* the run directory can be made and written (not a file, not on a read-only disk);
* ``run.device`` exists on this machine (outside torchrun, where each rank takes its local GPU);
* ``data.corpus`` / ``data.val_corpus`` exist, and a JSON Lines corpus has ``data.text_field``; a
  corpus that is one text file has a ``data.document_separator`` or a ``data.val_corpus``;
* ``data.tokenizer_file`` is a tokenizer.json (or a directory holding one);
* a raw ``.bin`` corpus's ``data.bin_dtype`` holds every id of the vocabulary;
* a BERT run's tokenizer (``data.tokenizer_file``; a token array needs one) has [CLS], [SEP] and [MASK]
  (or <s>, </s>, <mask>);
* ``data.cache_dir`` can be made and written when a text corpus's cache has yet to be built there;
* ``model.init_from``'s weights map onto the model (names and shapes), on a fresh start;
* the model fits: fp32 parameters, gradients and optimizer state, counted from the config by the
  closed-form estimator of largebatch.memory (ZeRO accounting, Rajbhandari et al. 2020 §3.1; see
  docs/papers.md: memory) BEFORE the model is built, against the memory this machine has free --
  ``model.n_layer=1e8`` is refused in a second instead of growing until the kernel kills the job;
* a ``--resume`` keeps what its checkpoints' state was built for (model shapes, the optimizer);
* ``run.wandb``: on rank 0, the ``wandb`` package is there and W&B has credentials (or runs offline or
  disabled): without them ``wandb.init`` failed once the data and the model were built.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from largebatch.arguments import check_output_dir
from largebatch.memory.activations import last_stage_rank
from largebatch.memory.estimate import GIB, stage_parameters
from largebatch.train.config import TrainConfig
from largebatch.train.optimizer import OPTIMIZERS
from largebatch.train.rundir import among, claim_new_dir, differing_fields
from largebatch.typed_config import ConfigError

# the checkpoints of a run hold tensors shaped by these fields, and the optimizer's own state
STATE_FIELDS = ("model.kind", "model.n_layer", "model.n_embd", "model.n_head", "model.ffn_hidden",
                "model.seq_len", "model.tie_embeddings", "model.bias", "model.norm_position", "model.activation",
                "model.n_kv_head", "model.head_size", "model.qkv_bias", "model.qk_norm", "model.qk_norm_scope",
                "model.norm", "model.position", "model.rope_fraction",
                "data.vocab_size", "data.tokenizer_file", "optim.name", "optim.adapt")
# the schedule a run's checkpoints continue is built from these (its state refuses another), and
# the sample order their data position counts in from these
SCHEDULE_FIELDS = ("schedule.", "run.total_tokens", "run.micro_batch", "phases")
ORDER_FIELDS = ("data.seed", "data.shuffle", "data.mixture")  # (a mixture's weights and order: its draws)
FP32_BYTES = 4  # parameters and gradients stay fp32 (bf16 runs autocast the compute only)


@dataclass(frozen=True)
class StateEstimate:
    """Bytes of model state one process holds while training (before activations)."""

    parameters: float
    """Parameters held by one process (its tensor-parallel share)."""
    bytes: float
    """Parameters + gradients + optimizer state, fp32."""
    available: float
    """Memory free for them: the device's on CUDA, the machine's (shared by its local ranks) on CPU."""
    source: str
    vocab_size: int | None = None
    """The tokenizer's size the estimate sized the model for (None: ``data.vocab_size``)."""
    step_copy: float = 0.0
    """What a step that may be taken back (run.on_nonfinite = 'skip', fp16: largebatch.train.skip)
    copies while the optimizer steps: the parameters and the optimizer state, beside ``bytes``; the
    step's activations are freed by then."""


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be created and written (a file there or a read-only disk: refused), and
    so can its checkpoints directory where it exists already (a run continued into a read-only one
    trained to its first save and lost those steps)."""
    try:
        check_output_dir(run_dir, "run.out_dir")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():
        return
    try:  # probed for real, as check_output_dir does: permission bits do not stop root
        os.rmdir(tempfile.mkdtemp(prefix=".largebatch-probe-", dir=checkpoints))
    except OSError as exc:
        raise ConfigError(f"run.out_dir = {str(run_dir)!r}: its checkpoints directory {checkpoints} cannot be "
                          f"written ({exc.strerror or exc}), so this run could save no checkpoint; make it "
                          "writable and run the same command again") from None


def make_run_dir(run_dir: Path, unique: bool) -> Path:
    """Create the run directory now (``unique``: ``-2``, ``-3``... when taken; see claim_new_dir),
    so a directory that cannot be made (a read-only or special file system) is refused here."""
    try:
        if unique:
            return claim_new_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    except OSError as exc:
        raise ConfigError(f"run.out_dir = {str(run_dir)!r}: cannot create {exc.filename or run_dir} "
                          f"({exc.strerror or exc}); choose a writable directory") from None


def check_resume(saved: TrainConfig, cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a ``--resume`` override that changes what the checkpoints' state was built for.
    (``data.tokenizer_file`` is compared by content, in resume_tokenizer, before this.)"""
    saved = dataclasses.replace(saved, data=dataclasses.replace(saved.data, tokenizer_file=cfg.data.tokenizer_file),
                                model=_as_used(saved.model))
    cfg = dataclasses.replace(cfg, model=_as_used(cfg.model))
    rotary = saved.model.position == cfg.model.position == "rope"
    changed = differing_fields(saved, cfg, lambda key: key in STATE_FIELDS and not (rotary and key == "model.seq_len"))
    if changed:
        raise ConfigError(f"--resume {run_dir}: {'; '.join(changed)} does not fit the model and "
                          f"optimizer state its checkpoints hold; resume without that override, or "
                          f"start a new run with another --run.out_dir")
    if rotary and saved.model.seq_len != cfg.model.seq_len:  # no tensor's shape, but the samples' length
        raise ConfigError(f"--resume {run_dir}: model.seq_len: {saved.model.seq_len} -> {cfg.model.seq_len} "
                          "changes the samples its checkpoints' data position counts in (rotary positions "
                          "hold no table of that size); to train another context, declare [[phases]] with "
                          "their seq_len in the config file, or continue from an export in a new run: "
                          "largebatch export RUN_DIR OUT --format hf, then --model.init_from=hf:OUT "
                          f"--model.seq_len={cfg.model.seq_len} (and --model.rope_theta or --model.rope_scaling)")
    for fields, what in ((SCHEDULE_FIELDS, "the schedule its checkpoints continue (the LR and batch "
                                           "size at every token)"),
                         (ORDER_FIELDS, "the sample order its checkpoints' data position counts in "
                                        "(samples would be seen twice or never)")):
        changed = differing_fields(saved, cfg, lambda key, fields=fields: among(key, fields))
        if changed:
            raise ConfigError(f"--resume {run_dir}: {'; '.join(changed)} changes {what}; resume "
                              f"without that override, or start a new run with another --run.out_dir")


def _as_used(model):
    """``model`` with n_kv_head, head_size, ffn_hidden and qkv_bias as the network uses them: n_kv_head =
    n_head is multi-head attention as None is, head_size its number (None: n_embd / n_head),
    ffn_hidden = 4 n_embd the default width, and qkv_bias its value (None: bias's), so neither way of
    writing one differs from the other on resume (and a refusal names the q/k/v biases and the heads'
    size as they are)."""
    return dataclasses.replace(model, n_kv_head=None if model.kv_heads == model.n_head else model.n_kv_head,
                               head_size=model.head_dim,
                               ffn_hidden=None if model.ffn == 4 * model.n_embd else model.ffn_hidden,
                               qkv_bias=model.qkv_biased)


def resume_tokenizer(cfg: TrainConfig, run_dir: Path, overridden: bool, warn: Callable[[str], None]) -> TrainConfig:
    """The tokenizer a resumed run reads: ``data.tokenizer_file`` as saved, or the run's own copy
    (``RUN_DIR/tokenizer.json``, see rundir.keep_tokenizer) when the saved path no longer leads to a
    file from here -- a moved ``model.init_from`` directory, a relative path and another working
    directory. A file given or found there must hold the run's vocabulary (compared by content,
    not by path); ConfigError naming the field otherwise."""
    from largebatch.train.rundir import TOKENIZER_NAME

    kept = run_dir / TOKENIZER_NAME
    if not cfg.data.tokenizer_file or not kept.is_file():
        return cfg
    path = Path(cfg.data.tokenizer_file).expanduser()
    if path.is_dir():  # a save_pretrained directory: its tokenizer.json
        path = path / TOKENIZER_NAME
    if not path.is_file():
        if overridden:
            raise ConfigError(f"data.tokenizer_file={cfg.data.tokenizer_file!r} does not exist: give the "
                              f"tokenizer.json this run trained with, or leave it out to use {kept}")
        warn(f"note: data.tokenizer_file={cfg.data.tokenizer_file!r} is not found from here; the run "
             f"continues with its own copy, {kept}")
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer_file=str(kept)))
    if _vocabulary(path, "data.tokenizer_file") != _vocabulary(kept, str(kept)):
        raise ConfigError(f"data.tokenizer_file={cfg.data.tokenizer_file!r} is not the vocabulary this run "
                          f"trained with ({kept}); its checkpoints index that one: give {kept}, or "
                          "start a new run to change the tokenizer")
    return cfg


def _vocabulary(path: Path, name: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab()
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{name}={str(path)!r} is not a tokenizer.json ({reason}): give one saved by "
                          "HF tokenizers") from None


def check_device(cfg: TrainConfig, distributed: bool) -> None:
    if distributed:  # each rank takes its local GPU (largebatch.parallel.mesh), over this backend
        from largebatch.parallel.mesh import check_backend

        try:
            check_backend(cfg.parallel)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return
    from largebatch.train.loop import resolve_device

    try:
        resolve_device(cfg.run.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_time_limit(cfg: TrainConfig) -> None:
    """run.time_limit = "slurm" needs the Slurm job's end in the environment (SLURM_JOB_END_TIME),
    and one in the past leaves no step to take."""
    if cfg.run.time_limit != "slurm":
        return
    import time

    from largebatch.train.stopping import slurm_end_time

    try:
        end = slurm_end_time()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if end <= time.time():
        raise ConfigError(f"run.time_limit = 'slurm': the job's end (SLURM_JOB_END_TIME = {end:.0f}) has passed "
                          f"{time.time() - end:.0f} s ago: no step would fit; requeue the job, or give a duration")


def check_optimizer(cfg: TrainConfig) -> None:
    """An optimizer registered from outside the package builds, steps and saves on a small model
    (train.optimizer.probe_optimizer): a wrong builder was met only once the run had started, and a
    state that cannot be saved only at the first checkpoint."""
    from largebatch.train.optimizer import probe_optimizer

    problem = probe_optimizer(cfg.optim)
    if problem:
        raise ConfigError(f"optim.name = {cfg.optim.name!r}: {problem}")


def check_corpora(cfg: TrainConfig) -> None:
    """``data.corpus`` and ``data.val_corpus`` exist and are of kinds that are read; a JSON Lines
    corpus's first record has its text under ``data.text_field`` (one record read); each of
    ``data.val_documents`` names a document, where the names are known without reading
    (check_val_documents)."""
    from largebatch.data.corpus import CorpusError, check_corpus, check_val_documents

    try:
        if cfg.data.mixture:  # each corpus of the mixture, split on its own
            for spec in cfg.data.mixture:
                check_corpus(spec, "data.mixture", cfg.data.text_field,
                             split=cfg.data.document_separator is None)
            return
        check_corpus(cfg.data.corpus, "data.corpus", cfg.data.text_field,
                     split=cfg.data.val_corpus is None and cfg.data.document_separator is None)
        if cfg.data.val_corpus is not None:
            check_corpus(cfg.data.val_corpus, "data.val_corpus", cfg.data.text_field)
        else:
            check_val_documents(cfg.data.corpus, cfg.data.val_documents, cfg.data.document_separator)
    except CorpusError as exc:
        raise ConfigError(str(exc)) from None


def check_tokenizer_file(cfg: TrainConfig) -> int | None:
    """The vocabulary size of ``data.tokenizer_file`` (None without one): its largest id + 1 (see
    tokenizer.id_space); ConfigError if unreadable, or if a text corpus is to be encoded with it and it
    has no document separator, or if a BERT run's lacks what masking needs (check_masked_tokens)."""
    from largebatch.data.corpus import is_token_array_path
    from largebatch.data.tokenizer import (
        EOT,
        SPECIAL_TOKENS,
        document_separator,
        id_space,
        no_separator_message,
        special_token_ids,
    )

    if not cfg.data.tokenizer_file:
        check_masked_tokens(cfg)
        # the tokenizer the run trains puts <|endoftext|> first; token arrays alone have none
        check_separator(cfg, None if is_token_array_path(cfg.data.corpus) and not cfg.data.mixture
                        else (EOT, SPECIAL_TOKENS.index(EOT)))
        return None
    from largebatch.data.build import read_tokenizer_file

    try:
        tokenizer = read_tokenizer_file(cfg.data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not is_token_array_path(cfg.data.corpus) and document_separator(tokenizer) is None:  # text is encoded
        raise ConfigError(no_separator_message("data.tokenizer_file", cfg.data.tokenizer_file))
    check_masked_tokens(cfg, tokenizer)
    check_separator(cfg, document_separator(tokenizer), special_token_ids(tokenizer))
    return id_space(tokenizer)


def check_separator(cfg: TrainConfig, own: tuple[str, int] | None, special: dict[str, int] | None = None) -> None:
    """model.document_mask's separator can be known (loop.model_separator), is the tokenizer's
    (``own``) on text and one of its ``special`` ids for a masked model: ConfigError naming
    model.separator_id otherwise."""
    from largebatch.train.loop import model_separator

    try:
        model_separator(cfg, own, special)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_separator_id(cfg: TrainConfig, vocab_size: int | None) -> None:
    """A given model.separator_id names a row of the model's embedding (the vocabulary ``vocab_size``
    decides, see check_model_vocab): refused before any work, as the model's build would refuse it."""
    given = cfg.model.separator_id
    if cfg.model.document_mask and given is not None and given >= (size := check_model_vocab(cfg, vocab_size)):
        raise ConfigError(f"model.separator_id={given} is not a token of the model's vocabulary ({size} ids): give "
                          "the id the corpus puts before (or between) its documents")


def check_masked_tokens(cfg: TrainConfig, tokenizer=None) -> None:
    """A masked-LM model (BERT) needs [CLS], [SEP] and [MASK] (or RoBERTa's <s>, </s> and <mask>):
    the trained tokenizer has them; a ``data.tokenizer_file`` (``tokenizer``: it, already read)
    must, and a token array without one has none. ConfigError naming the field otherwise (refused
    here rather than after the corpus is tokenized)."""
    from largebatch.models import model_spec

    try:
        objective = model_spec(cfg.model.kind).objective
    except (KeyError, ValueError):  # an unknown kind is refused with its own message
        return
    if objective != "masked":
        return
    from largebatch.data.build import read_tokenizer_file
    from largebatch.data.corpus import CorpusError, is_token_array_path
    from largebatch.data.tokenizer import MASKED_LM_NEEDS, masked_lm_missing, masked_lm_tokens

    if not cfg.data.tokenizer_file:
        if is_token_array_path(cfg.data.corpus):
            raise ConfigError(f"model.kind={cfg.model.kind!r} on the token array data.corpus={cfg.data.corpus!r} "
                              f"needs the special tokens {MASKED_LM_NEEDS}: give data.tokenizer_file "
                              "with them (the one the array was tokenized with)")
        return
    try:
        have = masked_lm_tokens(tokenizer if tokenizer is not None else read_tokenizer_file(cfg.data))
    except CorpusError as exc:
        raise ConfigError(str(exc)) from None
    missing = masked_lm_missing(have)
    if missing:
        raise ConfigError(f"data.tokenizer_file={cfg.data.tokenizer_file!r} lacks {missing}, which "
                          f"model.kind={cfg.model.kind!r} (masked LM) needs: give a tokenizer that has "
                          f"{MASKED_LM_NEEDS}, or leave data.tokenizer_file out to train one")


def check_cache_dir(cfg: TrainConfig) -> None:
    """``data.cache_dir`` is not a file and, where it does not exist yet (so a text corpus's tokenizer
    and streams must be written there), can be made and written: refused before a tokenizer is
    trained. An existing directory may hold the entry already (a read-only shared cache): not probed."""
    from largebatch.data.corpus import is_token_array_path

    if is_token_array_path(cfg.data.corpus):  # token arrays are not cached
        return
    path = Path(cfg.data.cache_dir).expanduser()
    if path.is_dir():
        return
    try:
        check_output_dir(path, "data.cache_dir")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_bin_dtype(cfg: TrainConfig, vocab_size: int | None) -> None:
    """A raw ``.bin`` corpus read as uint16 with a vocabulary (``vocab_size``: the tokenizer file's,
    else data.vocab_size) of more than 65,536 ids is refused, naming data.bin_dtype."""
    from largebatch.data.build import check_bin_width
    from largebatch.data.corpus import CorpusError

    try:
        check_bin_width(cfg.data, vocab_size or cfg.data.vocab_size)
    except CorpusError as exc:
        raise ConfigError(str(exc)) from None


def check_model_vocab(cfg: TrainConfig, vocab_size: int | None) -> int:
    """The model's vocabulary (see loop.model_vocab) for the tokenizer's size (``vocab_size``; the
    trained tokenizer's ``data.vocab_size`` without a file); ConfigError when model.vocab_size
    cannot hold every id. (A token array's largest id is checked when the data is read. Tensor
    parallel takes any vocabulary: the embedding and the output layer are split unevenly over the
    ranks where tp does not divide it.)"""
    from largebatch.data.corpus import is_token_array_path
    from largebatch.train.loop import model_vocab

    try:
        return model_vocab(cfg, vocab_size or cfg.data.vocab_size)
    except ValueError as exc:
        if vocab_size is None and not is_token_array_path(cfg.data.corpus):  # a tokenizer the run trains
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than data.vocab_size={cfg.data.vocab_size}, "
                f"the size the run's tokenizer is trained to: lower data.vocab_size to {cfg.model.vocab_size} "
                f"(the tokenizer is then trained to that size), leave model.vocab_size out (the trainer takes "
                f"the tokenizer's size) or set it >= {cfg.data.vocab_size} to pad the embedding") from None
        raise ConfigError(str(exc)) from None


def estimate_state(cfg: TrainConfig, vocab_size: int | None = None) -> StateEstimate:
    """fp32 parameters + gradients + optimizer state (+ the weight average of run.ema_decay) of one
    process, from the config alone: its
    tensor-parallel share of its pipeline stages (the rank with the most layers, with the embedding
    or with the output layer, whichever holds more; under ZBV rank 0 holds both), divided over the
    FSDP shard group."""
    par = cfg.parallel
    layers = rank_layers(cfg.model.n_layer, par)
    model = cfg.model.replace(vocab_size=check_model_vocab(cfg, vocab_size),  # the trainer's vocabulary
                              n_layer=layers * par.pp)  # stage_parameters counts n_layer // pp
    n = stage_parameters(model, tp=par.tp, pp=par.pp)
    if par.pp > 1:  # the rank holding the last stage (the output layer): rank 0 itself under ZBV's V
        on_first = last_stage_rank(par.pp_schedule, par.pp) == 0
        n = max(stage_parameters(model, tp=par.tp, pp=par.pp, first=True, last=on_first),
                stage_parameters(model, tp=par.tp, pp=par.pp, first=on_first, last=True))
    if par.dp_mode != "ddp":
        try:
            from largebatch.parallel.mesh import replica_sizes, resolve_sizes

            n /= replica_sizes(par, resolve_sizes(par, int(os.environ.get("WORLD_SIZE", "1")))[1])[1]
        except ValueError:  # a layout that does not fit the launch: refused with its own message later
            pass
    per_parameter = 2 * FP32_BYTES + OPTIMIZERS[cfg.optim.name].state_bytes
    if cfg.run.ema_decay is not None:  # the weight average: one more copy (its evaluations' swap uses
        per_parameter += FP32_BYTES    # the gradients' space, freed by then)
    available, source = _available_bytes(cfg)
    step_copy = n * (FP32_BYTES + OPTIMIZERS[cfg.optim.name].state_bytes) if cfg.run.takes_steps_back else 0.0
    return StateEstimate(n, n * per_parameter, available, source, vocab_size, step_copy)


def estimate_activations(cfg: TrainConfig, vocab_size: int | None = None) -> tuple[float | None, str]:
    """The activation bytes one process holds at the peak of a step, the most over the run's phases
    (largebatch.memory.estimate's closed form: what the forward stores for backward plus what
    backward adds; under pipeline parallel the rank that needs the most), and a few words on what
    it assumed; (None, why) where the closed form does not describe the run."""
    from largebatch.memory.estimate import estimate, rank_policies
    from largebatch.parallel.mesh import resolve_sizes
    from largebatch.train.loop import _recompute_policy, resolve_device
    from largebatch.train.phases import resolve_phases

    par = cfg.parallel
    if par.pp_split:
        return None, "uneven pipeline stages (parallel.pp_split): `largebatch memory --config FILE` bounds them"
    try:
        pp, dp, _ = resolve_sizes(par, int(os.environ.get("WORLD_SIZE", "1")))
        model = cfg.model.replace(vocab_size=check_model_vocab(cfg, vocab_size))
        device = resolve_device(cfg.run.device).type
        # each pipeline rank its slice of a per-layer list (as the trainer applies it); the worst counts
        slices = rank_policies(_recompute_policy(cfg.run.recompute, model.n_layer), model.n_layer, pp)
        peak = 0.0
        for phase in resolve_phases(cfg.phases, cfg.schedule, model.seq_len, cfg.run.total_tokens,
                                    cfg.run.micro_batch, init_from=model.init_from,
                                    rotary=model.position == "rope"):
            m = max(1, phase.schedule.batch_size // (phase.micro_batch * dp))
            for policies in slices:
                e = estimate(model, phase.micro_batch, tp=par.tp, pp=pp, sequence_parallel=par.sequence_parallel,
                             recompute=policies, seq_len=phase.seq_len, device=device,
                             dtype_bytes=2 if cfg.run.half_precision else 4, pp_schedule=par.pp_schedule,
                             virtual_stages=par.pp_virtual_stages, micro_batches=m,
                             loss_parallel=par.loss_parallel)
                peak = max(peak, e.activations + e.backward)
    except (ValueError, ConfigError) as exc:  # a layout the closed form does not describe (said why)
        return None, str(exc).splitlines()[0]
    assumed = (f"{cfg.run.dtype} as 2-byte activations; torch.autocast keeps more (measured 1.24-1.55x in bf16 "
               "on CPU)" if cfg.run.half_precision else "fp32")
    return peak, assumed


def rank_layers(n_layer: int, par) -> int:
    """The most transformer layers one pipeline rank holds: its pp_virtual_stages stages, each of
    n_layer / (pp x V) layers, or the largest of the parallel.pp_split stages (an upper bound)."""
    stages = par.pp * par.pp_virtual_stages
    if par.pp_split:
        bounds = [0, *par.pp_split, n_layer]
        return min(n_layer, max(b - a for a, b in zip(bounds, bounds[1:])) * par.pp_virtual_stages)
    return max(1, n_layer // stages) * par.pp_virtual_stages


def _available_bytes(cfg: TrainConfig) -> tuple[float, str]:
    import torch

    from largebatch.train.loop import resolve_device

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if distributed and torch.cuda.is_available() else resolve_device(cfg.run.device))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {device}"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1
    free = _mem_available()
    return free / local_ranks, ("MemAvailable of this machine" +
                                (f" / {local_ranks} local ranks" if local_ranks > 1 else ""))


def _mem_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_memory(cfg: TrainConfig, vocab_size: int | None = None) -> StateEstimate:
    """Refuse a model whose state alone exceeds the memory free for it, naming the size fields."""
    est = estimate_state(cfg, vocab_size)
    if est.bytes + est.step_copy > est.available:
        m = cfg.model
        raise ConfigError(
            f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd} (vocabulary "
            f"{vocab_size or cfg.data.vocab_size}): {est.parameters:.3g} parameters per process need "
            f"{(est.bytes + est.step_copy) / GIB:,.1f} GiB for fp32 parameters, gradients and {cfg.optim.name} state"
            f"{' and the weight average (run.ema_decay)' if cfg.run.ema_decay is not None else ''}"
            f"{' and the copy a step that may be taken back keeps' if est.step_copy else ''}, "
            f"more than the {est.available / GIB:,.1f} GiB available ({est.source}); lower "
            f"model.n_layer or model.n_embd, or split the model (parallel.tp, parallel.pp, or "
            f"parallel.dp_mode = 'fsdp')")
    return est


def check_wandb(cfg: TrainConfig) -> None:
    """``run.wandb``, on rank 0 (the rank that logs): the package imports, and W&B has an API key, or
    ``WANDB_MODE`` is offline or disabled. Asked of ``wandb.login`` (without verifying the key over the
    network): on a terminal with no key, it asks for one now, as ``wandb.init`` would have after the
    data and model were built; elsewhere it refuses."""
    if not cfg.run.wandb or int(os.environ.get("RANK", "0") or 0) != 0:
        return
    try:
        import wandb
    except ImportError:
        raise ConfigError("run.wandb = true needs the package wandb: pip install wandb (or the largebatch[wandb] "
                          "extra), or set run.wandb = false") from None
    from largebatch.train.metrics import wandb_disabled

    if wandb_disabled() or os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun"):
        return
    if os.environ.get("WANDB_API_KEY"):
        return
    try:
        reason = None if wandb.login(verify=False) else "wandb.login() found none"
    except Exception as exc:  # noqa: BLE001 -- wandb.errors.UsageError: no key, and no terminal to ask on
        reason = str(exc).strip() or type(exc).__name__
    if reason is not None:
        raise ConfigError(f"run.wandb = true, but W&B has no API key ({reason}): run `wandb login` or set "
                          "WANDB_API_KEY; or set WANDB_MODE=offline to write the run to RUN_DIR/wandb and upload "
                          "it later with `wandb sync`")


def preflight(cfg: TrainConfig, distributed: bool, fresh: bool = True) -> StateEstimate:
    """Every check that needs no data and no model (the run directory is checked by the caller
    before it creates the directory). ``fresh``: not a ``--resume``, so ``model.init_from``'s
    weights are read and mapped now (a resume loads its checkpoint instead)."""
    from largebatch.data.corpus import is_token_array_path

    check_device(cfg, distributed)
    check_time_limit(cfg)
    check_optimizer(cfg)
    check_wandb(cfg)
    check_corpora(cfg)
    vocab = check_tokenizer_file(cfg)
    check_bin_dtype(cfg, vocab)
    if vocab is None and not fresh and not is_token_array_path(cfg.data.corpus):
        # a resumed run's trained tokenizer: the run fixed its size (config.toml's model.vocab_size, its
        # checkpoints' rows), fewer than data.vocab_size ids on a corpus too small to fill it; the
        # Trainer compares it with the tokenizer it builds again (rundir.keep_tokenizer)
        vocab = cfg.model.vocab_size
    check_cache_dir(cfg)
    check_separator_id(cfg, vocab)
    if fresh and cfg.model.init_from:
        from largebatch.train.hf_import import check_init

        check_init(cfg.model)
    return check_memory(cfg, vocab)
