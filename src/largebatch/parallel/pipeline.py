"""Pipeline parallelism with torch.distributed.pipelining: the model's layers cut into stages.

The L blocks are cut into p x V contiguous stages (evenly, or where ``parallel.pp_split`` says);
the first stage also runs the modules the model kind declares before its blocks (``pipeline_first``
of largebatch.models.registry: the embeddings), the last those after them (``pipeline_last``: final
norm, output layer) and the
loss (with tp > 1 optionally the vocabulary-parallel one: the schedule's step then runs inside
``ParallelState.loss_context()``). Rank r of the "pp" dimension holds stage r (V = 1) or stages
r, r + p, ... (interleaved, Narayanan et al. 2021 §2.2), or r and 2p - 1 - r (the V shape of zero
bubble, Qi et al. 2024 §6). The schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble,
ZBV) is torch's; this module only builds the stages and feeds them.
Korthikanti et al. 2022 §4.2.3 gives the first stage's activation memory per schedule
(largebatch.memory.estimate).

A step's micro-batches are the pipeline's micro-batches: the batch schedule decides how many (a
Seesaw batch change changes the count; one torch schedule is built per count and kept). A budget's
trimmed last step that fills neither its micro-batches nor the count a schedule takes is padded
with rows whose targets are all ignored (``padded_micro_batches``), so a pipeline run ends on its
token budget as one process does. The loss
is the trainer's: each micro-batch's summed token loss times ``dp / n_targets`` of the step, so
the accumulated gradient is the one-process gradient of the step's mean loss.

Data parallel over pipeline stages: FSDP2 per stage (dp_mode = 'fsdp', HSDP included), or replicas
(dp_mode = 'ddp'): DDP's reducer does not take a stage's many backwards, so ``ReplicaGradients``
does what DDP computes -- the mean of the replicas' accumulated gradients -- as explicit flat
all-reduces over the "dp" group after the schedule's step, in buckets of DDP's default size.

Gradient noise scale (McCandlish et al. 2018, App. A; docs/papers.md: schedules "Critical batch
size"): a stage holds part of the parameters, so both squared norms are sums over the stages. With
replicas, |G_small|^2 is each replica's gradient before the all-reduce (read from the very buckets
it reduces, as DDP's hook does); with one replica, ``FirstMicroBatchNorm`` reads each stage's
gradients when the stage completes micro-batch 0's weight gradients (its full backward, or under
zero bubble its separate weight-gradient half), summed over tensor-parallel shards too.

Each rank keeps ONE copy of the model with the modules of other ranks' stages set to None: its
parameter names are the one-process names, so the optimizer's parameter groups and distributed
checkpoints (DCP, by name) are those of one process, and a checkpoint moves between pp sizes.
Tied embeddings are refused (the embedding and the output layer sit on different ranks), as
torchtitan refuses them.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from largebatch.memory import apply_recompute
from largebatch.models.gpt import token_loss
from largebatch.models.registry import model_spec
from largebatch.optim.core import local_shard
from largebatch.parallel.config import MULTI_STAGE, PP_SCHEDULES
from largebatch.parallel.materialize import InitLog, materialize
from largebatch.parallel.mesh import ParallelState
from largebatch.parallel.norms import contributes
from largebatch.parallel.parallelize import apply_fsdp
from largebatch.parallel.tensor_parallel import apply_tensor_parallel


def stage_layers(n_layer: int, pp: int, virtual: int = 1, split: list[int] | None = None) -> list[range]:
    """The layers of each of the pp x V stages: evenly, or starting where ``split`` says."""
    n_stages = pp * virtual
    if n_stages > n_layer:  # no split helps: every stage holds at least one layer
        stages = f"parallel.pp = {pp} x pp_virtual_stages = {virtual} = {n_stages}" if virtual > 1 else \
            f"parallel.pp = {pp}"
        raise ValueError(f"{stages} stages for model.n_layer = {n_layer}: every stage needs at least one layer "
                         f"(no pp_split helps); lower pp{' or pp_virtual_stages' if virtual > 1 else ''} to at "
                         f"most {n_layer} stage(s) in all")
    if split is None:
        if n_layer % pp:
            raise ValueError(f"parallel.pp = {pp} does not divide model.n_layer = {n_layer}: choose pp among "
                             f"the divisors of {n_layer}, or give parallel.pp_split")
        if n_layer // pp % virtual:
            raise ValueError(f"parallel.pp_virtual_stages = {virtual} does not divide the {n_layer // pp} layers "
                             f"per rank: choose a divisor of {n_layer // pp}, or give parallel.pp_split")
        split = list(range(n_layer // n_stages, n_layer, n_layer // n_stages))
    if len(split) != n_stages - 1 or split[-1:] and split[-1] >= n_layer:
        raise ValueError(f"parallel.pp_split = {split}: needs {n_stages - 1} indices below model.n_layer = "
                         f"{n_layer} (one per stage after the first)")
    bounds = [0, *split, n_layer]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str = "1f1b") -> list[int]:
    """Stage indices rank ``pp_rank`` holds: r, r + p, ..., r + (V - 1) p (a loop), or under 'zbv'
    r and 2p - 1 - r (a V: the first and the last stage on rank 0, as torch's ZBV schedule sends)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def check_micro_batches(schedule: str, pp: int, counts: set[int]) -> None:
    """ValueError if a step's micro-batch count does not fill the schedule's pipeline (before any
    work). A count that is not a whole number of the multi-stage schedules' rounds is run padded
    (``padded_micro_batches``; ``padding_note`` says so): a Seesaw milestone's batch of 9
    micro-batches under interleaved 1F1B on pp = 2 was refused, though the step runs as 10."""
    for n in sorted(counts):
        if schedule != "gpipe" and n < pp:
            raise ValueError(f"parallel.pp_schedule = {schedule!r} with pp = {pp} needs at least {pp} "
                             f"micro-batches per step, but a step has {n}: lower run.micro_batch, raise "
                             f"schedule.batch_size, or use pp_schedule = 'gpipe'")


def padding_note(schedule: str, pp: int, counts: set[int]) -> str | None:
    """What the pipeline pads, for steps of ``counts`` micro-batches: the multi-stage schedules take a
    whole number of rounds (``schedule_micro_batches``), the rest is padding of no loss; None when
    every count runs as it is."""
    padded = {n: schedule_micro_batches(schedule, pp, n) for n in sorted(counts)}
    padded = {n: m for n, m in padded.items() if m != n}
    if not padded:
        return None
    runs = ", ".join(f"{n} as {m}" for n, m in padded.items())
    worst = max((m - n) / m for n, m in padded.items())
    return (f"steps of {runs} micro-batches ({schedule} takes whole rounds of its stages): the extra "
            f"micro-batches are padding of no loss, up to {100 * worst:.0f}% of such a step's compute; "
            f"batch sizes of a multiple of pp x run.micro_batch x dp sequences need none")


def schedule_micro_batches(schedule: str, pp: int, n: int) -> int:
    """The fewest micro-batches >= ``n`` that the schedule takes (what ``check_micro_batches``
    accepts): n under GPipe; at least pp under the others; a whole number of rounds under the
    multi-stage ones."""
    m = max(1, n)
    while True:
        if schedule == "gpipe" or m >= pp:
            rounds = max(1, m // pp)
            if schedule not in MULTI_STAGE or m % rounds == 0:
                return m
        m += 1


def padded_micro_batches(micro_batches: list[dict[str, torch.Tensor]], micro_batch: int, schedule: str,
                         pp: int) -> list[dict[str, torch.Tensor]]:
    """A step's micro-batches as the pipeline schedule needs them: every one ``micro_batch``
    sequences, and as many as the schedule takes (a budget's trimmed last step may have fewer).
    Padding rows repeat real inputs with every target -100: no loss, no gradient, and not counted
    in the step's targets, so the step is the one of its real sequences (the budget is not
    overshot; only the padding's compute is spent)."""
    key = "targets" if "targets" in micro_batches[0] else "labels"

    def padding(rows: int) -> dict[str, torch.Tensor]:
        source = micro_batches[0]
        index = torch.arange(rows) % source[key].shape[0]
        batch = {name: value[index] for name, value in source.items()}
        batch[key] = torch.full_like(batch[key], -100)
        return batch

    out = list(micro_batches)
    short = micro_batch - out[-1][key].shape[0]
    if short > 0:
        last, fill = out[-1], padding(short)
        out[-1] = {name: torch.cat([value, fill[name]]) for name, value in last.items()}
    wanted = schedule_micro_batches(schedule, pp, len(out))
    return out + [padding(micro_batch) for _ in range(wanted - len(out))]


class StageModule(nn.Module):
    """One stage: its blocks, plus the first or last modules of the model when it is first or last.

    The submodules are the model's own objects (shared, not copied), so the model and its
    optimizer see the weights the stage trains.
    """

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        spec = model_spec(model.config.kind)
        self.parts = nn.ModuleDict({name.replace(".", "_"): model.get_submodule(name) for name in
                                    (spec.pipeline_first if first else ()) + (spec.pipeline_last if last else ())})
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)  # the name apply_fsdp shards by
        self.layers = tuple(layers)  # (their indices in the model: their windows)
        self._model = [model]  # a list: not registered, its methods run the first and last parts

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``: the micro-batch's token ids (B, T), given to every stage under
        model.document_mask or a sliding window, whose layers read an AttentionMask (the stage builds it)."""
        model = self._model[0]
        if self.first:
            x = model.embed_input(x)  # (B, T) ids -> (B, T, C)
        mask = None if tokens is None else model.attention_mask(tokens, self.layers)
        if mask is not None:  # (only the forms this stage's layers read: their windows)
            mask.prepare(model.config.attention, x)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return model.output_logits(x) if self.last else x  # (B, T, v) or (B, T, C)


def keep_only(model: nn.Module, layers: set[int], first: bool, last: bool) -> nn.Module:
    """Set the modules this rank does not hold to None (names of the rest unchanged); in place."""
    for i in range(len(model.blocks)):
        if i not in layers:
            model.blocks[i] = None
    spec = model_spec(model.config.kind)
    for names, kept in ((spec.pipeline_first, first), (spec.pipeline_last, last)):
        if not kept:
            for name in names:
                setattr(model, name, None)
    return model


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class ReplicaGradients:
    """Data-parallel replicas of this rank's stages: what DDP computes, after the schedule's step.

    ``average()`` replaces every accumulated gradient by its mean over the "dp" group: the
    gradients are packed into flat buckets of BUCKET_BYTES (one all-reduce each, in parameter order,
    the same on every replica) and unpacked in place. It returns this replica's squared gradient
    norm before the reduction (fp64, on the device), summed from the buckets it packs.
    """

    def __init__(self, params: list[torch.Tensor], state: ParallelState):
        self.params, self.state = params, state

    @torch.no_grad()
    def average(self) -> torch.Tensor:
        local = torch.zeros((), dtype=torch.float64, device=self.state.device)
        grads = [p.grad for p in self.params if p.grad is not None]
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = _flatten_dense_tensors(bucket)  # (n,)
            local += torch.linalg.vector_norm(flat, dtype=torch.float64).square()
            flat.div_(self.state.dp_size)
            dist.all_reduce(flat, group=self.state.dp_group)
            torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))
        return local


def _buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` of at most ``cap`` bytes (a larger tensor alone)."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return [g for g in groups if g]


class FirstMicroBatchNorm:
    """Squared norm of this rank's gradients of the step's first micro-batch (one replica).

    A stage's weight gradients of micro-batch 0 are complete after its full backward of chunk 0
    (GPipe, 1F1B, interleaved 1F1B) or, under zero bubble, after the weight-gradient half of chunk 0
    (``backward_weight_one_chunk``; the input half runs earlier and writes no weight gradient). The
    step's gradients start at None and every stage completes chunk 0 before any other chunk, so the
    stage's gradients then are micro-batch 0's alone (``record`` refuses any other order). Called
    between schedule actions, not from an autograd hook: a tensor-parallel gradient that is a pending
    partial sum (a replicated weight under SP) is summed over "tp" by a collective that every tp rank
    of the stage enters at the same action. ``take`` returns the job-wide sum (one all-reduce: stages
    are disjoint; along "tp" each element counts once, ``contributes``).
    """

    def __init__(self, state: ParallelState):
        self.state = state
        self.squared = torch.zeros((), dtype=torch.float64, device=state.device)
        self.completed: set[int] = set()  # stages that completed a chunk's weight gradients this step

    @torch.no_grad()
    def record(self, stage, chunk: int) -> None:
        """Stage ``stage`` completed the weight gradients of micro-batch ``chunk``."""
        if chunk == 0:
            if stage.stage_index in self.completed:
                raise RuntimeError(f"pipeline stage {stage.stage_index} completed another micro-batch's weight "
                                   "gradients before micro-batch 0's: no first-micro-batch gradient norm")
            for p in stage.submod.parameters():
                grad = p.grad
                if grad is None:
                    continue
                if isinstance(grad, DTensor) and grad.placements != p.placements:  # a pending partial sum
                    grad = grad.redistribute(p.device_mesh, p.placements)  # every tp rank enters it
                if contributes(p, self.state):
                    self.squared += torch.linalg.vector_norm(local_shard(grad), dtype=torch.float64).square()
        self.completed.add(stage.stage_index)

    def reset(self) -> None:
        self.squared, self.completed = torch.zeros_like(self.squared), set()

    def take(self) -> torch.Tensor:
        value = self.squared.clone()
        dist.all_reduce(value)
        return value


@functools.cache
def recording_stage() -> type:
    """The ``PipelineStage`` subclass that tells ``first_norm`` when it completes a micro-batch's
    weight gradients. Built on first use: torch.distributed.pipelining imports torch._dynamo
    (about a second of start-up that a run without pipeline parallelism does not need)."""
    from torch.distributed.pipelining import PipelineStage

    class RecordingStage(PipelineStage):
        first_norm: FirstMicroBatchNorm | None = None

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if full_backward and self.has_backward and self.first_norm is not None:  # (evaluation: no backward)
                self.first_norm.record(self, bwd_chunk_id)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.has_backward and self.first_norm is not None:
                self.first_norm.record(self, bwd_chunk_id)

    return RecordingStage


class Pipeline:
    """This rank's stages and the torch schedules that run them (one per micro-batch count)."""

    def __init__(self, model: nn.Module, stages: list, state: ParallelState, schedule: str):
        self.model, self.stages, self.state, self.schedule = model, stages, state, schedule
        self.scale = 1.0  # the step's loss scale, read by the loss function
        self._cache: dict[tuple[str, int], object] = {}
        self._last = None  # the schedule that last prepared the stages' buffers
        params = [p for p in model.parameters() if p.requires_grad]
        replicas = state.dp_size > 1 and state.dp_mode == "ddp"
        self.replicas = ReplicaGradients(params, state) if replicas else None
        # one replica: the first micro-batch's gradient, read by the stages (FSDP2 replicas: none)
        self.first_norm = FirstMicroBatchNorm(state) if state.dp_size == 1 else None
        for stage in stages:
            stage.first_norm = self.first_norm
        self.local_squared: torch.Tensor | None = None  # this replica's, of the last step (ddp)

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def _use_group(self, group) -> None:
        """The stages send and receive on ``group`` (the same ranks as the "pp" group, in the same
        order: a step's copy made with parallel.step_timeout_s), or on the "pp" group itself (None)."""
        for stage in self.stages:
            stage.group = group if group is not None else self.state.pp_group

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, targets, "sum") * self.scale

    def _schedule(self, name: str, n_microbatches: int, shape: tuple[int, ...]):
        key = (name, n_microbatches)
        if key not in self._cache and name == "forward-v":
            self._cache[key] = self._forward_only_v()
        if key not in self._cache:
            from torch.distributed.pipelining.schedules import get_schedule_class

            cls = get_schedule_class(PP_SCHEDULES.get(name, name))
            multi = name in MULTI_STAGE or name == "LoopedBFS"
            self._cache[key] = cls(self.stages if multi else self.stages[0], n_microbatches=n_microbatches,
                                   loss_fn=self._loss, scale_grads=False)
        schedule = self._cache[key]
        if self._last is not None and self._last != (schedule, shape):
            # the stages are shared: another schedule (or a batch of another shape, the last
            # evaluation batch) sized their per-micro-batch buffers since this one last ran, so it
            # prepares them again (torch keeps that flag privately)
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                         "_stages_forward_initialized", "_stages_backward_initialized"):
                if hasattr(schedule, flag):
                    setattr(schedule, flag, False)
        self._last = (schedule, shape)
        return schedule

    def _forward_only_v(self):
        """A one-micro-batch forward through the V-placed stages, for evaluation: torch's ZBV schedule
        cannot run forward only (its eval still runs the input-gradient actions), and LoopedBFS
        assumes the loop placement. Each rank runs its stages in index order; torch adds the sends
        and receives (a private runtime: the one torch's own schedules lower to)."""
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.schedules import (
            _Action,
            _add_send_recv,
            _ComputationType,
            _PipelineScheduleRuntime,
        )

        pp, n_stages = self.state.pp_size, 2 * self.state.pp_size
        owner = {s: r for r in range(pp) for s in rank_stages(r, pp, 2, "zbv")}
        runtime = _PipelineScheduleRuntime(self.stages, n_microbatches=1, loss_fn=self._loss, scale_grads=False)
        runtime.stage_index_to_group_rank = owner
        for stage in self.stages:  # after the constructor: it sets the loop placement on the stages
            stage.stage_index_to_group_rank = owner
        forwards = {r: [_Action(s, _ComputationType.FORWARD, 0) for s in sorted(rank_stages(r, pp, 2, "zbv"))]
                    for r in range(pp)}
        order = _add_send_recv(forwards, stage_to_rank=owner.__getitem__, num_stages=n_stages)
        if hasattr(schedules, "_add_wait_send"):  # newer torch (2.15): every send waited by an action of
            order = schedules._add_wait_send(order)  # its own, which the runtime checks at the end
        runtime.pipeline_order_with_comms = order
        return runtime

    def _run(self, schedule, inputs: torch.Tensor, targets: torch.Tensor, forward_only: bool) -> torch.Tensor:
        """Feed the stages; returns the summed (unscaled) loss, the same on every pp rank: (,) fp64."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs = dict(target=targets, losses=losses) if self.has_last else {}
        if self.model.config.masks_attention:  # every stage's layers need the mask (the documents, the windows'
            kwargs["tokens"] = inputs  # length): the token ids, split as the inputs
        with self.state.loss_context():  # the last stage's vocabulary-parallel loss and its backward
            if forward_only:
                schedule.eval(*args, **kwargs)
            else:
                schedule.step(*args, return_outputs=False, **kwargs)
        total = sum((_whole(loss).detach().double() for loss in losses),
                    torch.zeros((), dtype=torch.float64, device=self.state.device)) / self.scale
        dist.all_reduce(total, group=self.state.pp_group)  # only the last stage has it
        return total

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, n_microbatches: int, scale: float) -> torch.Tensor:
        """Forward and backward of one step's micro-batches (inputs, targets: (n x mb, T))."""
        self.scale = scale
        self._use_group(self.state.pp_step_group if self.state.in_step_timeout else None)
        schedule = self._schedule(self.schedule, n_microbatches, tuple(inputs.shape))
        if self.first_norm is not None:
            self.first_norm.reset()
        loss = self._run(schedule, inputs, targets, forward_only=False)
        if self.replicas is not None:  # after every backward of the step, as DDP's last bucket
            self.local_squared = self.replicas.average()
        return loss

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed loss of one micro-batch, forward only (a one-micro-batch schedule)."""
        self.scale = 1.0
        self._use_group(None)
        name = "GPipe" if len(self.stages) == 1 else "forward-v" if self.schedule == "zbv" else "LoopedBFS"
        return self._run(self._schedule(name, 1, tuple(inputs.shape)), inputs, targets, forward_only=True)


def _whole(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a micro-batch's loss (the vocabulary-parallel loss is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def pipeline_parallelize(model: nn.Module, state: ParallelState, *, recompute="none",
                         compile: bool = False, init_log: InitLog | None = None,
                         param_dtype: torch.dtype | None = None) -> Pipeline:
    """Cut ``model`` (identical on every rank) into this rank's stages; then tensor/sequence parallel,
    recomputation, compile and data parallel (FSDP2 over "dp") per stage, as ``parallelize`` orders them.

    With ``init_log`` (``model`` built by ``build_on_meta``) the cut and parallelized stages are then
    materialised on ``state.device``: only this rank's parameters are ever allocated, with the
    one-process values. ``param_dtype`` (bf16 runs): FSDP2's mixed-precision policy per stage, as
    ``parallelize`` sets it (largebatch.parallel.parallelize.apply_fsdp)."""
    n_stages = state.pp_size * state.pp_virtual_stages
    layers = stage_layers(len(model.blocks), state.pp_size, state.pp_virtual_stages, state.pp_split)
    mine = rank_stages(state.pp_rank, state.pp_size, state.pp_virtual_stages, state.pp_schedule)
    keep_only(model, {i for s in mine for i in layers[s]}, 0 in mine, n_stages - 1 in mine)
    if state.tp_size > 1:  # within each stage, as torchtitan parallelizes each model chunk
        apply_tensor_parallel(model, state.tp_mesh, state.sequence_parallel, state.loss_parallel)
    if recompute != "none":
        apply_recompute(model, recompute)
    if compile:
        for block in model.blocks:
            if block is not None:
                block.compile()
    modules = []
    for index in mine:
        module = StageModule(model, layers[index], index == 0, index == n_stages - 1)
        if state.dp_size > 1 and state.dp_mode == "fsdp":  # ddp: Pipeline.replicas, after the step
            module = apply_fsdp(module, state.dp_mesh, param_dtype)
        modules.append(module)
    if init_log is not None:  # before the stages and the replicas' parameter list see the tensors
        materialize(model, init_log, state.device)
    stages = [recording_stage()(module, index, n_stages, state.device, group=state.pp_group)
              for module, index in zip(modules, mine)]
    return Pipeline(model, stages, state, state.pp_schedule)
