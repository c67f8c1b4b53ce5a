"""Data-parallel replicas of pipeline stages (pp = 2 x dp = 2, 4 gloo ranks): two ways, timed and checked.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_replicas.py              # 8 layers, m = 4
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_replicas.py --rounds 3   # quick

'explicit': largebatch's ReplicaGradients (parallel.dp_mode = 'ddp' under pp): after the schedule's
step, the stage's accumulated gradients are averaged over the dp group by flat all-reduces in
buckets of DDP's default 25 MiB. 'replicate': torch's composable ``replicate`` (the FSDP2-based one
that torch.distributed.pipelining drives like an FSDP module), applied per block and per stage.
Per way: the median step time (1F1B, fp32; the two ways' steps interleaved, round by round) and the
largest gradient difference against one process accumulating the same global batch (the loss
scaled by dp / n_targets, as the trainer does).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from pipeline import model_arguments, model_config  # noqa: E402  (benchmarks/pipeline.py)

from largebatch.models import build_model  # noqa: E402
from largebatch.models.gpt import token_loss  # noqa: E402
from largebatch.parallel import ParallelConfig, init_distributed, spawn  # noqa: E402
from largebatch.parallel import pipeline as pipeline_module  # noqa: E402

WAYS = ("explicit", "replicate")


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: dp x m micro-batches of ``micro_batch`` sequences."""
    gen = torch.Generator().manual_seed(0)
    shape = (2 * args.micro_batches * args.micro_batch, args.seq_len)
    return torch.randint(0, args.vocab, shape, generator=gen), torch.randint(0, args.vocab, shape, generator=gen)


def one_process_grads(args) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(model_config(args))
    idx, targets = batch(args)
    for i in range(0, len(idx), args.micro_batch):
        logits, _ = model(idx[i:i + args.micro_batch])
        (token_loss(logits, targets[i:i + args.micro_batch], "sum") / targets.numel()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def replicate_stage(module, dp_mesh, param_dtype=None):
    """torch's composable replicate per block and per stage, in apply_fsdp's place."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in module.blocks:
        replicate(block, mesh=dp_mesh)
    replicate(module, mesh=dp_mesh)
    return module


def build(args, way: str):
    """(model, pipeline) for one way; the replicate way goes where apply_fsdp would."""
    original = pipeline_module.apply_fsdp
    if way == "replicate":
        pipeline_module.apply_fsdp = replicate_stage
    try:
        state = init_distributed(ParallelConfig(pp=2, dp_mode="ddp" if way == "explicit" else "fsdp"))
        torch.manual_seed(0)
        model = build_model(model_config(args))
        return state, model, pipeline_module.pipeline_parallelize(model, state)
    finally:
        pipeline_module.apply_fsdp = original


def worker(args, out: str) -> None:
    idx, targets = batch(args)
    rows = args.micro_batches * args.micro_batch
    built = {way: build(args, way) for way in WAYS}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds + 1):  # interleaved, so both see the same machine; the first is a warm-up
        for way, (state, model, pipe) in built.items():
            mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(idx[mine], targets[mine], args.micro_batches, state.dp_size / targets.numel())
            times[way].append(time.perf_counter() - t0)
    for way, (_, model, _) in built.items():
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
                 for name, p in model.named_parameters() if p.grad is not None}
        torch.save({"times": times[way][1:], "grads": grads}, Path(out, f"{way}_rank{dist.get_rank()}.pt"))


def main() -> None:
    args = model_arguments(__doc__.splitlines()[0], micro_batch=2, micro_batches=4).parse_args()  # m per replica
    reference = one_process_grads(args)
    with tempfile.TemporaryDirectory() as out:
        spawn(worker, 4, args, out)
        results = {}
        for way in WAYS:
            ranks = [torch.load(Path(out, f"{way}_rank{r}.pt")) for r in range(4)]
            diff = max((g - reference[name]).abs().max().item() for r in ranks for name, g in r["grads"].items())
            covered = {name for r in ranks for name in r["grads"]}
            results[way] = {"median_step_s": round(statistics.median(t for r in ranks for t in r["times"]), 4),
                            "max_grad_diff_vs_one_process": diff, "all_params": covered == set(reference)}
    print(json.dumps({"config": vars(args), "threads": os.environ.get("OMP_NUM_THREADS"), **results}, indent=1))


if __name__ == "__main__":
    main()
