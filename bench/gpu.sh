#!/usr/bin/env bash
# The scale and rollout benchmarks on one GPU, in one go (a borrowed accelerator is held by the minute):
#   bash bench/gpu.sh OUTDIR   ->  OUTDIR/scale_gpu.json, rollout_gpu.json, scale_gpu_bf16.json,
#                                  scale_gpu_command_buffers.json
# Needs JAX with CUDA and the engine's Python dependencies importable by $PYTHON (default python3);
# the rollout peer needs Tunix importable by the same Python. Each stage has its own time limit, and a
# stage that fails leaves the others' files. The _gpu JSONs in bench/results came from this script.
set -u
out=${1:?usage: bash bench/gpu.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
# A dry run of this script's paths on a machine without a GPU: PLATFORM=cpu SCALE_ARGS="--model-preset tiny".
platform=${PLATFORM:-gpu}
scale_args=${SCALE_ARGS:-}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# Each engine process takes the GPU memory it uses, not 75% up front: the rollout bench runs two
# processes side by side, and `memory/device_peak_gib` is then the allocator's true high-water mark.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
work=$(mktemp -d)
note="one GPU lent for this script; nothing else ran on it"

stage() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: start $(date -u +%T), limit ${limit}s"
  timeout "$limit" "$@"
  local status=$?
  echo "== $name: exit $status at $(date -u +%T)"
  return $status
}

# The limits again into a copy of scale_gpu.json (--limits-only adds to a recorded run), moved into
# OUTDIR only when they were measured: a failed variant leaves no file that reads like a result.
limits_variant() {
  local name=$1 file=$2
  shift 2
  cp "$out/scale_gpu.json" "$work/$file" &&
    stage "$name" 90 "$py" bench/scale.py --platform "$platform" --limits-only --work "$work" $scale_args --out "$work/$file" \
      --load-note "$note" "$@" &&
    mv "$work/$file" "$out/$file"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
"$py" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

# The 0.6B run: limits (bandwidth, matmul peak, the decode loop timed alone) and 2 rounds of `locojax train`.
stage scale 300 "$py" bench/scale.py --platform "$platform" --no-rest --no-peer --rounds 2 --steps 3 $scale_args \
  --work "$work" --out "$out/scale_gpu.json" --load-note "$note"
stage rollout 120 "$py" bench/rollout.py --platform "$platform" --peer-python "$py" --rounds 5 --out "$out/rollout_gpu.json"
# The limits again in bfloat16 (half the bytes a decode step reads), then in float32 with the while
# loop's body captured as a CUDA graph: what launching ~20 kernels a layer a token costs.
if [ -f "$out/scale_gpu.json" ]; then
  limits_variant limits-bf16 scale_gpu_bf16.json --dtype bfloat16
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    limits_variant limits-command-buffers scale_gpu_command_buffers.json
fi
rm -rf "$work"
