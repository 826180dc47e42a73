#!/usr/bin/env bash
# Install sas-backend with SGLang into a virtual environment (default: ./.venv).
#
#   bash serve/install.sh            # GPU host: stock `pip install` of SGLang + FlashInfer
#                                    # CPU host: the CPU recipe below
#   SAS_VENV=/path bash serve/install.sh
#   SAS_SGLANG_VERSION=0.5.21 ...    # pin another SGLang release
#   SAS_EXTRAS=test,train ...        # optional extras of sas-backend
#
# CPU recipe (the one tests/run.sh installs with; verified on a 2-core CPU-only x86_64 box):
#   torch 2.13.0 CPU wheel, `sglang --no-deps` (its metadata pins CUDA-only packages that
#   do not install without NVIDIA's index), then sglang's own requirements minus the
#   CUDA-only ones, with torch held by a constraints file, then a tiny `sgl_kernel`
#   stand-in for the CPU helpers SGLang imports at load time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SAS_VENV:-$here/.venv}"
extras="${SAS_EXTRAS:-}"
py="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
else
  has_gpu=0
fi

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip setuptools wheel

spec="."
[ -n "$extras" ] && spec=".[$extras]"

# Builds from this repository's tree (the sgl_kernel shim, the editable install) write build/ and
# *.egg-info inside it: one installer at a time there (tests/run.sh runs two side by side).
in_tree() {
  if command -v flock >/dev/null 2>&1; then flock "$here/serve/install.sh" "$@"; else "$@"; fi
}

if [ "$has_gpu" = 1 ]; then
  sgl="${SAS_SGLANG_VERSION:-0.5.15}"
  echo "[install] GPU found: sglang==$sgl with its own CUDA requirements"
  $pip install "sglang==$sgl"
  (cd "$here" && in_tree $pip install -e "$spec")
  exit 0
fi

sgl="${SAS_SGLANG_VERSION:-0.5.21}"
torch_v="${SAS_TORCH_VERSION:-2.13.0}"
echo "[install] no GPU: CPU recipe, torch==$torch_v (CPU wheel), sglang==$sgl"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_v" >"$constraints"

# On Linux x86_64, PyPI's torch is a CUDA build (several GB of nvidia-* wheels); the CPU build
# (version suffix +cpu) is on the PyTorch CPU index. A local +cpu wheel (pip's find-links, as on this
# project's machines) is taken first without asking any index; else that index, pinned to +cpu so
# PyPI's build can never win. Elsewhere (macOS, aarch64) PyPI's torch is the CPU build.
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  if ! $pip install -q --no-index --no-deps "torch==$torch_v+cpu" >/dev/null 2>&1; then
    echo "[install] torch $torch_v+cpu from https://download.pytorch.org/whl/cpu"
    if ! $pip install -q "torch==$torch_v+cpu" --extra-index-url https://download.pytorch.org/whl/cpu; then
      # No CPU wheel reachable (an offline mirror without it): PyPI's build still runs on CPU,
      # it is only large. Say so rather than fail.
      echo "[install] warning: no torch $torch_v+cpu wheel reachable; installing PyPI's torch==$torch_v (a CUDA build, several GB)"
      $pip install -q "torch==$torch_v"
    fi
  fi
  $pip install -q "torch==$torch_v"  # torch's own dependencies; torch itself is already there
else
  $pip install -q "torch==$torch_v"
fi
$pip install -q --no-deps "sglang==$sgl"

# sglang's Requires-Dist, minus extras, markers that do not apply, and CUDA-only packages.
reqs="$("$venv/bin/python" "$here/serve/requirements_of.py" sglang)"
# triton runs kernels on CPU only under TRITON_INTERPRET=1, which is how our tests use it.
# accelerate lets transformers load the GGUF of the default model (serve/prepare_model.py).
echo "[install] note: pip will print an ERROR that sglang requires cuda-python, flashinfer, nvidia-*, ... which"
echo "[install]       are not installed: expected, those CUDA-only requirements are left out on purpose on CPU"
# shellcheck disable=SC2086
$pip install -q -c "$constraints" $reqs triton accelerate
in_tree $pip install -q "$here/serve/cpu_shim"
# PyPI's torchvision is a CUDA build: with CPU torch its import dies registering fake kernels for
# ops its missing C extension never defined (transformers/sglang import it). Guard those two.
"$venv/bin/python" "$here/serve/patch_torchvision_cpu.py"
(cd "$here" && in_tree $pip install -q -c "$constraints" --no-deps -e "$spec")
if [ -n "$extras" ]; then
  # The extras' own requirements (pytest, ...), still with torch held.
  extra_reqs="$("$venv/bin/python" "$here/serve/requirements_of.py" sas-backend --extras "$extras")"
  # shellcheck disable=SC2086
  [ -z "$extra_reqs" ] || $pip install -q -c "$constraints" $extra_reqs
  # Mooncake's CPU transfer engine (the test extra: tests/server/test_pd.py) loads libibverbs and libnl, which a
  # slim Debian or Ubuntu image lacks; as root with apt, install them, else say what is missing.
  if "$venv/bin/python" -c "import importlib.util as u; raise SystemExit(u.find_spec('mooncake') is None)" \
      && ! "$venv/bin/python" -c "import mooncake.engine" 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get install -y -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null \
        || echo "[install] apt-get could not install libibverbs1 libnl-3-200 libnl-route-3-200 (Mooncake needs them)"
    else
      echo "[install] Mooncake's transfer engine needs libibverbs1, libnl-3-200, libnl-route-3-200: install them"
    fi
  fi
fi
"$venv/bin/python" -c "import torch, sglang, sas_backend; print('[install] ok: torch', torch.__version__, 'sglang', sglang.__version__)"
