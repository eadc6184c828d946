#!/usr/bin/env bash
# One command for a GPU machine: the GPU tests (Pallas kernels compiled for real, parity with
# their references), the kernel benchmark, and the latency, throughput and serving benchmarks on
# a Llama-3-8B-shaped model with random bf16 weights (gpu_memory_utilization 0.9).
# Results go under benchmarks/results, or, when OUT is set (the device tool brings $OUT back),
# into one archive in $OUT that is refreshed after every step. SUITE_MODEL / SUITE_SCALE=small shrink it for a dry run on a CPU
# (tests/benchmarks/test_gpu_suite.py runs the latency, host, throughput and serve stages so in CI).
# Stages can be named to run a part (the device tool stops a command after 10 minutes, and the
# compilation cache under .cache/ carries over between calls on a warm machine):
#   benchmarks/gpu_suite.sh [tests] [launches] [kernels] [latency] [host] [throughput] [serve] [startup]
#   (default: all)
# STEP_TIMEOUT=SECONDS stops any one step after that long, so that a call with little device
# time left still reaches the later steps (what a stopped step measured is in the log).
set -uo pipefail
cd "$(dirname "$0")/.."
# The GPU image lacks some of our dependencies (starlette, uvicorn, pydantic, ...) and reaches
# no registry: carry them as wheels in .whl/ (see the device tool's README) and they go in here.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# SUITE_RESULTS: where the results go before they are archived (a dry run's own folder)
RESULTS="${SUITE_RESULTS:-${OUT:+/tmp/gpu_suite_results}}"
RESULTS="${RESULTS:-benchmarks/results}"
mkdir -p "$RESULTS"
MODEL="${SUITE_MODEL:-benchmarks/configs/llama-3-8b}"
STAMP="$(date -u +%Y-%m-%d)"
DEVICE="$(python3 -c 'import jax; d = jax.devices()[0]; print(d.device_kind.replace(" ", "-"))' 2>/dev/null || echo unknown)"
TAG="${STAMP}_${DEVICE}"
# a compilation cache inside the checkout survives between calls on the same machine
export JAXLLM_COMPILATION_CACHE_DIR="${JAXLLM_COMPILATION_CACHE_DIR:-$PWD/.cache/xla}"
LOG="$RESULTS/gpu_suite_${TAG}.log"
status=0
STAGES="${*:-tests launches kernels latency host throughput serve startup}"
want() { [[ " $STAGES " == *" $1 "* ]]; }

if [ "${SUITE_SCALE:-full}" = small ]; then
  MAX_LEN=256
  # a small KV cache too: a dry run shares its machine (CI runs it beside other tests)
  KV=(--kv-cache-memory-bytes 67108864)
  ENGINE=(--model "$MODEL" --load-format dummy --max-model-len "$MAX_LEN" --max-num-seqs 8
          --max-num-batched-tokens 64 "${KV[@]}")
  N_THROUGHPUT=8; N_SERVE=8; CONC=1,4; BATCH=4; KGRID=small; IN_LEN=64; OUT_LEN=16
  HOST=(--max-model-len "$MAX_LEN" --max-num-seqs 8 --max-num-batched-tokens 64 "${KV[@]}")
  HOST_BATCH=4,8
  STARTUP=(--max-model-len "$MAX_LEN" --max-num-seqs 4 --max-num-batched-tokens 32
           --warm-runs 1 --load-runs 1 "${KV[@]}")  # the default model: GGUF vs Orbax
else
  MAX_LEN=4096
  ENGINE=(--model "$MODEL" --load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.9
          --max-model-len "$MAX_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192)
  N_THROUGHPUT=1000; N_SERVE=400; CONC=16,64,256; BATCH=32; KGRID=full; IN_LEN=512; OUT_LEN=64
  HOST=(--dtype bfloat16 --gpu-memory-utilization 0.5 --max-model-len 1024 --max-num-seqs 256
        --max-num-batched-tokens 8192); HOST_BATCH=8,64,256
  # start-to-ready and weight loading of a 1B shape: safetensors vs Orbax, cold and warm
  STARTUP=(--random-checkpoint benchmarks/configs/llama-3.2-1b --dtype bfloat16
           --max-model-len "$MAX_LEN" --max-num-seqs 64 --max-num-batched-tokens 2048)
fi

step() {  # step NAME CMD...: run, log, remember failures, go on
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-0}" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
  pack
}

pack() {  # the device tool brings back at most 8 files, and nothing of a run it had to stop
  # unless it is already under $OUT: keep one archive of everything so far up to date there
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/gpu_suite_${TAG}.tar.gz.tmp" -C "$RESULTS" . \
    && mv "$OUT/gpu_suite_${TAG}.tar.gz.tmp" "$OUT/gpu_suite_${TAG}.tar.gz"
}

{ nvidia-smi || true; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } 2>&1 | tee -a "$LOG"

if want tests; then
  if [ "${SUITE_SCALE:-full}" = small ]; then  # no GPU: the kernels in interpret mode
    step "kernel tests" python3 -m pytest -q tests/kernels/test_kernels.py \
      tests/kernels/test_mosaic_kernels.py
  else
    step "gpu tests" env JAXLLM_GPU_TESTS=1 python3 -m pytest -q tests/kernels/test_kernels.py \
      tests/kernels/test_mosaic_kernels.py
  fi
fi
# how each step program reaches this GPU (command buffers, and the launches and branches left
# outside them) as this machine's driver has XLA build it; nothing runs
if want launches && [ "${SUITE_SCALE:-full}" != small ]; then
  step "launches" python3 -m jaxllm.cli bench aot --on-device --skip-kernels --model "$MODEL" \
    --steps 256x256,1x1 --results-dir "$RESULTS" --tag "launches_${TAG}"
fi
want kernels && step "kernel benchmark" python3 -m jaxllm.cli bench kernels --grid "$KGRID" \
  --sweep --results-dir "$RESULTS" --tag "kernels_${TAG}"
# an int8 cache: the Mosaic kernels' dequantising stage against Triton's scales in the kernel
want kernels && step "kernel benchmark, int8 cache" python3 -m jaxllm.cli bench kernels \
  --grid "$KGRID" --kv-cache-dtype int8 --results-dir "$RESULTS" --tag "kernels_int8_${TAG}"
want latency && step "latency" python3 -m jaxllm.cli bench latency "${ENGINE[@]}" \
  --input-len "$IN_LEN" --output-len "$OUT_LEN" --batch-size "$BATCH" --num-iters 3 \
  --results-dir "$RESULTS" --tag "latency_${TAG}"
# the host's exposed time per decode step where the device is another chip: the default
# model's shape (SmolLM2-135M, random weights: its GGUF is too big to carry), whose steps are
# short enough that host work would show
want host && step "host overhead (SmolLM2-135M shape)" python3 -m jaxllm.cli bench latency \
  --model benchmarks/configs/smollm2-135m --load-format dummy "${HOST[@]}" --input-len 128 \
  --output-len 64 --batch-size "$HOST_BATCH" --num-iters 3 --results-dir "$RESULTS" \
  --tag "latency_host_smollm2-135m_${TAG}"
want throughput && step "throughput (ShareGPT-like mix)" python3 -m jaxllm.cli bench throughput \
  "${ENGINE[@]}" --dataset-name sharegpt --num-prompts "$N_THROUGHPUT" --no-hf-baseline \
  --results-dir "$RESULTS" --tag "throughput_sharegpt_${TAG}"

if want serve; then
  PORT=8765
  python3 -m jaxllm.cli serve "${ENGINE[@]}" --port "$PORT" --log-interval 30 \
    > "$RESULTS/serve_server_${TAG}.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health/ready" > /dev/null && break
    kill -0 "$SERVER" 2> /dev/null || break
    sleep 1
  done
  step "serving" python3 -m jaxllm.cli bench serve --base-url "http://127.0.0.1:$PORT" \
    --dataset-name sharegpt --num-prompts "$N_SERVE" --max-concurrency "$CONC" --ignore-eos \
    --max-model-len "$MAX_LEN" --vocab-size 32000 --save-result --plot --results-dir "$RESULTS" \
    --tag "serve_sharegpt_${TAG}"
  kill -TERM "$SERVER" 2> /dev/null
  wait "$SERVER"
fi

want startup && step "startup" python3 -m jaxllm.cli bench startup "${STARTUP[@]}" \
  --results-dir "$RESULTS" --tag "startup_${TAG}"

echo "results in $RESULTS (status $status)" | tee -a "$LOG"
pack
if [ -n "${OUT:-}" ]; then
  cp "$LOG" "$OUT/"
fi
exit $status
