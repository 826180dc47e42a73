#!/bin/bash
# Issue 23 item 2/3: the Qwen gate fine-tuned on 16K-token rows (facts spliced in, and code), then judged by
# the teacher-forced 16K needle and the quality harness at 8K and 16K beside the shipped gate. Resumable.
#
#   bash bench/qwen_gate_16k.sh OUT_DIR [STEP ...]       # e.g. bench/results/2026-11-26-qwen-gate16k
#
# Steps (default: caches train needle-score harness): caches train needle-score harness retrieval.
#   caches        16384-token feature caches, tail 1024: RECALL_ROWS recall rows (@essays + @docs, 8 facts each,
#                 seed RECALL_SEED, every fact RECALL_MIN_DISTANCE tokens or more before the tail; 0: anywhere) and
#                 CODE_ROWS @stdlib rows, VAL_ROWS held-out recall rows (0: none); two shard processes, one thread
#                 each (SHARDS, default 2; ~2.5 min a row, fp32 or DTYPE=bfloat16 alike: at 16K attention dominates)
#   train         distill_cached from the shipped gate (INIT; "none": a seeded init; GATE_DIM: the gate's width, a
#                 cut of INIT when narrower, gate/narrow.py) on those rows, forced blocks FORCED ("SINK LOCAL"),
#                 budget 2048, STEPS_TRAIN steps (~2.6 s a step), LR
#   needle-score  bench/needle_score.py at 16K, passphrase answers, shipped vs fine-tuned vs oracle
#   harness       eval_ppl, last 512 of one held-out window, budgets 512-4096, code and essays at 8K and 16K
#   retrieval     bench/retrieval.py at 16K (RETRIEVAL_SEEDS, default "0 1 2 3"): the fine-tuned gate as served,
#                 with SUB_BLOCKS runs a block and 4 prompt anchors, beside dense, from the haystacks' cached
#                 prefills (build/retrieval-cache; a haystack not cached yet costs its dense prefill once)
# Long rows and sub-blocks (issue 63): SEQ_LEN (default 16384) is the rows' length; LONG_ROWS > 0 adds that many
# recall rows of LONG_LEN tokens (default 32768; one thread, ~4x a 16K row); SUB_BLOCKS > 1 pools the caches' keys
# per run of 64 / SUB_BLOCKS tokens and trains the gate for --sas-sub-blocks SUB_BLOCKS (`features --sub-blocks`,
# `distill_cached --sub-blocks`; its checkpoint serves that way by itself).
# TRAIN_ARGS adds distill_cached flags to the train step (e.g. the first level's coverage, issue 63:
# TRAIN_ARGS="--coverage-weight 1 --coverage-budgets 2048 4096").
# Working files go to $WORK (default models/qwen16k: caches, the fine-tuned gate), results to OUT_DIR; NAME
# (default ft16k) names the gate in the results. The 2026-11-26 run used the defaults; the free gate
# (2026-11-28): WORK=models/qwen16k-free NAME=free16k FORCED="0 0" DTYPE=bfloat16 RECALL_SEED=3 RECALL_ROWS=20
# RECALL_TOKENS=170000 CODE_ROWS=8 CODE_TOKENS=140000 VAL_ROWS=1 STEPS_TRAIN=300.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/qwen_gate_16k.sh OUT_DIR [STEP ...]}
shift
STEPS=${*:-caches train needle-score harness}
PY=${PYTHON:-.venv/bin/python}
M=models/Qwen2.5-Coder-0.5B-Instruct
SHIP=gate_checkpoints/qwen2.5-coder-0.5b-instruct-sas
WORK=${WORK:-models/qwen16k}
NAME=${NAME:-ft16k}
FT=$WORK/gate-$NAME
RECALL_ROWS=${RECALL_ROWS:-8}
RECALL_SEED=${RECALL_SEED:-2}
RECALL_TOKENS=${RECALL_TOKENS:-80000}
CODE_ROWS=${CODE_ROWS:-6}
CODE_TOKENS=${CODE_TOKENS:-100000}
VAL_ROWS=${VAL_ROWS:-0}
RECALL_MIN_DISTANCE=${RECALL_MIN_DISTANCE:-0}  # tokens between every fact and the tail (0: anywhere)
far_arg=()
[ "$RECALL_MIN_DISTANCE" != 0 ] && far_arg=(--recall-min-distance "$RECALL_MIN_DISTANCE")
STEPS_TRAIN=${STEPS_TRAIN:-150}
FORCED=${FORCED:-1 1}
read -r SINK LOCAL <<< "$FORCED"
DTYPE=${DTYPE:-float32}
dtype_arg=()  # passed only when not the default: a cache's manifest keeps its build command, resumes compare it
[ "$DTYPE" != float32 ] && dtype_arg=(--dtype "$DTYPE")
SEQ_LEN=${SEQ_LEN:-16384}
LONG_ROWS=${LONG_ROWS:-0}
LONG_LEN=${LONG_LEN:-32768}
SUB_BLOCKS=${SUB_BLOCKS:-1}
sub_arg=()  # likewise only when not the default
[ "$SUB_BLOCKS" != 1 ] && sub_arg=(--sub-blocks "$SUB_BLOCKS")
RETRIEVAL_SEEDS=${RETRIEVAL_SEEDS:-0 1 2 3}
INIT=${INIT:-$SHIP}  # the gate training starts from; "none": a seeded init
GATE_DIM=${GATE_DIM:-}  # the trained gate's width (default: INIT's, or 128); narrower than INIT's: a cut of it
LR=${LR:-1e-3}
read -r -a train_extra <<< "${TRAIN_ARGS:-}"  # more distill_cached flags, e.g. "--coverage-weight 1 --coverage-budgets 2048 4096"
init_arg=()
[ "$INIT" != none ] && init_arg=(--init-gate "$INIT")
[ -n "$GATE_DIM" ] && init_arg+=(--gate-dim "$GATE_DIM")
SHARDS=${SHARDS:-2}  # feature processes at once, one thread each (a rerun with another count skips written rows)
mkdir -p "$OUT" "$WORK"
say() { echo "[qwen-gate-16k $(date +%H:%M:%S)] $*"; }

cache() {  # $1 out dir, $2 row length, rest: features arguments
    local out=$1 len=$2 pids=() i ok=1
    shift 2
    [ -e "$out/.complete" ] && { say "cache $out: done"; return; }
    say "cache $out"
    for ((i = 0; i < SHARDS; i++)); do
        OMP_NUM_THREADS=1 $PY -m sas_backend.training.features --model $M --seq-len "$len" --tail 1024 \
            --no-progress --out "$out" --shard $i/$SHARDS ${dtype_arg[@]+"${dtype_arg[@]}"} ${sub_arg[@]+"${sub_arg[@]}"} \
            "$@" > "$OUT/features-$(basename "$out")-$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || ok=0; done
    [ $ok = 1 ] && touch "$out/.complete"
}

for step in $STEPS; do
    case $step in
        caches)
            cache $WORK/recall $SEQ_LEN --data @essays @docs --max-tokens $RECALL_TOKENS --seed $RECALL_SEED \
                --recall-rows 1 --recall-facts 8 --max-rows $RECALL_ROWS ${far_arg[@]+"${far_arg[@]}"} &&
            cache $WORK/code $SEQ_LEN --data @stdlib --max-tokens $CODE_TOKENS --max-rows $CODE_ROWS &&
            if [ "$LONG_ROWS" -gt 0 ]; then
                # another seed than the SEQ_LEN rows', so the long rows' facts and text are others
                cache $WORK/recall-long $LONG_LEN --data @essays @docs --max-tokens $((LONG_ROWS * LONG_LEN * 2)) \
                    --seed $((RECALL_SEED + 100)) --recall-rows 1 --recall-facts 8 --max-rows $LONG_ROWS
            fi &&
            if [ "$VAL_ROWS" -gt 0 ]; then
                cache $WORK/val-recall $SEQ_LEN --data @essays @docs --split heldout --seed $RECALL_SEED \
                    --recall-rows 1 --recall-facts 8 --max-rows $VAL_ROWS
            fi ;;
        train)
            if [ -e $FT/.complete ]; then say "train: done"; else
                say train
                resume=""
                [ -e $FT/train_state.pt ] && resume=--resume
                val=""
                [ "$VAL_ROWS" -gt 0 ] && val="--val-cache $WORK/val-recall"
                long=""
                [ "$LONG_ROWS" -gt 0 ] && long=$WORK/recall-long
                $PY -m sas_backend.training.distill_cached --model $M --cache $WORK/recall $WORK/code $long $val \
                    --out $FT --budget 2048 --sink-blocks $SINK --local-blocks $LOCAL --steps $STEPS_TRAIN \
                    --rows-per-step 4 --lr "$LR" --warmup 10 ${init_arg[@]+"${init_arg[@]}"} --save-every 25 --no-progress \
                    ${sub_arg[@]+"${sub_arg[@]}"} ${train_extra[@]+"${train_extra[@]}"} $resume && touch $FT/.complete
            fi ;;
        needle-score)
            tag=qwen-16k-${NAME%16k}  # ft16k -> qwen-16k-ft (the 2026-11-26 files)
            ls $OUT/needle-score-*-$tag.json >/dev/null 2>&1 && { say "needle-score: done"; continue; }
            say needle-score
            forced="1,1"
            [ "$SINK,$LOCAL" != 1,1 ] && forced="1,1 $SINK,$LOCAL"
            $PY bench/needle_score.py --model $M --gate shipped=$SHIP --gate $NAME=$FT --context 16384 \
                --depths 0.1 0.3 0.5 --budgets 1024 2048 --gate-forced $forced --baselines oracle \
                --answer passphrase --tag $tag --out "$OUT" ;;
        harness)
            for spec in "8192 @stdlib code" "8192 @essays essays" "16384 @stdlib code" "16384 @essays essays"; do
                set -- $spec
                [ -e "$OUT/quality-$3-L$1.json" ] && continue
                say "harness $3 L=$1"
                $PY -m sas_backend.training.eval_ppl --model $M --last 512 --budgets 512 1024 2048 4096 \
                    --gate shipped=$SHIP --gate $NAME=$FT --gate-forced 1,1 --baselines oracle quest sink-local \
                    --no-recall --no-progress --data "$2" --window "$1" --max-windows 1 --split heldout \
                    --json "$OUT/quality-$3-L$1.json" --plot "$OUT/quality-$3-L$1" || exit 1
            done ;;
        retrieval)
            runs=gate
            [ "$SUB_BLOCKS" != 1 ] && runs=gatesub$((64 / SUB_BLOCKS))
            for seed in $RETRIEVAL_SEEDS; do
                say "retrieval 16K haystack $seed"
                $PY bench/retrieval.py --model $M --gate $FT --lengths 16384 --seeds "$seed" --configs dense "$runs@a4" \
                    --budgets 2048 --threads 1 --cache-dir build/retrieval-cache \
                    --out "$OUT/retrieval-16k-$NAME-s$seed.json" || exit 1
            done ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac || { say "$step failed"; exit 1; }
done
say "all done: $STEPS"
