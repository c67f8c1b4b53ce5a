"""The process group and the ``pp x dp_replicate x dp_shard x tp`` device mesh, from torchrun's environment.

``init_distributed(cfg)`` reads what torchrun exports (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), picks NCCL on GPUs and gloo on CPUs, sets a collective timeout so that no rank waits
forever on a peer that died, and builds a 4-D mesh with dimensions ("pp", "dp_replicate",
"dp_shard", "tp") -- torchtitan's parallel_dims layout (docs/papers.md: sharding; Korthikanti et
al. 2022 §4.2.2 lays tensor/sequence parallel ranks along "tp"; Narayanan et al. 2021 pipeline
stages along "pp"). Ranks with consecutive numbers share a tensor-parallel group, so "tp" stays
within a node; "pp" is outermost. The data-parallel ranks are dp_replicate x dp_shard, flattened
into "dp" (batch slices, loss scale, DDP): FSDP2 shards over "dp_shard" and, when dp_replicate > 1,
replicates over "dp_replicate" (HSDP); DDP is dp_shard = 1.

``ParallelState`` is the one mesh object: every part (batching, norms, checkpoints, noise scale,
the trainer) reads its sizes, coordinates and groups from it, by dimension name (``DIMS``).

At world size 1 (plain ``python -m largebatch train``) nothing is initialised: the state says
rank 0 of 1 and every parallel function is a no-op on it.

``rank_guard(state)`` wraps a rank's work: an exception is re-raised as :class:`RankFailure`
whose message names the rank (global, dp and tp coordinates, host), and a collective that fails
because a peer died is labelled as such, so the job's log points at the rank that failed first.
"""

from __future__ import annotations

import faulthandler
import math
import os
import socket
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from largebatch import LONG_WAIT_GROUP
from largebatch.parallel.config import ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: the mesh's dimension names
_JOINED = False  # init_distributed joined a process group in this process (end_process)
_OWN_GROUP = False  # ... and has not left it since (shutdown: a group a caller made is the caller's)


class RankFailure(RuntimeError):
    """A rank of a distributed job failed; the message names the rank and the cause. ``line``: the
    same in one line (the error's first line, and which rank failed first where this one was taken
    down by it). ``crashes``: (rank, signal name) of each rank a native crash killed, where
    ``spawn`` names that as the cause (empty otherwise)."""

    def __init__(self, message: str, line: str | None = None, crashes: tuple[tuple[int, str], ...] = ()):
        super().__init__(message)
        self.line = line if line is not None else (message.splitlines() or [""])[0]
        self.crashes = tuple(crashes)


@dataclass
class ParallelState:
    """Where this process sits in the job. ``mesh`` is None at world size 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0  # dp_replicate_rank x dp_shard_size + dp_shard_rank: the batch slice
    dp_size: int = 1  # dp_replicate x dp_shard: the data-parallel degree
    dp_replicate_rank: int = 0
    dp_replicate_size: int = 1
    dp_shard_rank: int = 0
    dp_shard_size: int = 1  # what FSDP2 divides parameters, gradients and optimizer state by
    tp_rank: int = 0
    tp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    dp_mode: str = "ddp"
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_split: list[int] | None = None
    device: torch.device = torch.device("cpu")
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh, dimensions DIMS
    flat: dict | None = None  # meshes built once, by name: "dp" (dp_replicate x dp_shard), "dp_tp", "tp"
    timeout_s: float = 600.0  # parallel.timeout_s: what every group of the job waits
    # gloo under pp > 1 with parallel.step_timeout_s: the pipeline's sends and receives inside a step
    # run on this copy of the "pp" group, made with step_timeout_s (gloo keeps a group's first timeout
    # for them); ``in_step_timeout`` says when (set_collective_timeout sets it)
    pp_step_group: object | None = None
    in_step_timeout: bool = False

    def size(self, dim: str) -> int:
        return getattr(self, f"{dim}_size")

    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every mesh dimension."""
        return {dim: getattr(self, f"{dim}_rank") for dim in DIMS}

    def submesh(self, dim: str):
        """The mesh along one dimension of DIMS, or a flattened one ("dp", "dp_tp"): the one built by
        init_distributed where there is one."""
        if self.mesh is None:
            return None
        return self.flat[dim] if self.flat and dim in self.flat else self.mesh[dim]

    def group(self, dim: str):
        """The process group along one mesh dimension, or "dp" (None at world size 1)."""
        return None if self.mesh is None else self.submesh(dim).get_group()

    @property
    def stage_group(self):
        """The ranks that hold the same pipeline stage(s) (dp x tp): per-tensor norms reduce here."""
        return self.group("dp_tp")

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, plots and writes the run's extra files."""
        return self.rank == 0

    @property
    def dp_mesh(self):
        """What FSDP2 shards over: ("dp_replicate", "dp_shard") under HSDP (2-D), else "dp_shard"."""
        if self.mesh is None:
            return None
        if self.dp_shard_size == 1 < self.dp_size:
            raise ValueError(f"this mesh lays out its {self.dp_size} dp ranks as replicas (dp_mode = 'ddp'): "
                             "build the state with init_distributed(ParallelConfig(dp_mode='fsdp')) to shard")
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate_size > 1 else self.mesh["dp_shard"]

    @property
    def tp_mesh(self):
        """The tensor-parallel mesh: ONE object per mesh (built by init_distributed and shared by the
        states ``dataclasses.replace`` makes). ``mesh["tp"]`` builds a new, equal submesh on every
        call; after a model was sharded eagerly on one such object, compiling another on a newer one
        made torch's tracer rebuild the older one in the graph, which inductor refuses
        ("device_mesh._get_submesh is not an OpOverload")."""
        return self.submesh("tp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    def loss_context(self):
        """Wrap forward AND backward in this: the vocabulary-parallel loss when it is on."""
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    @property
    def hsdp(self) -> bool:
        """FSDP2 sharded within replica groups and replicated across them."""
        return self.dp_mode == "fsdp" and self.dp_replicate_size > 1

    def describe(self) -> str:
        coords = {"pp": self.pp_rank, "dp": self.dp_rank, "tp": self.tp_rank}
        where = ", ".join(f"{dim} {rank}/{self.size(dim)}" for dim, rank in coords.items()
                          if dim != "pp" or self.pp_size > 1)
        if self.hsdp:
            where += (f"; replica {self.dp_replicate_rank}/{self.dp_replicate_size}, "
                      f"shard {self.dp_shard_rank}/{self.dp_shard_size}")
        return f"rank {self.rank}/{self.world_size} ({where}) on {socket.gethostname()}"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; it is set by "
                         "torchrun (launch with: torchrun --nproc-per-node N -m largebatch ...)") from None


def resolve_sizes(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """(pp, dp, tp) for this world size, or ValueError saying how to fix the config or the launch.
    dp = dp_replicate x dp_shard (``replica_sizes``)."""
    model_ranks = cfg.pp * cfg.tp
    if world_size % model_ranks:
        what = f"parallel.tp = {cfg.tp}" if cfg.pp == 1 else f"parallel.pp x parallel.tp = {model_ranks}"
        raise ValueError(f"{what} does not divide the {world_size} processes started; launch a "
                         f"multiple of {model_ranks} processes (torchrun --nproc-per-node) or change "
                         f"{'tp' if cfg.pp == 1 else 'pp or tp'}"
                         + (" (one process: --parallel.pp=1 --parallel.tp=1; a run continues with --resume "
                            "RUN_DIR and them)" if world_size == 1 else ""))
    dp = cfg.dp or world_size // model_ranks
    if dp * model_ranks != world_size:
        if cfg.pp == 1:
            raise ValueError(f"parallel.dp x parallel.tp = {dp} x {cfg.tp} = {dp * cfg.tp}, but {world_size} "
                             f"processes were started; set dp = 0 (automatic) or launch {dp * cfg.tp} processes")
        raise ValueError(f"parallel.pp x dp x tp = {cfg.pp} x {dp} x {cfg.tp} = {dp * model_ranks}, but "
                         f"{world_size} processes were started; set dp = 0 (automatic) or launch "
                         f"{dp * model_ranks} processes")
    if cfg.tp > 1 and dp > 1 and cfg.dp_mode == "ddp":
        raise ValueError(f"parallel.dp_mode = 'ddp' with dp = {dp} and tp = {cfg.tp}: DDP cannot replicate "
                         "tensor-parallel (DTensor) parameters; set parallel.dp_mode = 'fsdp'")
    replica_sizes(cfg, dp)
    return cfg.pp, dp, cfg.tp


def replica_sizes(cfg: ParallelConfig, dp: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of ``dp`` data-parallel ranks: DDP replicates over all of them
    (dp_shard = 1), FSDP2 shards over dp / R within each of R = parallel.dp_replicate groups."""
    if cfg.dp_mode == "ddp":
        return dp, 1
    r = cfg.dp_replicate
    if dp % r or (r > 1 and dp == r):
        raise ValueError(f"parallel.dp_replicate = {r} with {dp} data-parallel ranks: R must divide dp and "
                         f"leave dp / R > 1 ranks to shard over; choose a proper divisor of {dp} (or 1)")
    return r, dp // r


def _restart_store(world_size: int, timeout: timedelta) -> dict:
    """``store``/``rank``/``world_size`` for init_process_group under ``torchrun --max-restarts``.

    torchrun's agent hosts one TCPStore for all of a job's attempts and its workers connect to it
    without a per-attempt prefix (pytorch/pytorch#135712), so after a restart the new workers read
    the addresses the killed ones published and fail to connect ("Gloo connectFullMesh failed ...
    Connection refused"; NCCL reads a stale unique id). Each attempt gets its own key space,
    ``attempt_{TORCHELASTIC_RESTART_COUNT}``: the count is the agent's, the same for every worker of
    one node (several nodes agree when they restart together after a failure). Empty (plain env://)
    outside torchelastic's shared store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world_size,
                          is_master=False, timeout=timeout)
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    return {"store": dist.PrefixStore(f"largebatch/attempt_{attempt}", store),
            "rank": _env_int("RANK", 0), "world_size": world_size}


def agree_at_start(outcome: str, detail: str, timeout_s: float) -> list[tuple[str, str, str]] | None:
    """Every rank's ``(outcome, detail, host)`` as it ends its checks before the job starts: "go", or
    the reason it will not ("fail": its one-line error; "finished": the run is; "stopped": by a signal). Under
    torchrun a rank that exits before the process group forms (a read-only disk, a finished run, a
    missing file on its node only) left the others waiting in ``init_process_group`` for
    ``parallel.timeout_s`` and a traceback; with this each learns at once. Exchanged through the
    agent's TCPStore (no process group: it needs no backend), polled so that a signal is handled
    while waiting. None outside torchelastic's agent store (a launcher without one). TimeoutError
    naming the ranks that did not arrive within ``timeout_s``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import json

    world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world_size,
                          is_master=False, timeout=timedelta(seconds=max(timeout_s, 1.0)))
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    box = dist.PrefixStore(f"largebatch/attempt_{attempt}/start", store)
    box.set(str(rank), json.dumps([outcome, detail, socket.gethostname()]))
    keys = [str(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not box.check(keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if not box.check([k])]
            raise TimeoutError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(missing)} did not finish "
                               f"the checks before the start within parallel.timeout_s = {timeout_s:g} s")
        time.sleep(0.05)
    return [tuple(json.loads(box.get(k))) for k in keys]


def check_backend(cfg: ParallelConfig) -> None:
    """ValueError when ``parallel.backend`` cannot run on this machine (NCCL without a CUDA GPU)."""
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend = 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on CPU")


def _enable_faulthandler() -> None:
    """Have a native crash of this rank (SIGSEGV, SIGABRT from glibc finding its heap corrupted),
    which torchrun reports by the signal alone, write every thread's Python stack to stderr first;
    nothing where it is on already or stderr is no file (a notebook's stream)."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (OSError, ValueError, RuntimeError, AttributeError):  # no file descriptor behind sys.stderr
        pass


def init_distributed(cfg: ParallelConfig | None = None) -> ParallelState:
    """Join the job torchrun started and build the DIMS mesh; a no-op at world size 1. A process
    that joined ends best through ``end_process``."""
    global _JOINED, _OWN_GROUP
    cfg = cfg or ParallelConfig()
    world_size = _env_int("WORLD_SIZE", 1)
    pp, dp, tp = resolve_sizes(cfg, world_size)
    replicate, shard = replica_sizes(cfg, dp)
    use_cuda = cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available())
    check_backend(cfg)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size == 1:
        return ParallelState(device=device, sequence_parallel=False, dp_mode=cfg.dp_mode)
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout,
                                **_restart_store(world_size, timeout),
                                **({"device_id": device} if use_cuda else {}))
        _JOINED = _OWN_GROUP = True
        _enable_faulthandler()
    # Every group the mesh makes waits parallel.timeout_s, as the default group does. Left to torch,
    # a dimension spanning less than the whole job got a group of its own with torch's 30-minute
    # default (the dp group of pp2 x dp2, HSDP's groups), and gloo's sends and receives keep the
    # timeout their group was made with whatever is set later.
    sizes = (pp, replicate, shard, tp)
    options = _group_options(use_cuda, cfg.timeout_s)
    override = {name: options for name, size in zip(DIMS, sizes) if size != world_size}
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=DIMS, backend_override=override or None)

    def flatten(dims: tuple[str, ...], name: str):
        size = math.prod(sizes[DIMS.index(d)] for d in dims)
        return mesh[dims]._flatten(name, backend_override=options if size != world_size else None)

    flat = {"dp": flatten(("dp_replicate", "dp_shard"), "dp"),  # batch slices, loss scale, DDP
            "dp_tp": flatten(("dp_replicate", "dp_shard", "tp"), "dp_tp"),  # ParallelState.stage_group
            "tp": mesh["tp"]}  # ParallelState.tp_mesh
    pp_step_group = None
    if pp > 1 and not use_cuda and cfg.step_timeout_s is not None:  # (NCCL applies a new timeout to all)
        for ranks in mesh.mesh.permute(1, 2, 3, 0).reshape(-1, pp).tolist():  # every pp group, in one order
            group = dist.new_group(ranks, timeout=timedelta(seconds=cfg.step_timeout_s), backend="gloo",
                                   group_desc="pp_step")
            if dist.get_rank() in ranks:
                pp_step_group = group
    return ParallelState(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                         pp_rank=mesh.get_local_rank("pp"), pp_size=pp,
                         dp_rank=flat["dp"].get_local_rank(), dp_size=dp,
                         dp_replicate_rank=mesh.get_local_rank("dp_replicate"), dp_replicate_size=replicate,
                         dp_shard_rank=mesh.get_local_rank("dp_shard"), dp_shard_size=shard,
                         tp_rank=mesh.get_local_rank("tp"),
                         tp_size=tp, sequence_parallel=cfg.sequence_parallel and tp > 1,
                         loss_parallel=cfg.loss_parallel and tp > 1,
                         dp_mode=cfg.dp_mode, pp_schedule=cfg.pp_schedule,
                         pp_virtual_stages=cfg.pp_virtual_stages, pp_split=cfg.pp_split, device=device, mesh=mesh,
                         flat=flat, timeout_s=cfg.timeout_s, pp_step_group=pp_step_group)


def _group_options(use_cuda: bool, seconds: float) -> tuple[str, object]:
    """The (backend, options) that make a device-mesh group with a ``seconds`` timeout."""
    backend = "nccl" if use_cuda else "gloo"
    options = dist.ProcessGroupNCCL.Options() if use_cuda else dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=seconds)
    return backend, options


def set_collective_timeout(seconds: float, state: ParallelState | None = None) -> None:
    """From now on every process group of this process (the default one, the mesh's, the side
    groups) fails a collective that waits longer than ``seconds`` (``parallel.step_timeout_s`` inside
    a step, ``parallel.timeout_s`` outside). Nothing before ``init_distributed``. Not changed: a group
    that waits on purpose for longer (the data build's, ``LONG_WAIT_GROUP``), and on gloo the timeout
    of sends and receives, which stays the one the group was made with (pipeline stages switch to
    ``ParallelState.pp_step_group`` for that)."""
    if state is not None:  # a timeout other than the job's is a step's (the pipeline's sends follow it)
        state.in_step_timeout = seconds != state.timeout_s
    if not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if getattr(group, "group_desc", "") != LONG_WAIT_GROUP:
            c10d._set_pg_timeout(timeout, group)


def seed_ranks(seed: int, state: ParallelState) -> int:
    """Seed torch's RNG for training (dropout), AFTER the model was initialised with ``seed``.

    Data-parallel replicas get different streams (seed + 1000003 * dp_rank; dp rank 0 keeps ``seed``
    so dp = 1 reproduces the single-process run), or every replica would drop the same units on
    different samples. So do pipeline ranks (+ 10007 * pp_rank, as Megatron and torchtitan offset the
    seed per stage): with one stream each stage would start from the same state, and a later stage's
    layers would reuse the first stage's masks element for element (the embedding dropout's mask in
    a later stage's attention). The tensor-parallel ranks of a replica share one stream: dropout in the
    replicated regions (tensor parallel without SP) must draw identical masks there. Known
    simplification: the shards of attention-probability dropout and of sequence-parallel regions
    then draw identical mask patterns on different heads / positions (Megatron forks a separate
    model-parallel RNG for those). Returns the seed used.
    """
    rank_seed = seed + 1_000_003 * state.dp_rank + 10_007 * state.pp_rank
    torch.manual_seed(rank_seed)
    return rank_seed


def shutdown(state: ParallelState) -> None:
    """Leave the process group init_distributed joined (after a last barrier, so no rank exits while
    others still talk); a group the caller made before is left to the caller."""
    if state.distributed and _OWN_GROUP:
        leave_process_group()


def leave_process_group() -> None:
    """A last barrier, then destroy the default group, if one is initialised (see ``end_process``:
    this alone does not stop the backend's worker threads)."""
    global _OWN_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _OWN_GROUP = False


def end_process(code: int) -> int:
    """End a process that joined a process group: leave it (``code`` 0 only: a failing rank must not
    wait in a barrier for peers that may be stuck elsewhere), run the ``atexit`` handlers, flush
    stdout and stderr, and exit with ``code`` without the interpreter's teardown (``os._exit``).
    A process that joined no group gets ``code`` back and nothing happens.

    Why: ``destroy_process_group`` removes the groups from torch's registry but does not stop their
    backend threads (gloo's two worker threads per group), and DDP keeps the default group alive
    (its C++ side holds it; ``gc.collect`` does not free it). A worker that has just completed the
    last barrier then releases that work, and the works it still references, on its own thread;
    their tensors' Python objects need the GIL. If that happens while the interpreter tears down,
    Python ends the thread inside a C++ destructor and the process aborts (SIGABRT, "terminate
    called without an active exception") after its run has finished: torchrun then reports the
    rank as failed, and a scheduler the job. Measured on 2 busy cores: 1 abort in 12 two-rank runs
    (docs/LOG.md); skipping the teardown leaves no moment at which it can happen."""
    if not _JOINED:
        return code
    import atexit

    if code == 0:
        leave_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs first (logging.shutdown, multiprocessing)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)


# where a communication backend's own errors say who raised them: gloo's (a plain RuntimeError naming
# its source file: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", "Timed out
# waiting 30000ms for recv operation") and NCCL's (a DistBackendError, or its watchdog's abort)
_BACKEND_MARKERS = ("gloo/transport", "/gloo/", "gloo::", "ProcessGroupGloo", "ProcessGroupNCCL",
                    "NCCL communicator", "Watchdog caught collective")


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a communication backend's: torch's
    DistError family, or an error text of gloo or NCCL (_BACKEND_MARKERS) -- what another rank's
    death or hang causes on this one. A rank's own error that merely says "timed out" or "connection
    reset" (a data loader, an HTTP read) is not one: taken as one, the rank that failed first waited
    and blamed its live peers."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, getattr(dist, "DistError", ())) or any(marker in str(exc) for marker in _BACKEND_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


FAILURE_WAIT_S = 3.0
"""Seconds a rank whose collective failed waits for the other ranks' reports of their own failures
(rank_guard) before it names the rank that failed first, or the ranks that reported nothing."""


@contextmanager
def rank_guard(state: ParallelState):
    """Run a rank's work; on an exception, print and raise a RankFailure naming this rank.

    Under torchrun every failing rank also reports its error in the agent's store. A rank whose
    collective failed or timed out (a consequence: its peer died, or is stuck) waits up to
    ``FAILURE_WAIT_S`` for those reports, and its message names the rank that failed first with that
    rank's error, or the ranks that reported none (killed outright -- SIGKILL, the out-of-memory
    killer, a native crash -- or stuck). Before, it said "look for that rank's own 'failed' line",
    which a killed or stuck rank never prints, and torchrun's closing "Root Cause" block, which breaks
    a tie of the same second toward the lowest rank, quoted rank 0's "Connection closed by peer"."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 -- re-raised with the rank named
        text = f"{type(exc).__name__}: {exc}"
        message = f"{state.describe()} failed: {text}"
        line = message.splitlines()[0]
        peer = collective_failure(exc)
        failed_at = time.time()
        box = _failure_box()
        if box is not None:
            _report_failure(box, state, text.splitlines()[0] if text else "", peer)
        if peer and box is not None:
            # said at once: torchrun may end this rank while it waits (it signals the others as soon
            # as one exits); the wait itself defers those signals, bounded by FAILURE_WAIT_S
            print(f"[largebatch] {message}", file=sys.stderr, flush=True)
            with _stop_signals_deferred():
                diagnosis = _first_failure(box, state, FAILURE_WAIT_S, failed_at)
            message, line = f"{message}\n  {diagnosis}", f"{line} {diagnosis}"
            print(f"[largebatch] {state.describe()}: {diagnosis}", file=sys.stderr, flush=True)
        else:
            if peer:
                hint = ("(a collective failed or timed out: most likely another rank died or is stuck first "
                        "-- look for that rank's own 'failed' line)")
                message, line = f"{message}\n  {hint}", f"{line} {hint}"
            print(f"[largebatch] {message}", file=sys.stderr, flush=True)
        raise RankFailure(message, line) from exc


@contextmanager
def _stop_signals_deferred():
    """SIGTERM, SIGINT and SIGHUP do nothing inside (a failing rank ends with its own error right
    after); their handlers are put back on leaving. Nothing outside the main thread."""
    import signal

    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[signum] = signal.signal(signum, lambda *_: None)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


LATE_S = 1.0
"""A rank whose collective failed this many seconds or more after every other rank's is the one they
waited for (ranks failing together, as on a network fault, fail within milliseconds of each other)."""


def _failure_box():
    """This torchrun attempt's failure reports (rank -> JSON) in the agent's store, or None outside
    torchelastic's agent store or where it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), _env_int("WORLD_SIZE", 1),
                              is_master=False, timeout=timedelta(seconds=5))
    except Exception:  # noqa: BLE001 -- the agent gone (or its store unreachable): no reports
        return None
    return dist.PrefixStore(f"largebatch/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}/failed", store)


def _report_failure(box, state: ParallelState, text: str, peer: bool) -> None:
    """Put this rank's failure in ``box``: who (rank, coordinates, host), the error's first line,
    whether it was a collective's (a consequence) and when."""
    import json

    try:
        box.set(str(state.rank), json.dumps({"who": state.describe(), "text": text, "peer": peer,
                                             "time": time.time()}))
    except Exception:  # noqa: BLE001 -- the store gone: the rank's own line still says it
        pass


def _first_failure(box, state: ParallelState, wait_s: float, failed_at: float | None = None) -> str:
    """For a rank whose collective failed (at ``failed_at``, time.time()): the line naming the rank that
    failed first (the earliest report that was not a collective's), or the ranks that reported nothing
    within ``wait_s``, or this rank itself when every other one's collective had failed well before
    (they timed out waiting for it: it was late or stuck, and found its peers gone when it came back)."""
    import json

    others = [r for r in range(state.world_size) if r != state.rank]
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for r in others:
                if r not in reports and box.check([str(r)]):
                    reports[r] = json.loads(box.get(str(r)))
            causes = sorted((report["time"], r) for r, report in reports.items() if not report["peer"])
            if causes or len(reports) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 -- the store gone mid-wait: say what is known
        causes = sorted((report["time"], r) for r, report in reports.items() if not report["peer"])
    if causes:
        first = reports[causes[0][1]]
        return f"(a consequence: {first['who']} failed first: {first['text']})"
    silent = [r for r in others if r not in reports]
    if silent:
        ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
        per_stage = state.world_size // max(state.pp_size, 1)  # "pp" is the mesh's outermost dimension
        elsewhere = [r for r in silent if r // per_stage != state.pp_rank] if state.pp_size > 1 else []
        waiting = ""
        if elsewhere and len(elsewhere) < len(silent):  # this stage's silent ranks are the suspects
            waiting = (f"; {', '.join(map(str, elsewhere))} of another pipeline stage may only be waiting on "
                       "a transfer from a stuck or dead rank (each reports when its own wait times out)")
        elif elsewhere:
            waiting = ("; under pipeline parallel a rank of another stage may only be waiting on a transfer "
                       "from the one that failed")
        return (f"(a collective failed or timed out: {ranks} of {state.world_size} reported no error within "
                f"{wait_s:g} s -- killed outright (SIGKILL, e.g. by the out-of-memory killer, or a native crash: "
                f"torchrun's summary gives the exit code) or stuck (a hang, a stopped process){waiting})")
    before = [failed_at - report["time"] for report in reports.values()] if failed_at is not None else []
    if before and min(before) > LATE_S:
        return (f"(this rank came late: the collectives of every other rank had already failed, "
                f"{min(before):.0f}-{max(before):.0f} s before its own, waiting for it -- it was stuck or slow "
                "in this step (a hang, a stopped process, a slow read), and found its peers gone)")
    return "(a collective failed or timed out on every rank, none of them first: the network, or a rank's host)"
