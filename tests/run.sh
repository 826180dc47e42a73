#!/usr/bin/env bash
# One command on a fresh machine: install everything, prepare the default model and text, run
# the test suite. GPU tests (marker `gpu`) run only where CUDA is available.
#
#   bash tests/run.sh                 # whole suite, then the newest-SGLang smoke test
#   bash tests/run.sh -k topk         # extra pytest arguments pass through (to the whole suite)
#   SAS_SKIP_NEWEST=1 bash tests/run.sh   # without the newest-SGLang smoke test
#
# The whole suite runs on the installer's default SGLang release in ./.venv. Then a second venv
# (./.venv-sglang-<newest>) gets the newest release and runs tests/server/test_newest_sglang.py
# alone (one sas and one dense server), so API drift in a new release shows up here. The newest
# release and its torch pin are named only in that test file (NEWEST_SGLANG, NEWEST_TORCH).
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
status=0
"$py" -m pytest -ra --durations=15 "$@" || status=$?

if [ "${SAS_SKIP_NEWEST:-0}" != 1 ]; then
  newest_test="tests/server/test_newest_sglang.py"
  pin() { sed -n "s/^$1 = \"\([^\"]*\)\".*/\1/p" "$newest_test"; }
  newest="$(pin NEWEST_SGLANG)"
  newest_torch="$(pin NEWEST_TORCH)"
  if [ -z "$newest" ] || [ -z "$newest_torch" ]; then
    echo "[run] cannot read NEWEST_SGLANG / NEWEST_TORCH from $newest_test" >&2
    exit 1
  fi
  venv2="$here/.venv-sglang-$newest"
  if ! [ -x "$venv2/bin/python" ] \
    || ! "$venv2/bin/python" -c "import sas_backend, sglang, pytest; assert sglang.__version__ == '$newest'" 2>/dev/null; then
    echo "[run] installing SGLang $newest (torch $newest_torch) into $venv2 for the newest-release smoke test"
    SAS_VENV="$venv2" SAS_SGLANG_VERSION="$newest" SAS_TORCH_VERSION="$newest_torch" SAS_EXTRAS=test \
      bash "$here/serve/install.sh"
  fi
  echo "[run] newest-release smoke test on SGLang $newest (SAS_SKIP_NEWEST=1 skips it)"
  "$venv2/bin/python" -m pytest -ra -m newest_sglang "$newest_test" || status=$?
fi
exit "$status"
