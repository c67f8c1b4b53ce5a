"""Walk a pipeline schedule's per-rank action list: activations in flight and the bubble.

Korthikanti et al. 2022 §4.2.3 (docs/papers.md: memory) gives the first stage's activations in
closed form: 1F1B keeps p micro-batches of L/p layers (L layers' worth), the interleaved schedule
L (1 + (p - 1) / (p V)), GPipe all m micro-batches (m L / p); Narayanan et al. 2021 §2.2 the bubble,
(p - 1) / (m + p - 1) for 1F1B and (p - 1) / (V m + p - 1) interleaved. The zero-bubble schedules
of Qi et al. 2024 (ZB-1P, which torch's interleaved zero bubble implements; ZB-V, §6) have no closed
form here: torch splits the backward into the input-gradient (I) and the weight-gradient (W)
actions, and a stage keeps a micro-batch's activations from its forward until its W.

``walk(schedule, p, V, m)`` takes the very action lists torch's schedules run: for the
multi-stage ones their ``pipeline_order``, built without a process group (a pure function of p, V
and m); for GPipe and 1F1B the order of their ``_step_microbatches`` (torch 2.13's 1F1B
``pipeline_order`` is not what runs: its last rank starts at micro-batch 1). Per rank it counts
the (micro-batch, stage) pairs in flight -- a forward adds one, a full backward (B) or a
weight-gradient step (W) removes one, an input-gradient step (I) none -- and times the actions
with a forward, an input-gradient and a weight-gradient step one slot each (a full backward two;
Qi et al.'s T_F = T_B = T_W), each waiting for the action it depends on (the previous stage's
forward, the next stage's input gradient). The bubble is the share of p x makespan slots in which
a rank is idle. Communication is free in this timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from largebatch.memory.activations import stage_activation_bytes
from largebatch.models.config import ModelConfig

# the schedules `largebatch train` offers (parallel.pp_schedule), with the stages each rank holds
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
ZERO_BUBBLE = ("interleaved-zb", "zbv")
COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # slots per action (B = I + W)
MAX_WALK = 50_000  # p V m (micro-batch, stage) pairs at most: a few seconds of walking


@dataclass(frozen=True)
class ScheduleWalk:
    """One schedule at (p, V, m): per rank its actions (kind, stage, micro-batch) in order, the peak
    number of (micro-batch, stage) activations in flight, and its idle slots; the makespan in slots."""

    schedule: str
    pp: int
    virtual: int
    micro_batches: int
    actions: tuple[tuple[tuple[str, int, int], ...], ...]
    peak_in_flight: tuple[int, ...]
    idle: tuple[int, ...]
    makespan: int

    @property
    def bubble(self) -> float:
        """Idle slots over p x makespan slots."""
        return sum(self.idle) / (self.pp * self.makespan)

    def layers_worth(self, n_layer: int, rank: int = 0) -> float:
        """Layers' worth of activations ``rank`` keeps at its peak: stages of L / (p V) layers each."""
        return self.peak_in_flight[rank] * n_layer / (self.pp * self.virtual)

    def peak_bytes(self, stage_bytes: Callable[[int], float], rank: int = 0) -> float:
        """Peak over ``rank``'s actions of the bytes in flight, one micro-batch of stage s keeping
        ``stage_bytes(s)`` (the first and the last stage differ: embeddings, output layer and loss)."""
        return _peak(self.actions[rank], stage_bytes)


def check(schedule: str, pp: int, virtual: int, micro_batches: int) -> None:
    """ValueError, naming the fix, for a layout the schedule cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: must be one of {', '.join(SCHEDULES)}.")
    if pp < 2 or micro_batches < 1 or virtual < 1:
        raise ValueError(f"pp={pp}, V={virtual}, m={micro_batches}: need pp >= 2, V >= 1 and m >= 1.")
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise ValueError(f"schedule={schedule!r} holds one stage per rank: V={virtual} must be 1.")
    if schedule == "zbv" and virtual != 2:
        raise ValueError(f"schedule='zbv' holds exactly 2 stages per rank (a V): V={virtual} must be 2.")
    if schedule != "gpipe" and micro_batches < pp:
        raise ValueError(f"schedule={schedule!r} with pp={pp} needs m >= {pp} micro-batches, got {micro_batches}.")
    if pp * virtual * micro_batches > MAX_WALK:
        raise ValueError(f"pp x V x m = {pp} x {virtual} x {micro_batches}: more than {MAX_WALK:,} (micro-batch, "
                         "stage) pairs to walk; give fewer micro-batches.")
    rounds = max(1, micro_batches // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zb") and micro_batches % rounds:
        raise ValueError(f"schedule={schedule!r}: m={micro_batches} is not a multiple of its {rounds} rounds "
                         f"(m // p); choose m a multiple of p.")


def torch_order(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the compute actions (kind F/B/I/W, stage, micro-batch) of torch's schedule, in order.

    GPipe and 1F1B as their ``_step_microbatches`` runs them (1F1B: rank r first runs min(m, p - r)
    forwards, then a backward and a forward in turn); the multi-stage schedules from torch's own
    ``pipeline_order`` code, without stages or a process group (private API of
    torch.distributed.pipelining.schedules; imported here, lazily)."""
    check(schedule, pp, virtual, micro_batches)
    m = micro_batches
    if schedule == "gpipe":
        return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp)]
    if schedule == "1f1b":
        order = []
        for r in range(pp):
            warmup = min(m, pp - r)
            ops = [("F", r, i) for i in range(warmup)]
            for i in range(m):
                ops.append(("B", r, i))
                if warmup + i < m:
                    ops.append(("F", r, warmup + i))
            order.append(ops)
        return order
    from torch.distributed.pipelining import schedules as ts

    cls = {"gpipe": ts.ScheduleGPipe, "1f1b": ts.Schedule1F1B, "interleaved-1f1b": ts.ScheduleInterleaved1F1B,
           "interleaved-zb": ts.ScheduleInterleavedZeroBubble, "zbv": ts.ScheduleZBVZeroBubble}[schedule]
    obj = cls.__new__(cls)  # the attributes the order reads, as the constructor sets them
    obj._n_microbatches, obj.pp_group_size, obj.n_local_stages = micro_batches, pp, virtual
    obj._num_stages = obj.num_stages = pp * virtual
    obj.number_of_rounds = max(1, micro_batches // pp)
    obj.microbatches_per_round = micro_batches // obj.number_of_rounds
    order = {rank: obj._calculate_single_rank_operations(rank) for rank in range(pp)}
    if schedule == "interleaved-zb":  # as its constructor: idle slots where a dependency is not met
        obj.pipeline_order = order
        order = obj._add_bubbles_to_actions(pp * virtual)
    kinds = {ts.FORWARD: "F", ts.FULL_BACKWARD: "B", ts.BACKWARD_INPUT: "I", ts.BACKWARD_WEIGHT: "W"}
    return [[(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in order[rank]
             if a is not None and a.computation_type in kinds] for rank in range(pp)]


def _peak(actions: Sequence[tuple[str, int, int]], weight: Callable[[int], float] = lambda stage: 1) -> float:
    live = peak = 0
    for kind, stage, _ in actions:
        live += {"F": 1, "B": -1, "I": 0, "W": -1}[kind] * weight(stage)
        peak = max(peak, live)
    return peak


def _timing(actions: list[list[tuple[str, int, int]]], n_stages: int) -> tuple[list[int], int]:
    """Each rank runs its actions in order, each as soon as the rank is free and its dependency done:
    returns (idle slots per rank, makespan)."""
    done: dict[tuple[str, int, int], int] = {}  # (F or G -- input gradient ready, stage, mb): finish
    free, nxt = [0] * len(actions), [0] * len(actions)
    while any(n < len(a) for n, a in zip(nxt, actions)):
        moved = False
        for rank, todo in enumerate(actions):
            while nxt[rank] < len(todo):
                kind, stage, mb = todo[nxt[rank]]
                if kind == "F":
                    deps = [("F", stage - 1, mb)] if stage else []
                elif kind in ("B", "I"):
                    deps = [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < n_stages - 1 else [])
                else:
                    deps = [("G", stage, mb)]
                if any(d not in done for d in deps):
                    break
                end = max([free[rank]] + [done[d] for d in deps]) + COST[kind]
                done[("G" if kind in ("B", "I") else kind, stage, mb)] = free[rank] = end
                nxt[rank] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule's action lists deadlock: no rank can take its next action")
    makespan = max(free)
    return [makespan - sum(COST[k] for k, _, _ in todo) for todo in actions], makespan


@functools.lru_cache(maxsize=64)
def walk(schedule: str, pp: int, virtual: int, micro_batches: int) -> ScheduleWalk:
    """Activations in flight per rank and the bubble of ``schedule`` at (p, V, m) (module docstring);
    a pure function of its arguments, kept for the planner, which asks once per recompute mix."""
    actions = torch_order(schedule, pp, virtual, micro_batches)
    idle, makespan = _timing(actions, pp * virtual)
    return ScheduleWalk(schedule, pp, virtual, micro_batches, tuple(tuple(a) for a in actions),
                        tuple(_peak(a) for a in actions), tuple(idle), makespan)


def theoretical_bubble(schedule: str, pp: int, virtual: int, micro_batches: int) -> float | None:
    """Narayanan et al. 2021 §2.2: (p - 1) / (V m + p - 1) for GPipe, 1F1B (V = 1) and interleaved
    1F1B; None for the zero-bubble schedules (their bubble depends on the W placement: ``walk``)."""
    if schedule in ZERO_BUBBLE:
        return None
    return (pp - 1) / (virtual * micro_batches + pp - 1)


def schedule_activation_bytes(config: ModelConfig, micro_batch: int, schedule: str, pp: int, virtual: int,
                              micro_batches: int, rank: int = 0, **kw) -> float:
    """Peak activation bytes on ``rank`` (default the first stage's) under ``schedule``: ``walk``'s
    order with each stage's bytes per micro-batch (``stage_activation_bytes``: L / (p V) blocks, the
    embeddings on stage 0, the output layer and loss on the last -- which ZBV puts on rank 0).
    ``kw``: tp, sequence_parallel, seq_len, dtype_bytes, device, recompute, ... as there."""
    n = pp * virtual
    if config.n_layer % n:
        raise ValueError(f"pp x V = {pp} x {virtual} = {n} stages: must divide n_layer={config.n_layer}.")
    per = {s: stage_activation_bytes(config, micro_batch, config.n_layer // n, first=s == 0, last=s == n - 1, **kw)
           for s in range(n)}
    return walk(schedule, pp, virtual, micro_batches).peak_bytes(per.__getitem__, rank)
