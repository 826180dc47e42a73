#!/bin/bash
# The long-context studies of the second model (Qwen2.5-Coder-0.5B-Instruct), one after another, resumable.
#
#   bash bench/long_context_studies.sh OUT_DIR [STEP ...]     # e.g. bench/results/2026-11-26-qwen-long
#
# Steps (default: all, in this order): harness-16k harness-32k needle-8k needle-16k needle-32k decode-8k-16k
# decode-32k paged-32k tp-16k. A step whose result file exists in OUT_DIR is skipped; a killed step leaves a
# .partial.json that the next run resumes (harness: per selector and budget; needle, decode, paged), so a
# study of many hours can span sessions.
# Run it on a quiet machine: on 2 cores a job beside a server slows both ~20x. Hours on 2 cores: harness 16K
# ~0.6 per window kind, 32K ~2; needle 8K ~0.6, 16K ~1.7, 32K ~2.5 (one-chunk prefills, 8-13 min a prompt);
# decode 8K+16K ~0.6, 32K ~1; paged 32K ~1.5; tp 16K ~0.2.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/long_context_studies.sh OUT_DIR [STEP ...]}
shift
STEPS=${*:-harness-16k harness-32k needle-8k needle-16k needle-32k decode-8k-16k decode-32k paged-32k tp-16k}
M=models/Qwen2.5-Coder-0.5B-Instruct
GATE=gate_checkpoints/qwen2.5-coder-0.5b-instruct-sas
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

say() { echo "[long-context $(date +%H:%M:%S)] $*"; }
done_or_partial() {  # $1: result glob; prints "done" if a result exists, else the partial to resume (or nothing)
    local hit
    hit=$(ls $OUT/$1.json 2>/dev/null | head -1)
    [ -n "$hit" ] && { echo done; return; }
    ls $OUT/$1.partial.json 2>/dev/null | head -1
}

harness() {  # $1 window, $2 data, $3 name, [$4 split: default heldout]
    [ -e "$OUT/quality-$3-L$1.json" ] && { say "harness $3 L=$1: done"; return; }
    say "harness $3 L=$1"
    $PY -m sas_backend.training.eval_ppl --model $M --last 512 --budgets 512 1024 2048 4096 --gate gate=$GATE \
        --gate-forced 1,1 --baselines oracle quest sink-local --no-recall --no-progress --data "$2" --window "$1" \
        --max-windows 1 --split "${4:-heldout}" --json "$OUT/quality-$3-L$1.json" --plot "$OUT/quality-$3-L$1" --resume
}

needle() {  # $1 context, $2 tag, [more needle.py arguments]
    local state
    state=$(done_or_partial "needle-*-$2")
    [ "$state" = done ] && { say "needle $2: done"; return; }
    say "needle $2${state:+ (resuming $state)}"
    $PY bench/needle.py --model $M --gate $GATE --context "$1" --selectors gate --budgets 1024 2048 \
        --gate-forced 1,1 --tag "$2" --out "$OUT" ${state:+--resume "$state"} "${@:3}"
}

decode() {  # $1 name, contexts...
    local name=$1 state
    shift
    state=$(done_or_partial "cpu-decode-*-$name")
    [ "$state" = done ] && { say "decode $name: done"; return; }
    say "decode $name${state:+ (resuming $state)}"
    $PY bench/bench_cpu_decode.py --model $M --gate $GATE --contexts "$@" --batches 1 4 --budgets 1024 2048 \
        --shared-prefix --tag "$name" --out "$OUT" ${state:+--resume "$state"}
}

paged() {
    local state
    state=$(done_or_partial "paged-long-*-32040")
    [ "$state" = done ] && { say "paged 32K: done"; return; }
    say "paged 32K${state:+ (resuming $state)}"
    $PY bench/paged_long.py --model $M --gate $GATE --out "$OUT" ${state:+--resume "$state"}
}

for step in $STEPS; do
    case $step in
        harness-16k) harness 16384 @stdlib code; harness 16384 @essays essays ;;
        # the held-out essays hold ~30K tokens: 32K prose is the Debian handbook (out of every training set;
        # serve/prepare_corpus.py), whole, as out-of-domain prose
        harness-32k) harness 32000 @stdlib code; harness 32000 @handbook handbook all ;;
        needle-8k) needle 8192 qwen-8k ;;
        needle-16k) needle 16384 qwen-16k ;;
        # one prefill chunk per prompt: SGLang's torch_native extend (the dense server) pads every chunk's
        # queries to the whole prefix, so 8 chunks of 4096 (CPU default) pay sum_k (4096k)^2, 3.2x the
        # attention of one chunk (sas_backend/ops/extend/torch_path.py); measured ~28 min for one 32K prompt in
        # chunks. Same math, different rounding. SGLang sizes its default --mem-fraction-static by the chunk
        # (GPU activations) and goes negative for a 32K chunk: 0.5 of ~20 GB holds 2.3 GB of weights + 0.8 of KV.
        needle-32k) needle 32000 qwen-32k --server-arg=--chunked-prefill-size --server-arg=32768 \
                        --server-arg=--max-prefill-tokens --server-arg=32768 \
                        --server-arg=--mem-fraction-static --server-arg=0.5 ;;
        decode-8k-16k) decode qwen-8k-16k 8192 16384 ;;
        decode-32k) decode qwen-32k 32000 ;;
        paged-32k) paged ;;
        tp-16k)  # --tp 2 (one kv head per rank) vs --tp 1 with the shipped gate
            if ls $OUT/tp-*-tp2-16384.json >/dev/null 2>&1; then say "tp 16K: done"; else
                say "tp 16K"; $PY bench/tp_check.py --model $M --gate $GATE --tp 2 --context 16384 --budget 2048 --out "$OUT"; fi ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac || { say "$step failed"; exit 1; }
done
say "all done: $STEPS"
