"""One-process GPU check (<= 8 minutes on one H200): what the techniques buy on real hardware.

1. throughput: bf16 tokens/s and MFU of a ~350M-parameter GPT (24 x 1024, 16 heads, seq 2048,
   vocab 50304) under none / selective / full recomputation (Korthikanti et al. 2022, docs/papers.md: memory),
   with SDPA and with explicit attention; measured peak memory (torch.cuda.max_memory_allocated)
   next to largebatch.memory.estimate's total and model_activation_bytes.
2. optimizer: step time of LAMB (You et al. 2019) and LANS (Zheng et al. 2020) on that model's
   parameters, interleaved, as ratios: the default paths vs torch.optim.AdamW(foreach=True), the
   fused=True paths vs torch.optim.AdamW(fused=True) (targets: 1.3x and 2x); then the same on many
   small tensors of many distinct shapes (2000 x (4,) + 200 shapes; targets 1.5x and 2x), with the
   first fused step (compilation) timed.
3. seesaw: Seesaw r=1/2 (Meterez et al. 2025) vs cosine wall-clock at equal tokens through the
   trainer (bf16, Shakespeare): larger batches fill the GPU better, so Seesaw's fewer steps should
   cost less time.
Ends with one summary table. ``--device cpu --tiny`` runs every code path on a tiny model (tests).

    python benchmarks/gpu_check.py                       # H200: ~350M GPT, bf16
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from largebatch.experiments.timing import time_interleaved  # noqa: E402
from largebatch.memory import apply_recompute, estimate, model_activation_bytes  # noqa: E402
from largebatch.models import GPT, ModelConfig, utilization  # noqa: E402
from largebatch.models.flops import measure_peak_flops  # noqa: E402
from largebatch.optim import LAMB, LANS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_step import small_shapes  # noqa: E402

MIB = 2 ** 20
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (same Hopper tensor cores as H100 SXM)
BIG = ModelConfig(n_layer=24, n_embd=1024, n_head=16, seq_len=2048, vocab_size=50304)
TINY = ModelConfig(n_layer=2, n_embd=64, n_head=2, seq_len=64, vocab_size=512)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def throughput(config: ModelConfig, micro_batch: int, recompute: str, device: torch.device,
               dtype: torch.dtype, steps: int, peak_flops: float) -> dict:
    """Train steps of the GPT (AdamW, autocast) at one recompute policy: tokens/s, MFU, memory."""
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    apply_recompute(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len), device=device)  # (b, s)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: kernels, allocator, optimizer state
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    tokens_per_s = steps * micro_batch * config.seq_len / (time.perf_counter() - start)
    dtype_bytes = 2 if dtype != torch.float32 else 4
    predicted = estimate(config, micro_batch, recompute=recompute, optimizer="adamw",
                         dtype_bytes=dtype_bytes, device=device.type)
    return {"tokens_per_s": tokens_per_s, "mfu": utilization(config, tokens_per_s, peak_flops),
            "peak_memory": peak_memory(device), "predicted_total": predicted.total,
            "predicted_activations": model_activation_bytes(
                config, micro_batch, recompute, dtype_bytes=dtype_bytes, device=device.type)}


def model_parameters(config: ModelConfig, device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return list(GPT(config).to(device).parameters())


def small_parameters(device: torch.device, tiny: bool) -> list[torch.Tensor]:
    """Many small tensors of many distinct shapes (tiny: a tenth of them)."""
    shapes = small_shapes()
    shapes = shapes[:200] + shapes[2000:2020] if tiny else shapes
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]


def optimizer_step_times(params: list[torch.Tensor], device: torch.device, rounds: int, fused: bool
                         ) -> tuple[dict[str, float], dict[str, float]]:
    """Median step seconds of each optimizer on ``params``, interleaved per round, and each one's first
    step (state allocation; compilation for the fused paths): the default (foreach) paths and, with
    ``fused``, the torch.compile'd ones."""
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {"AdamW(foreach=True)": torch.optim.AdamW(params, lr=1e-6, foreach=True),
                  "LAMB": LAMB(params, lr=1e-6), "LANS": LANS(params, lr=1e-6)}
    if fused:  # (their peer only with them)
        optimizers.update({"AdamW(fused=True)": torch.optim.AdamW(params, lr=1e-6, fused=True),
                           "LAMB(fused=True)": LAMB(params, lr=1e-6, fused=True),
                           "LANS(fused=True)": LANS(params, lr=1e-6, fused=True)})
    first = {}
    for name, optimizer in optimizers.items():  # state allocation and compilation, untimed
        start = time.perf_counter()
        optimizer.step()
        sync(device)
        first[name] = time.perf_counter() - start
    print(f"  optimizer warm-up (state, compilation): {sum(first.values()):.1f} s", flush=True)
    times = time_interleaved({name: opt.step for name, opt in optimizers.items()}, rounds, device)
    return {name: statistics.median(t) for name, t in times.items()}, first


def optimizer_rows(times: dict[str, float], first: dict[str, float], default_target: str) -> list[list[str]]:
    """One row per optimizer: its step time, the ratio to its peer with the target, its first step."""
    rows = []
    for name, t in times.items():
        peer = "AdamW(fused=True)" if "fused" in name else "AdamW(foreach=True)"
        target = {"LAMB": default_target, "LANS": default_target, "LAMB(fused=True)": "<= 2x",
                  "LANS(fused=True)": "<= 2x"}.get(name, "")
        rows.append([name, f"{1e3 * t:.2f}", f"{t / times[peer]:.2f}x {peer}", target, f"{first[name]:.1f}"])
    return rows


def seesaw_vs_cosine(config: ModelConfig, device: torch.device, bf16: bool, total_tokens: int,
                     batch: int, micro_batch: int, vocab: int, peak_flops: float) -> dict[str, dict]:
    """Trainer runs at equal tokens: AdamW + cosine vs AdamW + Seesaw r=1/2 from the same batch, with
    the check's peak (each run would measure its own, ~2.5 s on CPU) and no per-run plots (their
    summaries are what is compared)."""
    from largebatch.train.config import load_config
    from largebatch.train.loop import Trainer

    shared = {f"model.{k}": getattr(config, k) for k in ("n_layer", "n_embd", "n_head", "seq_len")}
    shared.update({"data.vocab_size": vocab, "run.total_tokens": total_tokens,
                   "run.micro_batch": micro_batch, "run.device": device.type,
                   "run.dtype": "bf16" if bf16 else "fp32", "run.tensorboard": False,
                   "run.progress": "off", "run.sample_tokens": 0, "run.eval_every_tokens": total_tokens,
                   "run.eval_tokens": config.seq_len * micro_batch, "optim.name": "adamw",
                   "schedule.peak_lr": 1e-3, "schedule.batch_size": batch, "run.peak_flops": peak_flops,
                   "run.plots": False})
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("constant", "seesaw"):
            cfg = load_config(None, {**shared, "schedule.batch_policy": policy})
            summary = Trainer(cfg, os.path.join(tmp, policy), log=lambda *_: None).fit()
            out["cosine" if policy == "constant" else "seesaw r=1/2"] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU test of the code paths)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 4 (tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; tiny 1)")
    parser.add_argument("--no-fused", action="store_true",
                        help="skip LAMB/LANS(fused=True) (their compilation; the CPU test skips them)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; this check measures on a GPU (the CPU "
                     "test of its code paths: --device cpu --tiny --no-fused)")
    config, micro_batch = (TINY, 2) if args.tiny else (BIG, 4)
    micro_batch = args.micro_batch or micro_batch
    steps = args.steps or (1 if args.tiny else 5)
    bf16 = device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    peak = H200_BF16_PEAK if device.type == "cuda" else measure_peak_flops(device, dtype)
    n_params = sum(p.numel() for p in GPT(config).parameters())
    print(f"torch {torch.__version__}, {device} ({torch.cuda.get_device_name(device) if bf16 else 'cpu'})"
          f", {'bf16' if bf16 else 'fp32'}, GPT {n_params / 1e6:.1f}M params, seq {config.seq_len}, "
          f"micro-batch {micro_batch}, peak {peak / 1e12:.3f} TFLOP/s", flush=True)
    rows = []
    for attention in ("sdpa", "explicit"):
        for recompute in ("none", "selective", "full"):
            name = f"{attention}/{recompute}"
            try:
                r = throughput(config.replace(attention=attention), micro_batch, recompute, device,
                               dtype, steps, peak)
            except torch.cuda.OutOfMemoryError:
                rows.append([name, "OOM", "", "", "", ""])
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            measured = "n/a" if r["peak_memory"] is None else f"{r['peak_memory'] / MIB:,.0f}"
            rows.append([name, f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%", measured,
                         f"{r['predicted_total'] / MIB:,.1f}", f"{r['predicted_activations'] / MIB:,.1f}"])
            print("  throughput", " | ".join(rows[-1]), flush=True)
    print_table(["attention/recompute", "tokens/s", "MFU", "peak MiB (measured)",
                 "model total MiB", "model activations MiB"], rows)
    rounds = 3 if args.tiny else 10
    for case, params, target in (("model", model_parameters(config, device), "<= 1.3x"),
                                 ("small tensors", small_parameters(device, args.tiny), "<= 1.5x")):
        times, first = optimizer_step_times(params, device, rounds, fused=not args.no_fused)
        print_table([f"optimizer ({case})", "step ms", "ratio", "target", "first step s"],
                    optimizer_rows(times, first, target))
    runs = seesaw_vs_cosine(config, device, bf16,
                            total_tokens=(16 if args.tiny else 64) * config.seq_len * 8,
                            batch=4 if args.tiny else 8, micro_batch=micro_batch,
                            vocab=512 if args.tiny else 8192, peak_flops=peak)
    cosine_s = runs["cosine"]["train_seconds"]
    print_table(["schedule", "steps", "train s", "tokens/s", "vs cosine time", "final val loss"],
                [[n, str(s["steps"]), f"{s['train_seconds']:.1f}", f"{s['tokens_per_s']:,.0f}",
                  f"{s['train_seconds'] / cosine_s:.2f}x", f"{s['final_val_loss']:.4f}"]
                 for n, s in runs.items()])
    return 0


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
