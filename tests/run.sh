#!/usr/bin/env bash
# One command on a fresh machine: install everything, prepare the default model and text, run
# the test suite. GPU tests (marker `gpu`) run only where CUDA is available.
#
#   bash tests/run.sh                 # whole suite, and beside it the newest-SGLang smoke test
#   bash tests/run.sh -k topk         # extra pytest arguments pass through (to the whole suite)
#   SAS_SKIP_NEWEST=1 bash tests/run.sh   # without the newest-SGLang smoke test
#   SAS_TEST_WORKERS=0 bash tests/run.sh  # serially (default: two pytest-xdist workers)
#
# The whole suite runs on the installer's default SGLang release in ./.venv. A second venv
# (./.venv-sglang-<newest>) gets the newest release and runs tests/server/test_newest_sglang.py
# (one sas and one dense server), so API drift in a new release shows up here. The newest
# release and its torch pin are named only in that test file (NEWEST_SGLANG, NEWEST_TORCH).
# That second venv installs in the background from the start, beside the main install and the
# suite (pip mostly waits on the disk), and its smoke test then runs there too, beside the suite
# (its two servers' start-ups fill the cores the suite leaves idle); its log is printed at the end.
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
  newest_test_log="$venv2/smoke-test.log"
  ready="$venv2/models-prepared"  # written below once the model and the text are prepared
  mkdir -p "$venv2"
  rm -f "$ready"
  need_install=0
  if ! [ -x "$venv2/bin/python" ] \
    || ! "$venv2/bin/python" -c "import sas_backend, sglang, pytest; assert sglang.__version__ == '$newest'" 2>/dev/null; then
    need_install=1
    echo "[run] installing SGLang $newest (torch $newest_torch) into $venv2 in the background, then its" \
      "smoke test beside the suite (logs: $newest_log, $newest_test_log)"
  fi
  # One background job in its own process group (setsid), so that leaving early stops it with all its
  # children: the install when needed, then (once the model is prepared) the smoke test.
  setsid_=""
  command -v setsid >/dev/null 2>&1 && setsid_=setsid
  $setsid_ bash -c '
    need_install="$1" venv2="$2" newest="$3" install_log="$4" test_file="$5" ready="$6" here="$7" torch_pin="$8"
    if [ "$need_install" = 1 ]; then
      if ! SAS_VENV="$venv2" SAS_SGLANG_VERSION="$newest" SAS_TORCH_VERSION="$torch_pin" SAS_EXTRAS=test \
          bash "$here/serve/install.sh" >"$install_log" 2>&1; then
        echo "[run] installing SGLang $newest into $venv2 failed; its log:"; cat "$install_log"; exit 3
      fi
      tail -n 1 "$install_log"
    fi
    while ! [ -f "$ready" ]; do sleep 5; done
    echo "[run] newest-release smoke test on SGLang $newest (SAS_SKIP_NEWEST=1 skips it)"
    "$venv2/bin/python" -m pytest -ra -m newest_sglang "$test_file"
  ' newest "$need_install" "$venv2" "$newest" "$newest_log" "$newest_test" "$ready" "$here" \
    "$newest_torch" \
    >"$newest_test_log" 2>&1 &
  newest_pid=$!
  trap '[ -z "$newest_pid" ] || kill -- "-$newest_pid" 2>/dev/null || kill "$newest_pid" 2>/dev/null || true' EXIT
fi

if ! [ -x "$py" ] || ! "$py" -c "import sas_backend, sglang, pytest, xdist, transformers, tabulate" 2>/dev/null; then
  SAS_EXTRAS=test,train,bench bash "$here/serve/install.sh"
fi
"$py" "$here/serve/prepare_model.py" --out "$here/models/SmolLM2-135M-Instruct"
"$py" "$here/serve/prepare_text.py"
[ -z "$newest_pid" ] || touch "$ready"  # the smoke test may start now
status=0
# Two workers (SAS_TEST_WORKERS): one runs the modules that share the package-scoped servers, the
# other the rest, heaviest first (tests/conftest.py groups them); each is pinned to its share of the
# cores. Three on the 2-core CI machine (one core shared round-robin) ran slower: 2026-12-02, see
# docs/verification.md. SAS_TEST_WORKERS=0 runs serially.
workers="${SAS_TEST_WORKERS:-2}"
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
"$py" -m pytest "${xdist[@]}" -ra --durations=15 "$@" || status=$?

if [ "${SAS_SKIP_NEWEST:-0}" != 1 ]; then
  newest_status=0
  wait "$newest_pid" || newest_status=$?
  newest_pid=""
  cat "$newest_test_log"
  [ "$newest_status" = 0 ] || status=$newest_status
fi
exit "$status"
