#!/usr/bin/env bash
# The engine on one TPU chip against Tunix, stage by stage (issue 37):
#   bash bench/tpu.sh OUTDIR [STAGE ...]         (no STAGE: all of them, in the order below)
# Runs on a TPU VM with the project checked out. Each stage has its own time limit and writes its
# part, OUTDIR/part_<stage>.json, headed with the commit ($LOCOJAX_BENCH_COMMIT where set, else git), the UTC
# date, the platform and device kind it measured; a stage that fails leaves the others' files. A full
# refresh may span several sessions: commit the parts under bench/results/tpu_parts/, then
# `python3 bench/tpu_merge.py bench/results/tpu_parts` writes bench/results/grpo_step_tpu.json and
# scale_tpu.json (parts of different commits are marked so). Stage logs end in OUTDIR/logs-HHMMSS.tar.gz.
#
# Stages, with their wall time expected on a TPU v5e (cold compiles, as measured at 905e03a) and limit:
#   install      ~1.5 min (limit 4 min): the engine's packages (and the test stage's: pytest-timeout,
#                sqlalchemy, transformers, torch from $TORCH_WHEELS) into $TARGETS/engine and Tunix's
#                into $TARGETS/peer, in parallel; skipped where already done (a warm machine keeps /tmp).
#                From $LOCAL_INDEX (a local "simple" index folder) plus the wheel folder $WHEELS
#                (bench/tpu_wheels.sh, default .whl-tpu), else from pip's configured index.
#   tests        ~3 min (6 min): the engine's numerics tests on the chip in one pytest process -> part_tests
#   size-a       ~4.5 min (9 min): bench/grpo_step.py size a, 2 rounds per side + 3 profiled steps
#   size-b       ~5 min (9 min): size b, likewise
#   size-c-rows  ~7.5 min (9 min): size c's rows search (each side's largest rows, then the rows both fit)
#   size-c1      ~6 min (9 min): size c, one round per side at the rows both fit (from the search part)
#   size-c2      ~6 min (9 min): the same, the peer first: c's second round on each side
#   scale        ~6.5 min (9 min): bench/scale.py at Qwen3-0.6B bf16, 128 rows (trained as micro-batches of
#                SCALE_MICRO=16 rows under remat SCALE_REMAT=dots): 2 rounds of `locojax train`
#                (the first with an empty compilation cache, the second from it), a profiled run, the
#                runs' files in OUTDIR/scale_runs.tar.gz
#   limits       ~4 min (9 min): bench/scale.py's limits at the same batch (HBM bandwidth, bf16 matmul
#                peak, the decode loop timed alone)
#   placement-runs ~7 min (9 min): six `locojax train` runs of the small preset at two widths and two
#                vocabulary sizes, the byte-level 384 and Qwen3's 151,936 (PLACEMENT_CONFIGS,
#                dtype:remat:prompts:group:prompt:new[:model]), each run's files (placement_runK.tar.gz) in
#                OUTDIR/placement_runs.tar.gz, for the placement model's out-of-sample TPU calibration
#                (bench/placement_tpu.py predict); not in the default list
#   placement-depth ~4 min (9 min): three more (placement_run7..9, in OUTDIR/placement_depth_runs.tar.gz):
#                12 layers instead of 4, so per-layer costs are told from per-token ones (not in the default list)
#   placement-width ~5 min (9 min): four more (placement_run10..13, in OUTDIR/placement_width_runs.tar.gz):
#                the small preset widened to 768 with Qwen3's head shape (head_dim 128, two query heads per KV
#                head) and vocabulary, 4 and 12 layers, bf16 and f32: a width between the small runs' 512 and
#                Qwen3-0.6B's 1024, so the fit meets large vocabularies and long layers where weights and
#                cache, not launches, set the decode (not in the default list)
#   lora-1.7b    ~8 min (9 min): bench/grpo_step.py --size lora (issue 40): LoRA rank 16 on every linear layer
#                of a bfloat16 Qwen3-1.7B against Tunix's (qwix) LoRA, 96 + 256 tokens, the largest rows <= 64 both
#                fit, 2 rounds; not in the default list (LORA_ARGS="--peer-at-our-rows --rounds 1": the peer first
#                tries our largest rows, for its own error there, which costs it one failed run)
#   lora-4b      ~7 min (9 min): the same at Qwen3-4B, 1 round, our side in micro-batches of 16 rows (the same
#                update; at a46af8b the plan refused the whole 64-row batch's train step, 14.54 GiB of 14.17, and
#                fit 48; in micro-batches 64 ran at e931e0a); not in the default list
#   lora-rollout ~5 min (9 min): our side alone at Qwen3-1.7B LoRA, 16 rows (LORA_ROLLOUT_ROWS), model.lora.rollout
#                adapters and merged alternating (A M M A, one run and part each, --peer none): whether folding
#                the adapters in once per rollout beats the low-rank path at every decode step; the merge sets
#                each setting against lora-1.7b's peer runs; not in the default list
#   full-ft      ~5 min (9 min): bench/full_ft.py (issue 40): full fine-tuning (bfloat16, remat full, LoRA's 96 + 256
#                tokens, 64 rows) of the larger of qwen3-1.7b and -0.6b the memory plan lets run, tried largest
#                first; each refusal and the run that fits (its peak against the plan) -> part_full-ft.json; not in
#                the default list
#   memory-timeline ~5 min (9 min): bench/tpu_memory_timeline.py, one process per workload
#                (MEMORY_TIMELINE_WORKLOADS, default "lora16 c16 bf16-128 lora64 b lora4b-24"): when the
#                device's in-use and reserved bytes peak, phase by phase, beside the compiled plan's terms ->
#                timeline_<workload>.json (issues 37 and 40's peak_device_vs_plan); not in the default list
#   train-variants ~1 min a variant (9 min): bench/scale.py's batch, one `locojax train` round (3 steps) per
#                TRAIN_VARIANTS entry, remat:micro_batch_size (default "full: dots:32 full:32 dots:16 none:16";
#                an empty size: the engine's default) -> variant_<remat>_<size>.json: what each remat policy
#                and micro-batching cost the train step (issue 37's train_vs_matmul_peak); not in the default list
#   merge        seconds: bench/tpu_merge.py over OUTDIR's parts into OUTDIR (MERGE_OUT): also lora_tpu.json
# Each stage fits one 10-minute command with the machine warm and installed; on a fresh machine run
# `install` (with `tests`) first. Nothing is pip-installed after the install stage.
#
# Settings (environment): PYTHON (python3); PLATFORM (tpu; `cpu` dry-runs every stage here);
# LOCAL_INDEX, WHEELS, TORCH_WHEELS (above); C_ROWS or C_ROWS_PART (size-c1/c2's rows where OUTDIR does
# not hold the size-c-rows part, e.g. an OUTDIR emptied between commands); TARGETS (/tmp/locojax-tpu);
# WORK (/tmp/locojax-tpu/work: the 0.6B inputs, which size c builds once per machine); COMMAND_S (below);
# LOCOJAX_BENCH_COMMIT (the commit measured: set it where the checkout is a copy, its .git may be stale);
# SCALE_ARGS, GRPO_ARGS, C_ARGS, LORA_ARGS, FULL_FT_ARGS (extra arguments of bench/scale.py, of every grpo stage,
#   of size c's, of the lora stages', of bench/full_ft.py;
#   a dry run here: PLATFORM=cpu SCALE_ARGS="--model-preset tiny" C_ARGS="--model-preset small --max-prompts 2").
set -u
out=${1:?usage: bash bench/tpu.sh OUTDIR [STAGE ...]}
shift
stages=${*:-install tests size-a size-b size-c-rows size-c1 size-c2 scale limits merge}
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
platform=${PLATFORM:-tpu}
targets=${TARGETS:-/tmp/locojax-tpu}
work=${WORK:-$targets/work}
wheels=${WHEELS:-$root/.whl-tpu}
# One command on the TPU machine may run 10 minutes: stages start only within COMMAND_S of this script's
# start and are cut to what is left of it (default 570 s on a TPU, no limit elsewhere; 0: none).
command_s=${COMMAND_S:-$([ "$platform" = tpu ] && echo 570 || echo 0)}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 LOCOJAX_BENCH_COMMIT=${LOCOJAX_BENCH_COMMIT:-}
mkdir -p "$work"

# The machine's own packages (its JAX) stay first; the checkout, then the engine's target after them.
# The peer gets the machine's packages and its own target only (its pins differ).
base=${PYTHONPATH:-}
engine_path=$base${base:+:}$root:$targets/engine
peer_path=$base${base:+:}$targets/peer
peer_python=${PEER_PYTHON:-$py}
export PYTHONPATH=$engine_path

ENGINE_PACKAGES="flax optax orbax-checkpoint pydantic pyyaml typer rich tokenizers safetensors math-verify pyarrow tensorboard"
# The tests stage's: tests/conftest.py imports sqlalchemy; pyproject's addopts need pytest-timeout;
# the HF parity tests need transformers and torch (a CPU build, only from $TORCH_WHEELS).
TEST_PACKAGES="sqlalchemy pytest-timeout transformers"
PEER_PACKAGES="google-tunix==0.1.7"

stage() {  # NAME LIMIT_S COMMAND ... (a program or one of the functions below, exported to the shell timeout runs)
  local name=$1 limit=$2
  shift 2
  if [ "$command_s" -gt 0 ]; then  # the whole command's limit binds too
    local left=$((command_s - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 60 ]; then
      echo "== $name: not started, ${left}s of this command's ${command_s}s left (COMMAND_S)"
      return 1
    fi
  fi
  export stage_limit=$limit
  echo "== $name: start $(date -u +%T), limit ${limit}s"
  timeout "$limit" bash -c '"$@"' "$name" "$@" > >(tee "$out/logs/$name.log") 2>&1
  local status=$?
  echo "== $name: exit $status at $(date -u +%T)"
  return $status
}

install_into() {  # TARGET WHEEL_SUBFOLDER PACKAGE ...
  local target=$1 folder=$2
  shift 2
  local stamp="$*|${LOCAL_INDEX:-configured index}|$(ls "$wheels/$folder" 2>/dev/null | tr '\n' ' ')"
  if [ -f "$target/.installed" ] && [ "$(cat "$target/.installed")" = "$stamp" ]; then
    echo "$target: already installed"
    return 0
  fi
  rm -rf "$target"
  local links=()
  [ -d "$wheels/$folder" ] && links+=(--find-links "$wheels/$folder")
  [ -n "${TORCH_WHEELS:-}" ] && links+=(--find-links "$TORCH_WHEELS")
  local started=$SECONDS
  if [ -n "${LOCAL_INDEX:-}" ]; then  # that index's versions (e.g. transformers 5.17), not constraints.txt's
    PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated --quiet --disable-pip-version-check --no-compile \
      --no-cache-dir --only-binary=:all: --index-url "file://$LOCAL_INDEX" "${links[@]}" --target "$target" "$@"
  else  # the engine at the project's pins; the peer at what Tunix 0.1.7 resolves to
    local pins=()
    [ "$folder" = engine ] && pins=(-c "$root/constraints.txt")
    "$py" -m pip install --quiet --disable-pip-version-check --no-compile --target "$target" "${links[@]}" \
      "${pins[@]}" "$@"
  fi || return 1
  echo "$stamp" > "$target/.installed"
  echo "$target: installed in $((SECONDS - started)) s"
}

install() {
  local engine="$ENGINE_PACKAGES $TEST_PACKAGES"
  [ -n "${TORCH_WHEELS:-}" ] && engine="$engine torch"
  # shellcheck disable=SC2086
  install_into "$targets/engine" engine $engine > "$out/logs/install-engine.log" 2>&1 &
  local engine_pid=$!
  # shellcheck disable=SC2086
  install_into "$targets/peer" peer $PEER_PACKAGES > "$out/logs/install-peer.log" 2>&1 &
  local peer_pid=$!
  wait $engine_pid
  local engine_status=$?
  wait $peer_pid
  local peer_status=$?
  tail -n 3 "$out/logs/install-engine.log" "$out/logs/install-peer.log"
  "$py" -c "import jax, flax, optax, orbax.checkpoint, math_verify, tokenizers; print('engine imports: jax', jax.__version__, 'flax', flax.__version__)" &&
    PYTHONPATH=$peer_path "$peer_python" -c "import tunix, safetensors, transformers; print('peer imports: tunix, safetensors', safetensors.__version__, 'transformers', transformers.__version__)" &&
    [ $engine_status -eq 0 ] && [ $peer_status -eq 0 ]
}

grpo() {  # STAGE SIZE ARGS ...
  local name=$1 size=$2
  shift 2
  # shellcheck disable=SC2086
  # The runs' budget: the stage's limit less a minute for the part, the chip's release and the merge of logs.
  "$py" bench/grpo_step.py --platform "$platform" --size "$size" --stage "$name" --budget-s $((stage_limit - 60)) \
    --side-timeout 420 --peer-python "$peer_python" --peer-path "$peer_path" --logs "$out/logs/$name-sides" \
    --out "$out/part_$name.json" ${GRPO_ARGS:-} "$@"
}

lora_rollout() {  # issue 40: our side alone at the rows both fit (16), model.lora.rollout adapters and merged
  # alternating (A M M A), each run its own part; bench/tpu_merge.py sets each setting against the peer's
  # runs of the lora-1.7b part.
  local started=$SECONDS index=0 rollout left failed=0
  for rollout in adapters merged merged adapters; do
    left=$((stage_limit - 30 - (SECONDS - started)))
    if [ "$left" -lt 100 ]; then
      echo "lora-rollout: $rollout (run $index) not started, ${left}s of the stage left"
      failed=1
      break
    fi
    # shellcheck disable=SC2086
    "$py" bench/grpo_step.py --platform "$platform" --size lora --stage "lora-rollout-$index-$rollout" \
      --budget-s "$left" --side-timeout 300 --peer none --rows "${LORA_ROLLOUT_ROWS:-16}" --rounds 1 \
      --profile-steps 0 --lora-rollout "$rollout" --work "$work" --logs "$out/logs/lora-rollout-$index-sides" \
      --out "$out/part_lora-rollout-$index-$rollout.json" ${GRPO_ARGS:-} ${LORA_ARGS:-} || failed=1
    index=$((index + 1))
  done
  return $failed
}

memory_timeline() {  # each workload in its own process: the runtime's peak counters cover a process's life
  local failed=0 workload
  for workload in ${MEMORY_TIMELINE_WORKLOADS:-lora16 c16 bf16-128 lora64 b lora4b-24}; do
    # shellcheck disable=SC2086
    "$py" bench/tpu_memory_timeline.py "$out/timeline_$workload.json" "$workload" --work "$work" \
      ${MEMORY_TIMELINE_ARGS:-} || failed=1
  done
  return $failed
}

train_variants() {  # scale's batch under each REMAT:MICRO_BATCH_SIZE of TRAIN_VARIANTS, one `locojax train` each
  local failed=0 variant remat micro
  for variant in ${TRAIN_VARIANTS:-full: dots:32 full:32 dots:16 none:16}; do
    remat=${variant%%:*} micro=${variant#*:}
    # shellcheck disable=SC2086
    "$py" bench/scale.py --platform "$platform" --no-rest --no-peer --skip-limits --rounds 1 --steps 3 \
      $scale_shape --remat "$remat" ${micro:+--micro-batch-size $micro} --work "$work" \
      --out "$out/variant_${remat}_${micro:-whole}.json" --load-note "one TPU chip, nothing else on it" \
      ${SCALE_ARGS:-} || failed=1
  done
  return $failed
}

c_rows() {  # size c's rows: $C_ROWS, else the rows search part ($C_ROWS_PART, OUTDIR's, or a committed one)
  if [ -n "${C_ROWS:-}" ]; then
    echo "--rows $C_ROWS"
    return 0
  fi
  for part in ${C_ROWS_PART:-} "$out/part_size-c-rows.json" "$root/bench/results/tpu_parts/part_size-c-rows.json"; do
    [ -f "$part" ] && { echo "--rows-from $part"; return 0; }
  done
  echo "size c's rows: no C_ROWS, C_ROWS_PART, $out/part_size-c-rows.json or bench/results/tpu_parts/" \
    "part_size-c-rows.json; run the size-c-rows stage first" >&2
  return 1
}

# The placement model's TPU calibration (issue 41): `locojax train` runs of a small preset (never the 0.6B it
# predicts) at varied batches, dtypes and remat, each run's directory (environment.json included) packed
# in OUTDIR/placement_runK.tar.gz, all of them in OUTDIR/placement_runs.tar.gz, for `bench/placement_tpu.py predict`.
# A config's optional 7th field is its model (bench/scale.py's --model-preset: a preset, or one with some
# dimensions changed). The default calibrates from the small preset at two widths, 256 and 512, since runs
# of one width cannot tell the MFU from how it falls with width, and at two vocabulary sizes: the preset's
# byte-level 384 entries, where the work per vocabulary entry (sampling in decode, the log-softmax over
# each scored slot's logits in training) is lost in the noise, and Qwen3's 151,936, where it can be most
# of a small model's step (round 2 calibrated at 384 only, left decode_vocab_overhead_s at its floor and
# had no training term, and priced the 0.6B's bf16 step 26% low; the fit now leaves costs per vocabulary
# entry alone unless the runs hold two sizes: locojax/placement/calibration.py). The two
# real-vocabulary runs are the bf16 16x8 configuration at each width, so each pairs with a byte-vocabulary
# run that differs in the vocabulary alone (each holds 16384 slots x 16384-entry float32 logit chunks,
# ~3 GiB, as the 0.6B does). They replace round 2's float32 no-remat 8x8 64+64 run and its bf16 32x8 run
# at width 256 (neither target runs without remat; the 16- and 128-row runs at each width still vary the
# batch), which keeps six runs within the stage's 540 s: on the chip at 3618d11 they took 63-70 s each,
# mostly compiling, the real-vocabulary ones 78 and 84 s (the stage 463 s).
PLACEMENT_WIDE=d_model=512,d_ff=2048,n_heads=8,n_kv_heads=8
PLACEMENT_CONFIGS=${PLACEMENT_CONFIGS:-"bfloat16:full:16:8:64:128 float32:full:4:4:96:128 bfloat16:full:16:8:64:128:small@$PLACEMENT_WIDE float32:full:4:4:96:128:small@$PLACEMENT_WIDE bfloat16:full:16:8:64:128:small@vocab_size=151936 bfloat16:full:16:8:64:128:small@$PLACEMENT_WIDE,vocab_size=151936"}
# Depth: the same small models at 12 layers (the small preset has 4, Qwen3-0.6B 28), so the fit can
# tell per-layer costs (decode's per-layer launches, training's elementwise passes over each layer's
# activations: `train_layer_activation_s`) from per-token ones; round 3's six runs, all 4 layers deep,
# left training's matmul rate at an MFU of 0.98 and under-predicted the 0.6B. A stage of its own
# (placement-depth), its files numbered after placement-runs' (placement_run7..9).
PLACEMENT_DEPTH_CONFIGS=${PLACEMENT_DEPTH_CONFIGS:-"bfloat16:full:16:8:64:128:small@n_layers=12 bfloat16:full:16:8:64:128:small@$PLACEMENT_WIDE,n_layers=12,vocab_size=151936 float32:full:4:4:96:128:small@$PLACEMENT_WIDE,n_layers=12"}
# Width: round 3's runs (widths 256 and 512, head_dim 64) left decode priced by per-layer launches and
# the train MFU at 0.92, and missed the 0.6B by 20-26% both ways; these bring the calibration's weights
# and KV cache per token closer to the 0.6B's (a model still a third of its size, out of sample in width
# and depth), numbered after placement-depth's (placement_run10..13).
PLACEMENT_MID=d_model=768,d_ff=2304,n_heads=8,n_kv_heads=4,head_dim=128,vocab_size=151936
PLACEMENT_WIDTH_CONFIGS=${PLACEMENT_WIDTH_CONFIGS:-"bfloat16:full:16:8:64:128:small@$PLACEMENT_MID,n_layers=12 float32:full:4:4:96:128:small@$PLACEMENT_MID,n_layers=12 bfloat16:full:16:8:64:128:small@$PLACEMENT_MID float32:full:4:4:96:128:small@$PLACEMENT_MID"}
placement_runs() {  # FIRST_RUN_NUMBER TARBALL CONFIG...
  local k=$(($1 - 1)) tarball=$2 failed=0 config
  shift 2
  for config in "$@"; do
    k=$((k + 1))
    IFS=: read -r dtype remat prompts group prompt_tokens new_tokens preset <<< "$config"
    rm -rf "$targets/placement-work/run$k"
    # shellcheck disable=SC2086
    "$py" bench/scale.py --platform "$platform" --no-rest --no-peer --skip-limits --rounds 1 --steps 6 \
      --model-preset "${preset:-${PLACEMENT_PRESET:-small}}" --dtype "$dtype" --remat "$remat" --prompts "$prompts" \
      --group "$group" --prompt-tokens "$prompt_tokens" --new-tokens "$new_tokens" \
      --work "$targets/placement-work/run$k" --runs-tar "$out/placement_run$k.tar.gz" \
      --out "$out/placement_run$k.json" --load-note "one TPU chip, nothing else on it" ${PLACEMENT_ARGS:-} || failed=1
  done
  # One file back from the machine, however many runs (a device call returns a few files only).
  (cd "$out" && tar czf "$tarball" placement_run[0-9]*.json placement_run[0-9]*.tar.gz \
    && rm -f placement_run[0-9]*.json placement_run[0-9]*.tar.gz) || failed=1
  return $failed
}

export py platform targets work wheels out root peer_python peer_path ENGINE_PACKAGES TEST_PACKAGES PEER_PACKAGES
export -f install install_into grpo placement_runs lora_rollout memory_timeline train_variants
# The scale stage's batch. Its train step runs as micro-batches of 16 rows under remat dots: measured on a
# v5e at e7d7426 (train-variants), the whole 128 rows under remat full trained in 1.127 s a step, 8 micro-
# batches of 16 in 0.971 s (remat full) and 0.935 s (remat dots).
scale_shape="--prompts 16 --group 8 --prompt-tokens 64 --new-tokens 128 --dtype bfloat16"
scale_batch="$scale_shape --remat ${SCALE_REMAT:-dots} --micro-batch-size ${SCALE_MICRO:-16}"
export scale_shape  # train_variants runs in the child shell a stage starts

for name in $stages; do
  case $name in
    install) stage install 240 install ;;
    tests) stage tests 360 "$py" bench/tpu_tests.py --stage tests --out "$out/part_tests.json" ;;
    size-a) stage size-a 540 grpo size-a a --rounds 2 ;;
    size-b) stage size-b 540 grpo size-b b --rounds 2 ;;
    # shellcheck disable=SC2086
    size-c-rows) stage size-c-rows 540 grpo size-c-rows c --rows search --rounds 1 --work "$work" ${C_ARGS:-} ;;
    size-c1 | size-c2)
      if rows=$(c_rows); then
        first=""
        [ "$name" = size-c2 ] && first=--peer-first
        # shellcheck disable=SC2086
        stage "$name" 540 grpo "$name" c $rows --rounds 1 $first --work "$work" ${C_ARGS:-}
      fi ;;
    # shellcheck disable=SC2086
    scale) stage scale 540 "$py" bench/scale.py --platform "$platform" --stage scale --no-rest --no-peer --skip-limits \
      --rounds 2 --steps 3 $scale_batch --compilation-cache cold-warm --profile-steps 1 --work "$work" \
      --runs-tar "$out/scale_runs.tar.gz" --out "$out/part_scale.json" --load-note "one TPU chip, nothing else on it" \
      ${SCALE_ARGS:-} ;;
    # shellcheck disable=SC2086
    limits) stage limits 540 "$py" bench/scale.py --platform "$platform" --stage limits --limits-part $scale_batch \
      --decode-rows "" --work "$work" --out "$out/part_limits.json" --load-note "one TPU chip, nothing else on it" \
      ${SCALE_ARGS:-} ;;
    # shellcheck disable=SC2086
    placement-runs) stage placement-runs 540 placement_runs 1 placement_runs.tar.gz $PLACEMENT_CONFIGS ;;
    # shellcheck disable=SC2086
    placement-depth) stage placement-depth 540 placement_runs 7 placement_depth_runs.tar.gz $PLACEMENT_DEPTH_CONFIGS ;;
    # shellcheck disable=SC2086
    placement-width) stage placement-width 540 placement_runs 10 placement_width_runs.tar.gz $PLACEMENT_WIDTH_CONFIGS ;;
    # shellcheck disable=SC2086
    lora-1.7b) stage lora-1.7b 540 grpo lora-1.7b lora --rows search --max-prompts 8 --rounds 2 --work "$work" \
      ${LORA_ARGS:-} ;;
    # shellcheck disable=SC2086
    lora-4b) stage lora-4b 540 grpo lora-4b lora --model-preset qwen3-4b --rows search --max-prompts 8 --rounds 1 \
      --micro-batch-size 16 --work "$work" ${LORA_ARGS:-} ;;
    # shellcheck disable=SC2086
    full-ft) stage full-ft 540 "$py" bench/full_ft.py --platform "$platform" --work "$work/full-ft" \
      --out "$out/part_full-ft.json" ${FULL_FT_ARGS:-} ;;
    lora-rollout) stage lora-rollout 540 lora_rollout ;;
    memory-timeline) stage memory-timeline 540 memory_timeline ;;
    train-variants) stage train-variants 540 train_variants ;;
    merge) stage merge 120 "$py" bench/tpu_merge.py "$out" --out-dir "${MERGE_OUT:-$out}" ;;
    *) echo "unknown stage $name (stages: install tests size-a size-b size-c-rows size-c1 size-c2 scale limits placement-runs placement-depth placement-width lora-1.7b lora-4b lora-rollout full-ft memory-timeline train-variants merge)" >&2 ;;
  esac
done
tar czf "$out/logs-$(date -u +%H%M%S).tar.gz" -C "$out" logs && rm -rf "$out/logs"
ls -la "$out"
