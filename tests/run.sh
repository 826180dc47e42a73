#!/usr/bin/env bash
# One command on a fresh machine: install everything, prepare the default model and text, run
# the test suite. GPU tests (marker `gpu`) run only where CUDA is available.
#
#   bash tests/run.sh                 # whole suite
#   bash tests/run.sh -k topk         # extra pytest arguments pass through
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SAS_VENV:-$here/.venv}"
py="$venv/bin/python"

if ! [ -x "$py" ] || ! "$py" -c "import sas_backend, sglang, pytest, transformers" 2>/dev/null; then
  SAS_EXTRAS=test,train bash "$here/serve/install.sh"
fi
"$py" "$here/serve/prepare_model.py" --out "$here/models/SmolLM2-135M-Instruct"
"$py" "$here/serve/prepare_text.py"
cd "$here"
exec "$py" -m pytest -ra --durations=15 "$@"
