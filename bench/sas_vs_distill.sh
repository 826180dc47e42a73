#!/usr/bin/env bash
# Issue 50's head-to-head: does the SAS objective (next-token loss through the gated attention) beat more
# distillation, from the same starting gate on the same tokens?
#
#   bash bench/sas_vs_distill.sh OUT [STEP ...]        # default: every step, in order; a finished step is skipped
#
# Steps: train-distill, train-lm-sparse, train-lm-full (three arms from INIT_GATE, the same rows, the same
# optimizer steps: equal tokens seen), arms (their training facts in OUT/arms.json), then eval-heldout and
# eval-ood (eval_ppl on held-out and out-of-domain windows, every gate and the training-free baselines; `eval`
# runs both), analysis (per-layer mass coverage and cross-layer union recall), needle (through a real server,
# per gate). Each step writes OUT/<step>.done; training steps resume from their own checkpoints (--save-every,
# --resume), so a run stopped anywhere continues where it stopped. Steps are independent once the arms exist:
# two invocations on the same OUT may run different steps side by side (one core each, THREADS=1), memory
# permitting: one Qwen2.5-0.5B arm at 8K rows holds 10-14 GB, so two arms at once overran 24 GiB.
#
# Knobs (environment): MODEL, INIT_GATE (default: the shipped gate), DATA (training sources), SEQ (row length),
# TRAIN_LAST (queries trained per row), STEPS, LR, WARMUP, BUDGET (training budget), SINK/LOCAL (the served
# forced blocks, trained as served under the sparse scope), DISTILL_FORCED (SINK,LOCAL the distillation arm
# excludes from its target, as the starting gate was distilled: 0,0 for the SmolLM2 gate, 1,1 for Qwen's),
# WINDOWS (eval windows per text), EVAL_DATA, OOD_DATA, BUDGETS (eval budgets), PYTHON, THREADS.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bash bench/sas_vs_distill.sh OUT [STEP ...]}"
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(train-distill train-lm-sparse train-lm-full arms eval-heldout eval-ood analysis needle)
py="${PYTHON:-$here/.venv/bin/python}"
model="${MODEL:-$here/models/SmolLM2-135M-Instruct}"
init="${INIT_GATE:-$here/gate_checkpoints/smollm2-135m-instruct-sas}"
data="${DATA:-@docs @stdlib @essays}"
seq="${SEQ:-4096}"
train_last="${TRAIN_LAST:-512}"
n_steps="${STEPS:-30}"
lr="${LR:-5e-4}"
warmup="${WARMUP:-3}"
budget="${BUDGET:-2048}"
sink="${SINK:-1}"
local_="${LOCAL:-1}"
distill_forced="${DISTILL_FORCED:-0,0}"
windows="${WINDOWS:-8}"
eval_data="${EVAL_DATA:-@essays @docs @stdlib}"
ood_data="${OOD_DATA:-@handbook @site-packages}"
budgets="${BUDGETS:-512 2048}"
export OMP_NUM_THREADS="${THREADS:-$(nproc)}"
mkdir -p "$out"
cd "$here"

log() { echo "[sas-vs-distill $(date -u +%H:%M:%S)] $*"; }
timed() {  # name cmd...: run, record its seconds in OUT/timings.tsv
  local name="$1" t0
  shift
  t0=$(date +%s)
  "$@"
  printf '%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" >> "$out/timings.tsv"
}

train_arm() {  # name objective-args...
  local name="$1" resume=()
  shift
  [ -f "$out/$name/train_state.pt" ] && resume=(--resume)  # a stopped arm continues from its last save
  "$py" -m sas_backend.training.train --model "$model" --data $data --out "$out/$name" --init-gate "$init" \
    --seq-len "$seq" --train-last "$train_last" --budget "$budget" --steps "$n_steps" --lr "$lr" \
    --warmup "$warmup" --batch-size 1 --seed 0 --save-every 5 "${resume[@]}" --no-progress "$@"
}

gates_args() {  # --gate NAME=DIR for the starting gate and every finished arm (its step done: a stopped arm's
  # periodic save is a gate file too, of fewer steps)
  local args=(--gate "shipped=$init")
  for arm in distill lm-sparse lm-full; do
    [ -f "$out/train-$arm.done" ] && args+=(--gate "$arm=$out/train-$arm")
  done
  echo "${args[@]}"
}

run_step() {
  case "$1" in
    train-distill)  # (a) more distillation (the dense attention's block mass), as the shipped gate was made
      timed "$1" train_arm train-distill --objective distill --distill-target mass \
        --sink-blocks "${distill_forced%,*}" --local-blocks "${distill_forced#*,}" ;;
    train-lm-sparse)  # (b) the SAS objective in the serving regime: Top-K at the budget, forced blocks as served
      timed "$1" train_arm train-lm-sparse --objective lm --scope sparse --sink-blocks "$sink" --local-blocks "$local_" ;;
    train-lm-full)  # (c) the SAS objective in full scope: every previous block with its soft gate
      timed "$1" train_arm train-lm-full --objective lm --scope full ;;
    arms)  # each arm's training facts in one record (OUT/arms.json), for bench/readme_tables.py
      "$py" bench/sas_vs_distill_arms.py "$out" --init "$init" ;;
    eval)  # both evaluations, each recorded as its own step
      for part in eval-heldout eval-ood; do
        [ -f "$out/$part.done" ] || { run_step "$part"; touch "$out/$part.done"; }
      done ;;
    eval-heldout)
      # shellcheck disable=SC2046
      timed eval-heldout "$py" -m sas_backend.training.eval_ppl --model "$model" --data $eval_data --window "$seq" \
        --budgets $budgets $(gates_args) --gate-forced "$sink,$local_" --baselines sink-local oracle \
        --max-windows "$windows" --split heldout --json "$out/quality-heldout.json" --resume --no-progress ;;
    eval-ood)
      # shellcheck disable=SC2046
      timed eval-ood "$py" -m sas_backend.training.eval_ppl --model "$model" --data $ood_data --window "$seq" \
        --budgets $budgets $(gates_args) --gate-forced "$sink,$local_" --baselines sink-local oracle \
        --max-windows "$windows" --split all --json "$out/quality-ood.json" --resume --no-progress ;;
    analysis)
      # shellcheck disable=SC2046
      timed analysis "$py" -m sas_backend.training.analysis --model "$model" --data $eval_data --window "$seq" \
        --budgets $budgets $(gates_args) --gate-forced "$sink,$local_" --baselines sink-local quest \
        --max-windows "$windows" --split heldout --json "$out/analysis.json" --no-progress ;;
    needle)  # the same prompts for every gate: dense is asked once, by the first gate's run
      local first="" dense=()
      for gate in $(gates_args | tr ' ' '\n' | grep '=' ); do
        name="${gate%%=*}" dir="${gate#*=}"
        [ -n "$first" ] && dense=(--dense-from "$first")
        timed "needle-$name" "$py" bench/needle.py --model "$model" --gate "$dir" --budgets $budgets \
          --selectors gate --gate-forced "$sink,$local_" --tag "$name" --out "$out" "${dense[@]}"
        [ -n "$first" ] || first="$(ls -t "$out"/needle-*-"$name".json | head -1)"
      done ;;
    *) echo "unknown step $1" >&2; exit 2 ;;
  esac
}

for step in "${steps[@]}"; do
  if [ -f "$out/$step.done" ]; then
    log "$step: done"
    continue
  fi
  log "$step"
  run_step "$step"
  touch "$out/$step.done"
done
log "all done"
