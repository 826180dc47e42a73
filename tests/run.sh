#!/usr/bin/env bash
# One command on a fresh machine: install everything, prepare the default model and text, run
# the test suite. GPU tests (marker `gpu`) run only where CUDA is available.
#
#   bash tests/run.sh                 # whole suite, then the newest-SGLang smoke test
#   bash tests/run.sh -k topk         # extra pytest arguments pass through (to the whole suite)
#   SAS_SKIP_NEWEST=1 bash tests/run.sh   # without the newest-SGLang smoke test
#   SAS_TEST_WORKERS=0 bash tests/run.sh  # serially (default: two pytest-xdist workers)
#
# The whole suite runs on the installer's default SGLang release in ./.venv. Then a second venv
# (./.venv-sglang-<newest>) gets the newest release and runs tests/server/test_newest_sglang.py
# alone (one sas and one dense server), so API drift in a new release shows up here. The newest
# release and its torch pin are named only in that test file (NEWEST_SGLANG, NEWEST_TORCH).
# That second venv installs in the background from the start, beside the main install and the
# suite (pip mostly waits on the disk; its log is printed if it fails).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SAS_VENV:-$here/.venv}"
py="$venv/bin/python"
cd "$here"

newest_pid=""
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
  newest_log="$venv2/install.log"
  if ! [ -x "$venv2/bin/python" ] \
    || ! "$venv2/bin/python" -c "import sas_backend, sglang, pytest; assert sglang.__version__ == '$newest'" 2>/dev/null; then
    echo "[run] installing SGLang $newest (torch $newest_torch) into $venv2 in the background, for the" \
      "newest-release smoke test (log: $newest_log)"
    # In its own process group (setsid), so that leaving early stops it with all its pip children.
    mkdir -p "$venv2"
    setsid_=""
    command -v setsid >/dev/null 2>&1 && setsid_=setsid
    SAS_VENV="$venv2" SAS_SGLANG_VERSION="$newest" SAS_TORCH_VERSION="$newest_torch" SAS_EXTRAS=test \
      $setsid_ bash "$here/serve/install.sh" >"$newest_log" 2>&1 &
    newest_pid=$!
    trap '[ -z "$newest_pid" ] || kill -- "-$newest_pid" 2>/dev/null || kill "$newest_pid" 2>/dev/null || true' EXIT
  fi
fi

if ! [ -x "$py" ] || ! "$py" -c "import sas_backend, sglang, pytest, xdist, transformers, tabulate" 2>/dev/null; then
  SAS_EXTRAS=test,train,bench bash "$here/serve/install.sh"
fi
"$py" "$here/serve/prepare_model.py" --out "$here/models/SmolLM2-135M-Instruct"
"$py" "$here/serve/prepare_text.py"
status=0
# Two workers (SAS_TEST_WORKERS): one runs the modules that share the package-scoped servers, the
# other the rest, heaviest first (tests/conftest.py groups them); much of a server test is one core's
# SGLang start-up, so the second core is otherwise idle. SAS_TEST_WORKERS=0 runs serially.
# --no-loadscope-reorder: keep conftest's order (xdist would otherwise put the groups with most tests first).
workers="${SAS_TEST_WORKERS:-2}"
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
"$py" -m pytest "${xdist[@]}" -ra --durations=15 "$@" || status=$?

if [ "${SAS_SKIP_NEWEST:-0}" != 1 ]; then
  if [ -n "$newest_pid" ]; then
    if wait "$newest_pid"; then
      newest_pid=""
      tail -n 1 "$newest_log"
    else
      newest_pid=""
      echo "[run] installing SGLang $newest into $venv2 failed; its log:" >&2
      cat "$newest_log" >&2
      exit 1
    fi
  fi
  echo "[run] newest-release smoke test on SGLang $newest (SAS_SKIP_NEWEST=1 skips it)"
  "$venv2/bin/python" -m pytest -ra -m newest_sglang "$newest_test" || status=$?
fi
exit "$status"
