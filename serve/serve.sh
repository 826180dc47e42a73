#!/usr/bin/env bash
# One command on a fresh machine: install, prepare the default model and gate, serve with
# `--attention-backend sas`, and print the URL and an example request once it answers.
#
#   bash serve/serve.sh                         # default model (SmolLM2-135M-Instruct), CPU if no GPU
#   SAS_MODEL=qwen2.5-coder-0.5b bash serve/serve.sh   # the project's second model (32K context), prepared once
#   SAS_MODEL=/path/to/Qwen3-8B SAS_GATE=/path/to/gate bash serve/serve.sh --tp 1   # your own
#   PORT=30000 SAS_BUDGET=512 bash serve/serve.sh [extra sglang flags...]   # e.g. --dtype bfloat16
#
# Adds --sleep-on-idle (the idle scheduler otherwise spins a core), --served-model-name <model dir name>,
# and on a CPU without fast bf16 (no avx512_bf16/amx_bf16 flag) --dtype float32; your own flags win.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SAS_VENV:-$here/.venv}"
py="$venv/bin/python"

if ! [ -x "$py" ] || ! "$py" -c "import sas_backend, sglang" 2>/dev/null; then
  bash "$here/serve/install.sh"
fi

# SAS_MODEL: a model directory, or the name of one of the project's models (serve/prepare_model.py
# --model), which is prepared under models/ on first use.
model="${SAS_MODEL:-smollm2-135m}"
if ! [ -d "$model" ] && "$py" "$here/serve/prepare_model.py" --model "$model" --print-out >/dev/null 2>&1; then
  key="$model"
  model="$("$py" "$here/serve/prepare_model.py" --model "$key" --print-out)"
  [ -f "$model/config.json" ] || "$py" "$here/serve/prepare_model.py" --model "$key"
elif ! [ -f "$model/config.json" ]; then
  echo "[serve] SAS_MODEL=$model is neither a model directory (no config.json) nor one of the project's models:" >&2
  "$py" "$here/serve/prepare_model.py" --help | grep -A1 -- "--model" >&2
  exit 1
fi
port="${PORT:-30000}"

# Flags the user passed win: ours are added only for what they did not set.
user_sets() { local a; for a in "${@:2}"; do case "$a" in "$1"|"$1"=*) return 0;; esac; done; return 1; }
user_value() {  # the value the user gave flag $1 (last one wins, as in argparse)
  local flag="$1" v="" prev="" a; shift
  for a in "$@"; do
    case "$a" in "$flag="*) v="${a#*=}";; esac
    [ "$prev" = "$flag" ] && v="$a"
    prev="$a"
  done
  printf '%s' "$v"
}

gate="${SAS_GATE:-}"
if [ -z "$gate" ]; then
  # a gate for the block size the server will run (--sas-block-size, else SAS_BLOCK_SIZE, else 64)
  block="$(user_value --sas-block-size "$@")"
  gate="$("$py" "$here/serve/default_gate.py" --model "$model" ${block:+--block-size "$block"})"
fi

# The OpenAI API's model name: the model directory's name rather than its full path.
name="$(user_value --served-model-name "$@")"
[ -n "$name" ] || name="$(basename "$model")"
# --sleep-on-idle: without it the idle scheduler busy-polls, holding a core at 100%.
# No --sas-budget: SAS_BUDGET if set, else the gate's recorded serving budget and forced blocks.
args=(--model-path "$model" --attention-backend sas --sas-gate "$gate"
      --host 127.0.0.1 --port "$port" --sleep-on-idle --served-model-name "$name")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[serve] GPU found: FlashInfer dense prefill, Triton + FlashInfer sparse decode"
else
  echo "[serve] no GPU: serving on CPU (torch reference ops; SGLang's Triton helpers interpreted)"
  export SGLANG_USE_CPU_ENGINE=1 TRITON_INTERPRET=1
  args+=(--device cpu --max-total-tokens "${SAS_MAX_TOTAL_TOKENS:-16384}")
  # A bf16 checkpoint would load as bf16, which without AVX512-BF16/AMX runs emulated (~20x slower
  # than fp32 on an AVX2 CPU); an explicit --dtype is left alone.
  if ! user_sets --dtype "$@" && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
    echo "[serve] this CPU has no fast bf16 (no avx512_bf16/amx_bf16 flag): --dtype float32 (pass --dtype to override)"
    args+=(--dtype float32)
  fi
fi

"$py" -m sglang.launch_server "${args[@]}" "$@" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' INT TERM EXIT
url="http://127.0.0.1:$port"
for _ in $(seq 1 600); do
  if curl -sf "$url/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 $server 2>/dev/null; then echo "[serve] the server exited during startup (see above)"; exit 1; fi
  sleep 1
done
cat <<MSG

[serve] sas backend serving model "$name" ($model) at $url   (SAS config: $url/sas/info)
[serve] try:
  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$name", "messages": [{"role": "user", "content": "Name three primes."}], "max_tokens": 32, "temperature": 0}'
[serve] Ctrl-C stops it.
MSG
wait $server
