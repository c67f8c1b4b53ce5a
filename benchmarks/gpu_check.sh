#!/usr/bin/env bash
# One-process GPU check for one H200, <= 10 minutes in all (each part under its own timeout, every
# timeout cut to what is left of 570 s): bf16 tokens/s, MFU and peak memory of
# a ~350M GPT at seq 2048 under none/selective/full recompute with SDPA and explicit attention, next
# to the memory model; LAMB/LANS step time vs torch.optim.AdamW on the GPT's shapes and on 2000 small
# tensors of 200 distinct shapes (with the fused paths' first-step compile time); Seesaw vs cosine
# wall-clock at equal tokens; the trainer's step time with device reads every step vs deferred to
# the log (benchmarks/step_sync.py); LAMB/LANS/LARS captured in a CUDA graph with a tensor LR
# (benchmarks/capturable_graph.py). Prints one summary table per part. The same code runs on CPU with
#   PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --tiny --no-fused   (tests/test_experiments_floor.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
echo "gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') $(git rev-parse --short HEAD 2>/dev/null || true)"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): this script measures on a" \
       "GPU. The CPU test of its code paths: PYTHONPATH=src python benchmarks/gpu_check.py --device cpu" \
       "--tiny --no-fused" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
TOTAL_S=570  # one lent machine's command runs at most 600 s: the parts share this, in order
timeout() {  # timeout SECONDS CMD...: the part's own limit, or what is left of TOTAL_S if less
  local left=$((TOTAL_S - SECONDS))
  if [ "$left" -le 5 ]; then echo "gpu_check: out of time before: ${*:2:3}" >&2; return 0; fi
  command timeout "$(( $1 < left ? $1 : left ))" "${@:2}" || echo "gpu_check: part failed or timed out (rc $?): ${*:2:3}" >&2
}
timeout 300 "$PYTHON" benchmarks/gpu_check.py --device cuda "$@"
# the trainer's step reading the device every step vs only when it logs (what only a GPU shows:
# the host stops queueing kernels at each read); the CPU run of the same script shows equal times
timeout 120 "$PYTHON" benchmarks/step_sync.py --device cuda --layers 12 --embd 768 --steps 20
# run.on_nonfinite = "skip" decided on the device, on the device (run.device = auto picks it): no host
# read in a step that does not log, and a non-finite step taken back bit for bit, for LAMB/LANS
# (capturable) and torch's AdamW, fused and default (foreach on a GPU: host step counters)
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_train_skip.py tests/test_train_step.py
# run.dtype = fp16 on the device: dynamic loss scaling (an overflow taken back with no host read, the
# unscaled gradient against fp32's, the scale carried across a resume; CPU: docs/training.md,
# "Precision"), then fp16 against bf16 tokens/s on the same short run (an fp16 step also keeps a copy of
# the parameters and optimizer state to take an overflow back)
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_train_fp16.py
for dt in bf16 fp16; do
  timeout 120 "$PYTHON" -m largebatch train gpt-demo --run.device=cuda --run.dtype=$dt --run.total_tokens=400000 \
    --run.sample_tokens=0 --run.plots=false --run.tensorboard=false --run.progress=off \
    --run.out_dir="$(mktemp -d)" | grep -E "^(validation loss|throughput|loss scale)"
done
# LAMB/LANS/LARS with capturable=True and a 0-d device tensor LR captured in a CUDA graph and replayed
# against eager steps (a host read in the step would make the capture fail; CPU test of the logic:
# tests/test_optim_capturable.py)
timeout 60 "$PYTHON" benchmarks/capturable_graph.py
# run.async_checkpoint on a GPU: a save holds the loop for the device-to-host copy only (CPU run of
# the same script: docs/training.md, "Checkpoints in the background")
timeout 90 "$PYTHON" benchmarks/checkpoint_async.py --device cuda --rounds 2
# run.profile_steps on a GPU: device kernels in the trace, the operators table by device time, the
# allocator's history written (the CPU run of the same script: docs/training.md, "Profiling steps")
timeout 90 "$PYTHON" benchmarks/profile_steps.py --device cuda --memory
# the peak of a training step against the memory model's stored activations + backward working set
# (docs/memory.md): on CPU the loss's backward held three fp32 copies of the logits; measured here on
# the device, in fp32 and bf16, with torch.cuda.max_memory_allocated()
timeout 120 "$PYTHON" benchmarks/step_peak_memory.py --device cuda --scale 4
timeout 120 "$PYTHON" benchmarks/step_peak_memory.py --device cuda --dtype bf16 --scale 4
# a short compiled bf16 run: the summary's tokens/s over the whole run (the first step's compilation
# included) against its rate after the first step (tests/test_train_reports.py checks the latter
# against the records on CPU); on 4 CPU ranks a compiled run reported 362 against ~3,200 tokens/s
timeout 240 "$PYTHON" -m largebatch train gpt-demo --run.device=cuda --run.dtype=bf16 --run.compile=true \
  --run.total_tokens=400000 --run.sample_tokens=0 --run.plots=false --run.tensorboard=false \
  --run.progress=off --run.out_dir="$(mktemp -d)" | grep -A1 "^throughput"
# run.ema_decay on a GPU: the weight average's update (a device step count, one multi-tensor lerp with
# 0-d device weights, no host read) against torch's AveragedModel and a LAMB step (the CPU run:
# docs/training.md, "Weight averaging"); then its tests on the device (run.device = auto picks it)
timeout 120 "$PYTHON" benchmarks/weight_average.py --device cuda
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_train_ema.py
# the Llama-style layers against GPT-2's on the device: step time (bf16, SDPA) and one layer's kept
# bytes, measured against the memory model, which counts torch's fused fp32 RMSNorm kernel on a GPU as
# keeping its input only (not measurable on CPU; the CPU run: docs/memory.md, "Llama-style layers")
timeout 120 "$PYTHON" benchmarks/llama_layers.py --device cuda --dtype bf16 --attention sdpa
timeout 120 "$PYTHON" benchmarks/llama_layers.py --device cuda --dtype fp32 --attention sdpa
# model.document_mask and model.sliding_window on the device: SDPA with a mask cannot take FlashAttention
# (torch picks the memory-efficient kernel, which reads the mask), so the step-time ratio to the unmasked
# GPT is measured here, with the one mask's bytes against the memory model (the CPU run: docs/models.md);
# s = 1000 is no multiple of 8, so the kernel would copy the mask in every layer unless its padded rows hold
timeout 120 "$PYTHON" benchmarks/document_mask.py --device cuda --dtype bf16 --seq-len 1000 --rounds 5
# generation with the KV cache on the device against transformers' generate on the same weights and the
# cache-less loop (the CPU run: docs/models.md, "Generating text"); then its tests there
timeout 180 "$PYTHON" benchmarks/generate.py --device cuda --seq-len 1024 --prompt 512 --new 256 --rounds 3
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_generate.py
