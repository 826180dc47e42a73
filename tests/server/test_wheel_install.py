"""An installed user's path: the wheel built from this tree installs into a clean venv and
`python -m sglang.launch_server --attention-backend sas` finds the plugin there and serves.

The clean venv gets only the wheel (`--no-deps`); SGLang, torch and the CPU shim come from the
project venv's site-packages through a path file (installing SGLang's CPU recipe again would take
minutes and gigabytes). The project's own editable install is NOT visible there (its finder is a
`.pth` hook that path files in an added directory do not run), so `sas_backend` can only come from
the wheel: the test checks that, and that the wheel carries every subpackage and the entry point.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from sas_backend.testing.server import ON_GPU, Server, complete

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU tiers install the package with --target instead")


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(REPO)], check=True)
    (wheel,) = (tmp / "dist").glob("sas_backend-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                       check=True, capture_output=True, text=True).stdout.strip())
    (site / "project_site.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    return wheel, py


def test_wheel_carries_every_subpackage_and_the_entry_point(wheel_venv):
    wheel, _ = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module and every data file the package reads (gpu_settings.json: the CUDA "auto" step settings,
    # read only on a GPU, so a wheel without it would pass every CPU server test)
    shipped = [p for pattern in ("*.py", "*.json") for p in (REPO / "sas_backend").rglob(pattern)
               if "__pycache__" not in p.parts]
    assert any(p.name == "gpu_settings.json" for p in shipped)
    missing = sorted(str(p.relative_to(REPO)) for p in shipped if str(p.relative_to(REPO)) not in names)
    assert not missing, missing
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "[sglang.srt.plugins]" in text and "sas = sas_backend.plugin:register" in text


def test_launch_server_finds_the_installed_plugin(wheel_venv, model_dir, shipped_gate, tmp_path, monkeypatch):
    _, py = wheel_venv
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path: not the tree
    where = subprocess.run([str(py), "-c", "import sas_backend; print(sas_backend.__file__)"], check=True,
                           capture_output=True, text=True).stdout.strip()
    assert pathlib.Path(where).is_relative_to(py.parent.parent), where  # the wheel's copy, not the tree's
    args = ["--sas-gate", shipped_gate, "--sas-budget", "256", "--dtype", "float32"]
    with Server(model_dir, backend="sas", extra_args=args, python=py) as s:
        out = complete(s.url, "The capital of France is", max_tokens=4)
        assert out["choices"][0]["text"].strip()
        assert "sas:" in s.log_text()  # the backend's startup line: the plugin's backend really serves
