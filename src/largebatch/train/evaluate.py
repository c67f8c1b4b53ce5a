"""Evaluation: the validation loss and accuracy of the trainer's model, split over data-parallel ranks.

The validation slice is fixed (``run.eval_tokens`` tokens: the first samples, packed at the current
phase's length, of the validation split in a fixed shuffled order), so every evaluation of a run,
and of a resumed run, sees the same tokens. Accuracy is the share of predicted tokens whose most
likely token is the target (BERT: the masked-LM accuracy over the masked positions); it is None
under pipeline parallel (the logits are on the last stage only). Under the vocabulary-parallel
loss the best token is found without gathering the logits
(largebatch.parallel.tensor_parallel.vocab_parallel_argmax). A mixture of corpora (data.mixture)
is evaluated on its slice's samples grouped by corpus: the loss over them all, and each corpus's
own (``val_loss/<corpus>`` in the evaluation's record), with its bits per byte where the tokenizer
gives them (``val_bpb/<corpus>``: unlike the losses in nats a token, comparable across corpora whose
text the tokenizer cuts into longer or shorter tokens).
"""

from __future__ import annotations

import math
import signal
import time

import numpy as np
import torch

from largebatch.data import IGNORE_INDEX, MixtureDataset
from largebatch.models.registry import model_spec
from largebatch.parallel.batch import global_sum
from largebatch.train.deferred import target_count
from largebatch.train.progress import human_count


def target_reached(target: float, where: dict) -> str:
    """"target val loss T reached at step N, ..." for run.target_val_loss's record ``where``
    (``pos.target``, the summary's ``target``): the log line's and the summary line's words."""
    return (f"target val loss {target} reached at step {where['step']}, {human_count(where['tokens'])} tokens, "
            f"after {where['train_seconds']:.1f} s of steps ({where['wall_seconds']:.1f} s in all)")


class EvalInterrupted(Exception):
    """A stop signal reached every rank during an evaluation: it was abandoned (nothing logged, the
    training state untouched), so the run can checkpoint within the cluster's grace period; the
    evaluation runs again when the run continues."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Evaluation:
    """The Trainer's evaluation (a mixin of ``largebatch.train.loop.Trainer``): it uses the
    trainer's ``model``, ``data``, ``phase``, ``par``, ``pos``, ``metrics`` and its ``_forward``,
    the same forward a training step runs."""

    def _eval_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Summed loss and the number of predicted tokens whose most likely token is the target (None
        under pipeline stages, where the logits are on the last stage only)."""
        logits, loss_sum, targets = self._forward(batch)
        if logits is None:
            return loss_sum, None
        if self.par.loss_parallel:  # split over the vocabulary: the best token without gathering them
            from largebatch.parallel.tensor_parallel import vocab_parallel_argmax

            best = vocab_parallel_argmax(logits)
        else:
            best = logits.argmax(-1)
        predicted = targets != -100
        if model_spec(self.cfg.model.kind).objective == "masked":  # the logits of the predicted positions only
            return loss_sum, (best == targets[predicted]).sum()
        return loss_sum, ((best == targets) & predicted).sum()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/token) over a fixed slice of the validation split; the share of
        predicted tokens ranked first (BERT: masked-LM accuracy) goes to ``self.val_accuracy``.
        Data-parallel rank r evaluates micro-batches r, r + dp, ...; the sums are all-reduced.
        While the training loop runs (``self.stop_request``, not yet at its end), a stop signal is
        polled before every forward after the first (the same answer on every rank) and raises
        ``EvalInterrupted``."""
        stop = getattr(self, "stop_request", None)
        stop = stop if stop is not None and not stop.is_ending else None
        self.model.eval()
        chunks, sources = self._eval_chunks()
        par = self.par
        corpora = len(self.data.val.names) if isinstance(self.data.val, MixtureDataset) else 1
        totals = torch.zeros(corpora, dtype=torch.float64, device=self.device)  # (D,) per corpus
        counts, corrects, accuracy = torch.zeros_like(totals), torch.zeros_like(totals), True
        for first in range(0, len(chunks), par.dp_size):
            if stop is not None and first:
                signum, _ = stop.poll()
                if signum is not None:
                    self.model.train()
                    self._reshard()
                    raise EvalInterrupted(signum)
            # every rank runs as many forwards (FSDP's and tensor parallel's are collective): one
            # past the end repeats the last micro-batch and is not counted
            mine = first + par.dp_rank
            batch = self.data.val.get_batch(chunks[min(mine, len(chunks) - 1)])
            loss, right = self._eval_batch(batch)
            if mine < len(chunks):
                d = sources[mine]
                totals[d] += loss.double()
                counts[d] += target_count(batch)
                if right is None:
                    accuracy = False
                else:
                    corrects[d] += (right.full_tensor() if hasattr(right, "full_tensor") else right).double()
        self.model.train()
        self._reshard()
        totals, counts, corrects = (global_sum(t, par) for t in (totals, counts, corrects))
        count = counts.sum()
        self.val_accuracy = float(corrects.sum() / count) if accuracy else None
        self.val_by_corpus = None  # a mixture's: each corpus's share of the slice on its own
        if corpora > 1:
            losses = (totals / counts.clamp(min=1)).tolist()
            self.val_by_corpus = {label: loss for label, loss, n in
                                  zip(self.data.val.labels, losses, counts.tolist()) if n > 0}
        return float(totals.sum() / count)

    def _eval_chunks(self) -> tuple[list, list[int]]:
        """The evaluation's micro-batches of validation indices, and the corpus of each (0 for one
        corpus): the slice's first samples in order; a mixture's grouped by corpus, each corpus's in
        order (so each corpus's loss is its own forwards' sum)."""
        mb, n = self._eval_slice()
        val = self.data.val
        if not isinstance(val, MixtureDataset):
            return [range(start, min(n, start + mb)) for start in range(0, n, mb)], [0] * len(range(0, n, mb))
        which = val.sources_of(range(n))
        chunks, sources = [], []
        for d in range(len(val.names)):
            mine = np.flatnonzero(which == d)
            for start in range(0, len(mine), mb):
                chunks.append(mine[start:start + mb])
                sources.append(d)
        return chunks, sources

    def _eval_slice(self) -> tuple[int, int]:
        """(micro-batch, samples) of an evaluation: the first run.eval_tokens of the validation split
        at the current phase's length, in forwards of run.eval_micro_batch (else the phase's)."""
        n = max(1, min(len(self.data.val), self.cfg.run.eval_tokens // self.phase.seq_len))
        return self.cfg.run.eval_micro_batch or self.phase.micro_batch, n

    def evaluated_targets(self, by_source: bool = False) -> np.ndarray | list[np.ndarray]:
        """The targets an evaluation predicts (the same fixed slice, at the current phase's length;
        BERT: the masked positions), for a unigram baseline over the very tokens the validation loss
        is measured on (the whole split's differs when ``run.eval_tokens`` is small). ``by_source``:
        a list, each corpus's (a mixture's, in data.val.names' order, empty for a corpus without a share
        of the slice; one for one corpus)."""
        chunks, sources = self._eval_chunks()
        corpora = len(self.data.val.names) if isinstance(self.data.val, MixtureDataset) else 1
        parts: list[list[np.ndarray]] = [[] for _ in range(corpora)]
        for chunk, source in zip(chunks, sources):
            batch = self.data.val.get_batch(chunk)
            labels = (batch["targets"] if "targets" in batch else batch["labels"]).numpy()
            parts[source].append(labels[labels != IGNORE_INDEX])
        joined = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]
        return joined if by_source else np.concatenate(joined)

    def tokens_per_byte(self, corpus: str | None = None) -> float | None:
        """Targets per UTF-8 byte of the text they stand for, over the evaluation's slice at the current
        phase's length (data.tokenizer.token_bytes; the separators are no text): val_loss times it,
        over ln 2, is the bits per byte. ``corpus``: a mixture corpus's label, over its share of the
        slice. None for a masked LM, a tokenizer whose tokens are not the text's own bytes
        (token_bytes: not byte-level, or normalising), a token-array corpus without a tokenizer, or a
        corpus without a share."""
        from largebatch.data.tokenizer import token_bytes

        cached = getattr(self, "_tokens_per_byte", None)
        if cached is None or cached[0] != self.phase.seq_len:
            ratios: dict[str | None, float | None] = {None: None}
            tokenizer = self.data.tokenizer
            if model_spec(self.cfg.model.kind).objective == "causal" and tokenizer is not None:
                table = token_bytes(tokenizer)
                if table is not None:
                    parts = self.evaluated_targets(by_source=True)
                    labels = self.data.val.labels if isinstance(self.data.val, MixtureDataset) else [None]
                    counted = [(len(t), int(table[t].sum()) if (t < len(table)).all() else None) for t in parts]
                    whole = (sum(n for n, _ in counted), sum(size or 0 for _, size in counted))
                    complete = all(size is not None for _, size in counted)
                    ratios[None] = whole[0] / whole[1] if complete and whole[1] else None
                    if isinstance(self.data.val, MixtureDataset):
                        ratios.update({label: n / size if size else None
                                       for label, (n, size) in zip(labels, counted)})
            cached = self._tokens_per_byte = (self.phase.seq_len, ratios)
        return cached[1].get(corpus)

    def bits_per_byte(self, val_loss: float | None, corpus: str | None = None) -> float | None:
        """``val_loss`` (nats a token, on the evaluation's slice, or ``corpus``'s share of it) in bits
        per byte of its text, or None (see tokens_per_byte)."""
        ratio = self.tokens_per_byte(corpus)
        return None if ratio is None or val_loss is None else val_loss * ratio / math.log(2)

    def _reshard(self) -> None:
        """Free what an evaluation left gathered under FSDP2: the root keeps its parameters unsharded
        after a forward (it expects the backward to follow), so after the evaluations' forwards it
        would hold the whole parameters until the next step, and after the last one for good (a run's
        parameters are then plain tensors, not the DTensor shards the checkpoints hold). Under
        pipeline parallel the roots are the stage modules, which the model does not hold."""
        from torch.distributed.fsdp import FSDPModule

        pipeline = getattr(self, "pipeline", None)
        roots = [self.model, *(stage.submod for stage in pipeline.stages)] if pipeline else [self.model]
        for root in roots:
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _log_eval(self) -> float:
        """Evaluate after reading what the steps left on the device; log and return the loss."""
        self.settle()
        began = time.perf_counter()
        try:
            val_loss = self.evaluate()
            by_corpus = self.val_by_corpus or {}
            average = self._evaluate_average()
        except EvalInterrupted as exc:
            self.log(f"  eval  step {self.pos.step:>5}  interrupted ({signal.Signals(exc.signum).name}): "
                     "it runs again when the run continues")
            raise
        took = time.perf_counter() - began  # run.time_limit: what an evaluation takes (kept across launches)
        self.pos.eval_seconds = max(self.pos.eval_seconds, took)
        if getattr(self, "time_limit", None) is not None:
            self.time_limit.evaluated(took)
        self.last_eval = (self.pos.step, val_loss)
        bpb = self.bits_per_byte(val_loss)
        reached = self._reach_target(val_loss)
        if self.metrics is not None:
            self.metrics.log({"kind": "val", "phase": self.phase.index, "seq_len": self.phase.seq_len,
                              "step": self.pos.step, "tokens": self.pos.tokens,
                              "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50)),
                              "val_accuracy": self.val_accuracy,
                              **({} if bpb is None else {"val_bpb": bpb}),
                              **{f"val_loss/{label}": loss for label, loss in by_corpus.items()},
                              **{f"val_bpb/{label}": bits for label, loss in by_corpus.items()
                                 if (bits := self.bits_per_byte(loss, label)) is not None},
                              **({} if average is None else {"val_loss_ema": average[0],
                                                             "val_accuracy_ema": average[1]}),
                              **({} if average is None or bpb is None else
                                 {"val_bpb_ema": self.bits_per_byte(average[0])}),
                              **({"target_reached": True} if self._target_again(val_loss) else {}),
                              "wall_time": time.time()})
        accuracy = "" if self.val_accuracy is None else f"  accuracy {self.val_accuracy:.4f}"
        corpora = ("  (" + ", ".join(f"{label} {loss:.4f}" for label, loss in by_corpus.items()) + ")"
                   if by_corpus else "")
        ema = "" if average is None else f"  ema {average[0]:.4f}"
        bits = "" if bpb is None else f"  bpb {bpb:.4f}"
        self.log(f"  eval  step {self.pos.step:>5}  tokens {human_count(self.pos.tokens):>7}  "
                 f"val loss {val_loss:.4f}  ppl {math.exp(min(val_loss, 50)):.1f}{bits}{accuracy}{corpora}{ema}")
        if reached:
            self.log(f"  {target_reached(self.cfg.run.target_val_loss, self.pos.target)}"
                     + ("; the run ends here (run.stop_at_target)" if self.cfg.run.stop_at_target else ""))
        return val_loss

    def _target_again(self, val_loss: float) -> bool:
        """This evaluation is the one that reached the target (or it again: a relaunch at the end)."""
        target = self.pos.target or {}
        return target.get("step") == self.pos.step and target.get("val_loss") == val_loss

    def _reach_target(self, val_loss: float) -> bool:
        """The first evaluation at or below run.target_val_loss: where the run was, kept in the
        progress (``pos.target``: step, tokens, optimizer-step and wall-clock seconds, the loss).
        True for that evaluation only."""
        target = self.cfg.run.target_val_loss
        if target is None or self.pos.target is not None or not val_loss <= target:
            return False
        pos = self.pos
        self.pos.target = {"target_val_loss": target, "val_loss": val_loss, "step": pos.step, "tokens": pos.tokens,
                           "train_seconds": pos.train_seconds, "wall_seconds": self.wall_seconds()}
        return True

    def _evaluate_average(self) -> tuple[float, float | None] | None:
        """(validation loss, accuracy) of the weight average (run.ema_decay) on the same slice, the
        evaluation's other results (accuracy, per-corpus losses) kept as the weights gave them; None
        without an average. Kept as ``self.val_ema`` for the summary. A stop signal during it abandons
        the evaluation as during the weights' (``EvalInterrupted``), the weights back in place."""
        ema = getattr(self, "ema", None)
        if ema is None:
            return None
        kept = self.val_accuracy, self.val_by_corpus
        try:
            with ema.applied():
                loss = self.evaluate()
            self.val_ema = (loss, self.val_accuracy)
        finally:
            self.val_accuracy, self.val_by_corpus = kept
        return self.val_ema
