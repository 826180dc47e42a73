#!/bin/bash
# Issue 24's study: a gate for the default model trained on ~10x more text (Debian manuals + the standard
# library), with and without forced blocks, judged on in-domain held-out and out-of-domain text. Resumable.
#
#   bash bench/gate_generalization.sh OUT_DIR [STEP ...]      # e.g. bench/results/2026-11-27-gate-generalization
#
# Steps (default: all, in this order):
#   corpus       serve/prepare_corpus.py (@docs, @handbook), if $SAS_CORPUS_DIR (models/text/corpus) lacks them
#   caches       dense feature caches, tail 256 of 4096-token rows (~14 MB a row): @docs and @stdlib train
#                splits (~1.5M tokens each), @essays, @docs recall rows, held-out @docs/@stdlib (4 rows each);
#                two shard processes per cache; a killed build resumes at the next missing row
#   train-forced cached mass distillation from the shipped gate, sink 1 + local 1 forced (the record's rule)
#   train-free   the same with no forced blocks: the target covers the first and the recent blocks too
#                (train-forced-NAME / train-free-NAME: a variant, e.g. with TRAIN_ARGS; GATES names it as forced-NAME)
#   harness      eval_ppl, last 512 of 4096-token windows, budgets 256-2048, the three gates at sink,local 1,1 and
#                0,0 beside oracle/quest/sink-local/random: in-domain (@docs, @stdlib held-out) and out-of-domain
#                (@handbook, @site-packages: no training set touches them)
#   needle       bench/needle.py through the real server (dense vs sas, 5 depths of 3K tokens, budgets 512-2048,
#                forced 1,1 and 0,0) with $NEEDLE_GATE (default: the train-free gate)
# Working files (checkpoints; caches in $CACHE, default $WORK/cache: point it at another study's caches to reuse
# them) go to $WORK (default models/gen, not committed); results, logs and the seconds of every step
# ($OUT/timings.tsv: the cost per million tokens) to OUT_DIR. On 2 cores: caches ~2.5 h, each training ~40 min,
# the harness ~2 h. Run it on a quiet machine (a job beside it slows both ~20x).
# Sizes (environment): TOKENS per training corpus (1500000), SEQ row/window tokens (4096), TAIL cached queries
# (256), STEPS_TRAIN (3000), TRAIN_ARGS more distill_cached arguments for the train steps of this invocation (e.g.
# "--coverage-weight 1"), WINDOWS per harness text (4), VAL_ROWS (4), RECALL_ROWS (40), SHARDS (2), BUDGETS ("256 512
# 1024 2048"), TRAIN_BUDGET (2048), DTYPE the caches' forward dtype (float32; bfloat16: a 4096-token Qwen row
# 1.6x faster on an AVX512-BF16 CPU, a SmolLM2 row 1.4x: 9.3 s vs 13.4 s a row on the 2 cores; features equal
# within bf16 rounding); HARNESS_REUSE, an earlier study's results folder: its quality-TEXT.json gives the
# baselines and the gates it already measured on the same windows (eval_ppl --reuse), so only the new gates
# are measured; MODEL,
# INIT_GATE (the shipped gate: trained from and compared with); GATES, the
# trained gates the harness compares ("forced free"); HARNESS, its texts ("docs-heldout code-heldout handbook-ood
# site-packages-ood"); NEEDLE_BUDGETS ("512 1024 2048"). The test suite runs the whole study at a small size on a
# tiny model (tests/test_gate_generalization_script.py).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/gate_generalization.sh OUT_DIR [STEP ...]}
shift
STEPS=${*:-corpus caches train-forced train-free harness needle}
NEEDLE_GATE=${NEEDLE_GATE:-}  # default: $WORK/train-free
CORPUS=${SAS_CORPUS_DIR:-models/text/corpus}  # where @docs and @handbook are read from
M=${MODEL:-models/SmolLM2-135M-Instruct}
INIT=${INIT_GATE-gate_checkpoints/smollm2-135m-instruct-sas}  # empty: the seeded init, and no "shipped" row
BUDGETS=${BUDGETS:-256 512 1024 2048}
TRAIN_BUDGET=${TRAIN_BUDGET:-2048}  # the serving budget the gates are trained for (K = its blocks)
WORK=${WORK:-models/gen}
CACHE=${CACHE:-$WORK/cache}
read -r -a train_args <<< "${TRAIN_ARGS:-}"  # word-split: plain flags and numbers only
GATES=${GATES:-forced free}  # trained gates in the harness (each needs its train-NAME step)
HARNESS=${HARNESS:-docs-heldout code-heldout handbook-ood site-packages-ood}
NEEDLE_BUDGETS=${NEEDLE_BUDGETS:-512 1024 2048}
TOKENS=${TOKENS:-1500000}   # per training corpus
SEQ=${SEQ:-4096}
TAIL=${TAIL:-256}
STEPS_TRAIN=${STEPS_TRAIN:-3000}
WINDOWS=${WINDOWS:-4}
VAL_ROWS=${VAL_ROWS:-4}
SHARDS=${SHARDS:-2}  # feature-building processes per cache (one thread each)
DTYPE=${DTYPE:-float32}
dtype_arg=()  # passed only when not the default: a cache's manifest keeps its build command, resumes compare it
[ "$DTYPE" != float32 ] && dtype_arg=(--dtype "$DTYPE")
RECALL_ROWS=${RECALL_ROWS:-40}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT" "$CACHE"

say() { echo "[gate-generalization $(date +%H:%M:%S)] $*"; }
timed() {  # $1 name, rest: command; appends "name<TAB>seconds" to $OUT/timings.tsv when it succeeds
    local name=$1 t0
    shift
    t0=$(date +%s)
    "$@" || return 1
    printf '%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" >> "$OUT/timings.tsv"
}

cache() {  # $1 name, rest: features arguments; a finished cache is skipped (and not timed)
    if [ -e "$CACHE/$1/.complete" ]; then say "cache $1: done"; return; fi
    timed "cache-$1" build_cache "$@"
}

build_cache() {  # $1 name, rest: features arguments; $SHARDS processes side by side, one thread each
    local name=$1 dir=$CACHE/$1 pids=() i ok=1
    shift
    say "cache $name"
    for ((i = 0; i < SHARDS; i++)); do
        OMP_NUM_THREADS=1 $PY -m sas_backend.training.features --model "$M" --seq-len "$SEQ" --tail "$TAIL" \
            --no-progress --out "$dir" --shard "$i/$SHARDS" ${dtype_arg[@]+"${dtype_arg[@]}"} "$@" > "$OUT/features-$name-$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || ok=0; done
    [ $ok = 1 ] && touch "$dir/.complete"
}

caches() {
    cache docs --data @docs --max-tokens "$TOKENS" &&
    cache code --data @stdlib --max-tokens "$TOKENS" &&
    cache essays --data @essays --max-tokens "$TOKENS" &&
    cache docs-recall --data @docs --seed 1 --max-rows $RECALL_ROWS --recall-rows 1 --recall-facts 8 &&
    cache val-docs --data @docs --split heldout --max-rows $VAL_ROWS &&
    cache val-code --data @stdlib --split heldout --max-rows $VAL_ROWS
}

train() {  # $1 name, $2 sink, $3 local
    local out=$WORK/$1 resume=
    if [ -e "$out/.complete" ]; then say "train $1: done"; return; fi
    [ -e "$out/train_state.pt" ] && resume=--resume
    say "train $1 (sink $2, local $3)${resume:+, resuming}"
    local c=$CACHE
    OMP_NUM_THREADS=2 timed "$1" $PY -m sas_backend.training.distill_cached --model $M \
        --cache $c/docs $c/code $c/essays $c/docs-recall --val-cache $c/val-docs $c/val-code \
        ${INIT:+--init-gate "$INIT"} --out "$out" --budget "$TRAIN_BUDGET" --sink-blocks "$2" --local-blocks "$3" \
        --steps "$STEPS_TRAIN" --rows-per-step 4 --lr 2e-3 --warmup $((STEPS_TRAIN < 200 ? 0 : 20)) --eval-every 250 --save-every 100 \
        ${train_args[@]+"${train_args[@]}"} --no-progress $resume >> "$OUT/$1.log" 2>&1 || return 1
    cp "$out/train_log.jsonl" "$OUT/$1.jsonl" 2>/dev/null
    touch "$out/.complete"
}

harness() {  # $1 name, $2 data, $3 split
    local name=quality-$1
    [ -e "$OUT/$name.json" ] && { say "harness $1: done"; return; }
    local gates=() g reuse=()
    for g in $GATES; do gates+=(--gate "$g=$WORK/train-$g"); done
    [ -n "${HARNESS_REUSE:-}" ] && [ -e "$HARNESS_REUSE/$name.json" ] && reuse=(--reuse "$HARNESS_REUSE/$name.json")
    say "harness $1"
    OMP_NUM_THREADS=2 timed "harness-$1" $PY -m sas_backend.training.eval_ppl --model $M --window $SEQ --last $((SEQ / 8)) \
        --budgets $BUDGETS ${INIT:+--gate "shipped=$INIT"} "${gates[@]}" --gate-forced 1,1 0,0 --baselines oracle quest sink-local random --no-recall \
        --no-progress --resume ${reuse[@]+"${reuse[@]}"} --data "$2" --split "$3" --max-windows "$WINDOWS" --json "$OUT/$name.json" --plot "$OUT/$name" \
        > "$OUT/$name.log" 2>&1
}

harness_texts() {  # every text of $HARNESS, in order; stops at the first that fails
    local text
    for text in $HARNESS; do
        case $text in
            docs-heldout) harness docs-heldout @docs heldout ;;
            code-heldout) harness code-heldout @stdlib heldout ;;
            handbook-ood) harness handbook-ood @handbook all ;;
            site-packages-ood) harness site-packages-ood @site-packages all ;;
            *) echo "unknown harness text $text" >&2; false ;;
        esac || return 1
    done
}

needle() {
    local gate=${NEEDLE_GATE:-$WORK/train-free} tag
    tag=gen-$(basename "$gate")
    if ls "$OUT"/needle-*-"$tag".json >/dev/null 2>&1; then say "needle $tag: done"; return; fi
    say "needle $tag"
    timed "needle-$tag" $PY bench/needle.py --model "$M" --gate "$gate" --depths 0.1 0.25 0.5 0.75 0.9 \
        --budgets $NEEDLE_BUDGETS --selectors gate --gate-forced 1,1 0,0 --tag "$tag" --out "$OUT" \
        > "$OUT/needle-$tag.log" 2>&1
}

for step in $STEPS; do
    case $step in
        corpus) [ -d "$CORPUS/docs" ] && [ -d "$CORPUS/handbook" ] && say "corpus: done" ||
                    { say corpus; timed corpus $PY serve/prepare_corpus.py --out "$CORPUS"; } ;;
        caches) caches ;;
        train-forced*) train "$step" 1 1 ;;  # train-forced, or a variant such as train-forced-cov (its own WORK/train-*)
        train-free*) train "$step" 0 0 ;;
        harness) harness_texts ;;
        needle) needle ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac || { say "$step failed"; exit 1; }
done
say "all done: $STEPS"
