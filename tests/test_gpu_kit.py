"""The GPU kit's builder and the tier runner, on CPU (gpu_kit/): no network, no GPU.

A tiny fake package stands for the real wheels: the builder downloads it from a local wheel
directory, installs it with --target, packs, writes SHA256SUMS and the manifest; the kit side
verifies, unpacks and installs this repository into a site with --no-index --no-deps --target;
each tier's --dry-run goes as far as a CPU machine can and leaves its summary files.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

import aot  # noqa: E402
import build_kit  # noqa: E402
import kit  # noqa: E402
import run as gpu_run  # noqa: E402


def fake_wheel(dest: pathlib.Path, name: str, version: str, files: dict) -> pathlib.Path:
    """A pure-Python wheel `name-version-py3-none-any.whl` holding `files` {path: text}."""
    dist = f"{name}-{version}.dist-info"
    contents = dict(files)
    contents[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    contents[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in contents.items():
            z.writestr(path, text)
    return whl


def test_parse_pins_and_the_shipped_contents_list():
    assert build_kit.parse_spec("partial_json_parser-0.2.1.1.post7") == ("partial_json_parser", "0.2.1.1.post7")
    assert build_kit.parse_spec("flashinfer-python==0.6.12") == ("flashinfer-python", "0.6.12")
    pins = dict(build_kit.read_contents(build_kit.CONTENTS))
    assert pins["sglang"] == "0.5.15" and pins["sglang_kernel"] == "0.4.4" and pins["flashinfer_python"] == "0.6.12"
    with pytest.raises(ValueError):
        build_kit.parse_spec("noversion")


def test_build_manifest_pack_verify_unpack(tmp_path):
    wheels = tmp_path / "wheels"
    whl = fake_wheel(wheels, "fakepkg", "0.1", {"fakepkg/__init__.py": "X = 1\n", "fakepkg/data/big.a": "x" * 4096})
    out = tmp_path / "kit"
    manifest = build_kit.build([("fakepkg", "0.1")], out, find_links=wheels, preset=1, command="test")
    (pkg,) = manifest["packages"]
    assert pkg["sha256"] == kit.sha256_of(whl) and pkg["bytes"] == whl.stat().st_size
    archive = out / manifest["archive"]["name"]
    assert manifest["archive"]["sha256"] == kit.sha256_of(archive)
    assert json.loads((out / kit.MANIFEST_FILE).read_text()) == manifest
    assert kit.verify(out, [archive.name]) == {archive.name: "ok"}
    with tarfile.open(archive) as tar:  # reproducible members: root-owned, one mtime
        assert {(m.uid, m.gid, m.mtime) for m in tar.getmembers()} == {(0, 0, build_kit.FIXED_MTIME)}
    site = tmp_path / "site"
    kit.unpack(archive, site)
    assert (site / "fakepkg" / "__init__.py").read_text() == "X = 1\n"
    assert kit.installed_versions(site, ["fakepkg", "other"]) == {"fakepkg": "0.1", "other": None}
    # a second, identical build packs the same bytes
    manifest2 = build_kit.build([("fakepkg", "0.1")], tmp_path / "kit2", find_links=wheels, preset=1)
    assert manifest2["archive"]["sha256"] == manifest["archive"]["sha256"]
    # compare: a file only in one archive shows up
    fake_wheel(wheels, "fakepkg", "0.2", {"fakepkg/__init__.py": "X = 2\n", "fakepkg/extra.py": ""})
    m3 = build_kit.build([("fakepkg", "0.2")], tmp_path / "kit3", find_links=wheels, preset=1)
    diff = build_kit.compare(tmp_path / "kit3" / m3["archive"]["name"], archive)
    assert "fakepkg/extra.py" in diff["only_mine_files"] and "fakepkg/data/big.a" in diff["only_theirs_files"]


def test_corrupt_archive_is_refused(tmp_path):
    (tmp_path / "a.tar.xz").write_bytes(b"not what was summed")
    (tmp_path / kit.SUMS_FILE).write_text("0" * 64 + "  a.tar.xz\n")
    with pytest.raises(kit.KitError, match="corrupt"):
        kit.verify(tmp_path, ["a.tar.xz"])
    with pytest.raises(kit.KitError, match="missing"):
        kit.verify(tmp_path, ["b.whl"])


def test_slim_removes_and_reports(tmp_path):
    stage = tmp_path / "stage"
    for rel in ["sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/sm90/flash_ops.abi3.so",
                "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/__init__.py", "xgrammar/lib/libx.a"]:
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(b"x" * 100)
    info = stage / "sglang_kernel-0.4.4.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("sgl_kernel/__init__.py,sha256=a,1\nsgl_kernel/sm90/flash_ops.abi3.so,sha256=b,2\n"
                                 "sgl_kernel/sm100/common_ops.abi3.so,sha256=c,3\n")
    (stage / "bin").mkdir()
    (stage / "bin" / "tool").write_text("#!/build/machine/venv/bin/python\nimport sys\n")
    (info / "direct_url.json").write_text('{"url": "file:///build/machine/wheels/x.whl"}')
    rules = {"sglang_kernel": build_kit.SLIM["sglang_kernel"], "xgrammar": {"remove": ["xgrammar/*/*.a"]}}
    report = build_kit.slim(stage, ["sglang_kernel", "xgrammar", "other"], rules)
    assert build_kit.make_portable(stage) == {"direct_url_dropped": 1, "shebangs_rewritten": 1}
    left = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    assert left == ["bin/tool", "sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so",
                    "sglang_kernel-0.4.4.dist-info/RECORD"]
    assert report["sglang_kernel"]["bytes_saved"] == 200 and report["xgrammar"]["removed"] == ["xgrammar/lib/libx.a"]
    assert (info / "RECORD").read_text() == "sgl_kernel/__init__.py,sha256=a,1\n"
    assert (stage / "bin" / "tool").read_text() == "#!/usr/bin/env python3\nimport sys\n"


def test_pack_refuses_symlinks(tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "real").write_text("x")
    (stage / "link").symlink_to(stage / "real")
    with pytest.raises(kit.KitError, match="symbolic link"):
        build_kit.pack(stage, tmp_path / "k.tar.xz", preset=0)


def test_flashinfer_wheels_site_installs_this_package(tmp_path):
    """Tier 1's kit form (two wheels, no archive): installed with --target, then sas-backend
    itself with --no-index --no-deps --no-build-isolation; the installed copy imports from the site."""
    kit_dir = tmp_path / "kit"
    fake_wheel(kit_dir, "flashinfer_python", "0.0.1", {"flashinfer/__init__.py": "__version__ = '0.0.1'\n"})
    fake_wheel(kit_dir, "apache_tvm_ffi", "0.0.1", {"tvm_ffi/__init__.py": ""})
    site = tmp_path / "site"
    record = kit.prepare_site(kit_dir, site, need_sglang=False)
    assert record["installed_self"] == "pip" and len(record["installed_wheels"]) == 2
    assert kit.installed_versions(site, ["sas_backend", "flashinfer_python"]) == {
        "sas_backend": gpu_run.probe_imports(["sas_backend"], kit.site_env(site))["sas_backend"]["version"],
        "flashinfer_python": "0.0.1"}
    probe = gpu_run.probe_imports(["sas_backend", "flashinfer"], kit.site_env(site))
    assert probe["flashinfer"]["file"].startswith(str(site)) and probe["sas_backend"]["file"].startswith(str(site))
    with pytest.raises(kit.KitError, match="no sglang"):
        kit.prepare_site(kit_dir, tmp_path / "site2", need_sglang=True)


def test_fallback_install_is_found_by_plugin_discovery(tmp_path):
    """Without pip (an old setuptools on the GPU image), the copied package still carries its
    version and the SGLang plugin entry point."""
    site = tmp_path / "site"
    kit.install_self_by_copy(site)
    code = ("import importlib.metadata as m; "
            "d = m.distribution('sas-backend'); "
            "print(d.locate_file('sas_backend'), d.entry_points.select(group='sglang.srt.plugins')[0].value)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=kit.site_env(site), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == [str(site / "sas_backend"), "sas_backend.plugin:register"]
    assert (site / "sas_backend" / "ops" / "topk" / "__init__.py").exists()


def test_step_selection_adds_what_a_step_needs():
    steps = gpu_run.tier_steps("tier2", quick=False)
    assert gpu_run.selected(steps, ["e2e-decode"]) == {"e2e-decode", "make-bench-model"}
    assert gpu_run.selected(steps, None, ["e2e-decode"]) == {s.name for s in steps} - {"e2e-decode"}
    with pytest.raises(SystemExit):
        gpu_run.selected(steps, ["nope"])


@pytest.fixture(scope="module")
def fake_site_kit(tmp_path_factory):
    """A kit dir with a site archive whose compiled module claims a CPython no one runs, so the
    dry run treats it as this machine treats the real cp312 kit (compiled packages not imported)."""
    root = tmp_path_factory.mktemp("fakekit")
    stage = root / "stage"
    (stage / "fakecompiled").mkdir(parents=True)
    (stage / "fakecompiled" / "_x.cpython-399-x86_64-linux-gnu.so").write_bytes(b"\0")
    kit_dir = root / "kit"
    kit_dir.mkdir()
    archive = kit_dir / "sglang-0.0-h100-site.tar.xz"
    build_kit.pack(stage, archive, preset=0)
    # pre-built FlashInfer modules (fake .so files) and their record, as build_kit --aot writes them
    aot_stage = root / "aot-stage"
    modules = []
    for uri in ("batch_decode_fake", "batch_prefill_fake"):
        so = aot_stage / aot.aot_member(uri)
        so.parent.mkdir(parents=True)
        so.write_bytes(uri.encode())
        modules.append({"uri": uri, "member": aot.aot_member(uri), "sha256": kit.sha256_of(so)})
    aot_archive = kit_dir / aot.AOT_ARCHIVE
    build_kit.pack(aot_stage, aot_archive, preset=0)
    (kit_dir / "aot-record.json").write_text(json.dumps({"modules": modules}))
    (kit_dir / kit.SUMS_FILE).write_text(f"{kit.sha256_of(archive)}  {archive.name}\n"
                                         f"{kit.sha256_of(aot_archive)}  {aot_archive.name}\n")
    return kit_dir


def test_session_holds_every_tier_step():
    """The session's two commands run every step of tiers 0-2 (so their dry run below covers tiers 1 and 2, whose own
    dry runs would repeat the same scripts: a minute of CI each); the first command's decode-step, e2e-decode and
    gated-attention run at the points issue 64 names, not the tiers' sizes."""
    first = {s.name: s for s in gpu_run.tier_steps("session", quick=False)}
    session = {**first, **{s.name: s for s in gpu_run.tier_steps("session2", quick=False)}}
    assert len(session) == len(first) + len(gpu_run.tier_steps("session2", quick=False))  # no step in both
    for tier in ("tier0", "tier1", "tier2"):
        for step in gpu_run.tier_steps(tier, quick=False):
            assert step.name in session, (tier, step.name)
            assert step.dry_argv == session[step.name].dry_argv or step.name in ("gated-attention", "e2e-decode",
                                                                               "decode-step")
    quick1 = {s.name: s for s in gpu_run.tier_steps("tier1", quick=True)}
    assert session["gated-attention"].argv == quick1["gated-attention"].argv


def test_the_first_command_measures_what_matters_most_and_fits_at_factor_one():
    """Issue 64 item 2: the first command's steps, in order, at the served configuration and the points that decide
    the fused step, add up to at most the call's --budget-min with every step at its full expected minutes (not
    FIT_FACTOR of them): nothing in it is planned to be skipped or killed."""
    steps = gpu_run.tier_steps("session", quick=False)
    assert [s.name for s in steps] == ["preflight", "kernel-checks", "decode-step", "make-bench-model", "e2e-decode",
                                       "tournament"]
    total = sum(s.minutes for s in steps)
    assert total <= gpu_run.BUDGET_MIN, total
    left = gpu_run.BUDGET_MIN * 60
    for s in steps:  # the runner's own rule starts each of them, at factor 1.0
        assert left >= s.minutes * 60 and gpu_run.fits(left, s.minutes), (s.name, left)
        left -= s.minutes * 60
    by = {s.name: " ".join(s.argv) for s in steps}
    assert "--checks-only" in by["kernel-checks"] and "--points 8192x1 32768x1 131072x1 32768x8" in by["kernel-checks"]
    assert "--points 8192x1 32768x1 131072x1 262144x1 32768x8" in by["decode-step"]
    assert "--variants core" in by["decode-step"] and "--budgets 2048" in by["decode-step"]
    assert "--points 8192x1 32768x1 32768x8" in by["e2e-decode"]
    assert "--variants tournament" in by["tournament"] and "--points 8192x1 32768x1 131072x1 262144x1 32768x8" \
        in by["tournament"]
    # the rest, second
    assert {s.name for s in gpu_run.tier_steps("session2", quick=False)} == {
        "make-test-model", "server-tests", "topk-sweep", "gated-attention", "kernel-tests", "sub-block-cost"}


def test_session_dry_run(fake_site_kit, tmp_path):
    """The session's dry run, both commands (the second with --no-install on the first one's site), which hold every
    step of tiers 0-2 (test_session_holds_every_tier_step): tier 0's own dry run ran the same preflight again (half a
    minute of CI). With an hour's --budget-min: at the GPU's 9.3 minutes a CPU loaded by the rest of the suite may
    run the interpreted rehearsal past a step's share, and a step killed or skipped for time (the budget's own
    rules, tested below) is not what this test is about."""
    tier = "session"
    out, out2 = tmp_path / "out", tmp_path / "out2"
    common = ["--dry-run", "--kit", str(fake_site_kit), "--site", str(tmp_path / "site"), "--work",
              str(tmp_path / "work"), "--aot-record", str(fake_site_kit / "aot-record.json"), "--budget-min", "60"]
    proc = subprocess.run([sys.executable, "gpu_kit/run.py", tier, *common, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc2 = subprocess.run([sys.executable, "gpu_kit/run.py", "session2", *common, "--no-install", "--out", str(out2)],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    rec = json.loads((out / f"{tier}-dry.json").read_text())
    assert rec["stopped"].startswith("dry run") and "CUDA" in rec["stopped"]
    assert rec["imports"]["sas_backend"]["ok"] and rec["imports"]["sas_backend"]["from_site"]
    steps = {s["name"]: s for s in rec["steps"]}
    assert set(steps) == {s.name for s in gpu_run.tier_steps(tier, quick=False)}
    assert all(s["rc"] == 0 for s in steps.values()), steps
    steps2 = {s["name"]: s for s in json.loads((out2 / "session2-dry.json").read_text())["steps"]}
    assert set(steps2) == {s.name for s in gpu_run.tier_steps("session2", quick=False)}
    assert all(s["rc"] == 0 for s in steps2.values()), steps2
    cost_rows = steps2["sub-block-cost"]["results"]["sub-block-cost"]["rows"]  # the second call's last step
    for row in cost_rows:  # the served step with 1 and 4 sub-block summaries, side by side and each checked
        timed = row["variants"][str(max(map(int, row["sas"])))]
        costs = {"cost: served, one summary a block", "cost: served, 4 sub-block summaries"}
        assert costs <= set(timed) and all(timed[n]["check"]["ok"] for n in costs), timed.keys()
        assert "old: per-op kernels + flashinfer" not in timed
    md = (out / f"{tier}-dry.md").read_text()
    assert rec["environment"]["git"]["commit"] in md
    assert rec["kit"]["aot"]["archive"] == "flashinfer-aot-0.6.12-sm90a.tar.xz"
    assert rec["jit"]["cuda"]["how"]  # CUDA_HOME search recorded for every tier
    checks = steps["preflight"]["results"]["preflight"]["checks"]  # tier 0, the session's first step
    assert checks["aot"]["ok"] and checks["aot"]["modules"] == 2
    assert checks["triton"]["ok"] and checks["triton"]["interpreted"]  # the kernel == its reference
    assert checks["gpu"]["ok"] is None and "dry run" in checks["gpu"]["skipped"]
    assert "Preflight" in md
    # One call does what matters most, in that order, and returns what the device tool takes back.
    assert list(steps) == [s.name for s in gpu_run.tier_steps(tier, quick=False)]
    assert steps2["kernel-tests"]["counts"]["tests collected"] > 100
    assert steps2["server-tests"]["counts"]["tests collected"] >= 5
    assert "would start sas" in (out / "session-dry.log").read_text()
    assert "--points 8192x1 32768x1 32768x8" in steps["e2e-decode"]["command"]  # the end-to-end points
    assert len(list(out.iterdir())) <= 8  # the device tool returns at most 8 files
    # committed records name no folder of the machine they ran on (the first GPU run's did)
    summary = (out / "session-dry.json").read_text() + md
    for path in (str(REPO), str(tmp_path)):
        at = summary.find(path)
        assert at < 0, f"a machine path in the summary: ...{summary[max(0, at - 300):at + 200]}..."
    assert "<site>" in summary
    # the kernels checked first, the served CUDA configuration (bf16 pool and weights, anchors on and off) included
    checks = steps["kernel-checks"]["results"]["kernel-checks"]["checks"]
    assert checks and all(c["ok"] for c in checks)
    served = {c["op"] for c in checks if c["op"].startswith("served")}
    assert any("anchors on" in op for op in served) and any("anchors off" in op for op in served), served
    step_rec = steps["decode-step"]["results"]["decode-step"]
    # the first GPU run timed only the block step (1 in 64): steady and amortized come back too
    for row in step_rec["rows"]:
        for sas in row["sas"].values():
            assert sas["amortized_ms"] == (63 * sas["steady_ms"] + sas["ms"]) / 64
            assert sas["speedup"] == row["dense_ms"] / sas["amortized_ms"]
            assert set(sas["breakdown_ms"]) == {"front", "front_block", "select", "attend"}  # the fused launches
            assert sas["vs_old"] > 0  # the old step timed beside the new one
        assert set(row["variants"][str(max(map(int, row["sas"])))]) == {
            "new: fused, triton attend", "old: per-op kernels + flashinfer"}
    # the IF-node branch timing (dense or sparse chosen per replay), at the middle budget
    branch = [s["branch"] for r in step_rec["rows"] for s in r["sas"].values() if "branch" in s]
    assert branch and all(b["sparse_ms"] > 0 and b["dense_ms"] > 0 for b in branch)
    assert "IF nodes" in md
    # the tournament's variants, each checked, and the settings table it chose (dry run: unmeasured)
    tour = steps["tournament"]["results"]["tournament"]
    names = {n for r in tour["rows"] for vs in r["variants"].values() for n in vs}
    assert len(names) == 11, names  # bench_decode_step.VARIANTS (11): the old step is the decode-step's
    assert all(v["check"]["ok"] for r in tour["rows"] for vs in r["variants"].values() for v in vs.values())
    chosen = tour["chosen_settings"]
    assert steps["tournament"]["results"]["chosen-settings"] == chosen
    assert chosen["measured"] is False and "default" in chosen["devices"]
    assert set(chosen["devices"]["default"]) == {"kernels", "attention", "summary_dtype", "gate_dtype",
                                                 "select_chunk", "target_programs", "launch", "dense_below"}
    assert not (chosen["devices"]["default"]["launch"] or {}).get("pdl")  # as run: the interpreter has no PDL
    profile = tour["profile"]  # the trace summary comes back
    assert profile["eager"]["kernels"] > 10 and profile["eager"]["top"] and "Profile of one steady SAS step" in md
    # the plot needs matplotlib (the `bench` extra; CI installs test,train only)
    assert (out / "decode-step.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_summaries_name_no_machine_folder_even_in_shortened_commands(tmp_path):
    """The Markdown table shortens each command to 90 characters; a folder cut short there must still be a
    placeholder (placeholders are put in before the table is drawn: the flake of 2026-12-02)."""
    site = tmp_path / ("s" * 60) / "site"
    from sas_backend.testing import report

    rec = {"tier": "session", "mode": "dry run", "environment": report.environment(), "steps": [
        {"name": "preflight", "rc": 0, "seconds": 1.0, "expected_minutes": 1,
         "command": f"python3 gpu_kit/preflight.py --site {site} --work {tmp_path}/w"}]}  # cut within {site}
    gpu_run.write_summaries(rec, tmp_path / "session-dry", site, tmp_path / "w")
    for name in ("session-dry.md", "session-dry.json"):
        text = (tmp_path / name).read_text()
        assert "--site <site>" in text and str(tmp_path)[:15] not in text and "sssss" not in text, name


def test_session_stops_after_a_failed_preflight_and_skips_what_does_not_fit(fake_site_kit, tmp_path):
    """The preflight failing (here: the AOT record names a module the kit lacks) skips every later step
    and says why; a step whose expected minutes do not fit in the budget is skipped, not started."""
    record = json.loads((fake_site_kit / "aot-record.json").read_text())
    record["modules"].append({"uri": "missing_module", "member": aot.aot_member("missing_module"), "sha256": "0"})
    bad_record = tmp_path / "aot-record.json"
    bad_record.write_text(json.dumps(record))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "gpu_kit/run.py", "session", "--dry-run", "--kit", str(fake_site_kit), "--site",
         str(tmp_path / "site"), "--work", str(tmp_path / "work"), "--out", str(out), "--aot-record",
         str(bad_record)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((out / "session-dry.json").read_text())["steps"]
    assert steps[0]["name"] == "preflight" and steps[0]["rc"] not in (0, None)
    assert [s.get("skipped") for s in steps[1:]] == ["preflight failed"] * (len(steps) - 1)
    # exit 1 for the failed preflight, not a traceback (the first GPU run's summary writer raised
    # KeyError on the skipped steps, which exits 1 as well) - and the Markdown summary is written
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "| preflight |" in (out / "session-dry.md").read_text()

    assert gpu_run.fits(600, 9.0) and not gpu_run.fits(120, 5.0) and not gpu_run.fits(15, 0.1)
    assert gpu_run.fits(0.6 * 5.0 * 60, 5.0)


# ------------------------------------------------------------------ pre-built FlashInfer modules
SHARED_KIT = REPO.parent / "shared" / "gpu-kit"
AOT_CACHE = REPO / "build" / "flashinfer-aot" / "aot"  # build_kit --aot's compile cache (not committed)
# The FlashInfer 0.6.12 wheel: the shared kit beside the checkout, or a kit built here (.whl/fi).
FLASHINFER_WHEELS = [w for d in (SHARED_KIT, REPO / ".whl" / "fi", REPO / ".whl")
                     for w in sorted(d.glob("flashinfer_python-0.6.12-*.whl"))]


def test_aot_record_is_complete():
    """The committed record of the full build: 8 modules (decode + fa2 prefill x bf16/fp16 x d64/d128),
    each at its loader path, needing only libcudart.so.13 beyond the C/C++ runtime."""
    rec = json.loads(aot.AOT_RECORD.read_text())
    assert rec["flashinfer"] == aot.FLASHINFER_VERSION and rec["arch_list"] == "9.0a"
    assert len(rec["modules"]) == 8 and {m["kind"] for m in rec["modules"]} == {"decode", "prefill"}
    assert rec["complete"] == all(m["built"] for m in rec["modules"]) and any(m["built"] for m in rec["modules"])
    assert {(m["uri"].split("_dtype_q_")[1][:4].rstrip("_"), m["uri"].split("head_dim_qk_")[1].split("_")[0], m["kind"])
            for m in rec["modules"]} == {(d, h, k) for d in ("bf16", "f16") for h in ("64", "128")
                                         for k in ("decode", "prefill")}
    if rec["complete"]:  # the archive the kit carries holds exactly these members
        assert rec["archive"]["name"] == aot.AOT_ARCHIVE and len(rec["archive"]["sha256"]) == 64
        assert rec["archive"]["files"] == 8 and rec["build_minutes_total"] > 0
    for m in (m for m in rec["modules"] if m["built"]):
        assert m["member"] == f"flashinfer/data/aot/{m['uri']}/{m['uri']}.so" and len(m["sha256"]) == 64
        assert set(m["needed"]) <= {"libcudart.so.13", "libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6"}
        assert m["unresolved_with_toolkit"] == []
    assert any("sas decode" in u for m in rec["modules"] for u in m["used_by"])
    assert any("sglang" in u for m in rec["modules"] for u in m["used_by"])


@pytest.mark.skipif(not FLASHINFER_WHEELS, reason="no FlashInfer 0.6.12 wheel (../shared/gpu-kit or .whl/fi)")
def test_aot_modules_load_from_a_clean_site_without_compiling(tmp_path):
    """From a clean --target site made from the kit (the FlashInfer wheel + the AOT archive),
    FlashInfer's own loader resolves every module the call sites ask for to the shipped
    flashinfer/data/aot/<uri>/<uri>.so and loads it, with nvcc off the PATH, CUDA_HOME poisoned and
    FlashInfer's compile step and ninja raising if called. With the real modules from the compile
    cache (this machine after build_kit --aot) tvm_ffi dlopens them for real (libcudart.so.13 from the
    toolkit); elsewhere (CI) fake files stand at the same paths and tvm_ffi's load is recorded."""
    rec = json.loads(aot.AOT_RECORD.read_text())
    real = all((AOT_CACHE / m["uri"] / f"{m['uri']}.so").is_file() for m in rec["modules"])
    stage = tmp_path / "aot-stage"
    for m in rec["modules"]:
        dest = stage / m["member"]
        dest.parent.mkdir(parents=True)
        if real:
            dest.write_bytes((AOT_CACHE / m["uri"] / f"{m['uri']}.so").read_bytes())
        else:
            dest.write_bytes(b"not a shared object")
    kit_dir = tmp_path / "kit"
    kit_dir.mkdir()
    build_kit.pack(stage, kit_dir / aot.AOT_ARCHIVE, preset=0)
    site = tmp_path / "site"
    kit.pip_target(FLASHINFER_WHEELS[:1], site)
    kit.unpack(kit_dir / aot.AOT_ARCHIVE, site)
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "pynvml.py").write_text("# nvidia-ml-py stands here (the GPU image has it)\n")
    cuda = kit.find_cuda_home()["cuda_home"]
    env = {"HOME": str(tmp_path), "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
           "CUDA_HOME": str(tmp_path / "no-cuda-here"), "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
           "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws"), "PYTHONPATH": f"{site}:{stub}:{REPO}",
           "LD_LIBRARY_PATH": f"{cuda}/lib64" if cuda else ""}
    assert subprocess.run(["which", "nvcc"], env=env, capture_output=True).returncode != 0
    argv = [sys.executable, str(REPO / "gpu_kit/aot.py"), "loadcheck", *([] if real else ["--fake-load"])]
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LOADCHECK ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(line[len("LOADCHECK "):])
    assert res["compiled"] == [] and pathlib.Path(res["aot_dir"]) == site / aot.AOT_PREFIX
    assert {m["uri"] for m in res["modules"]} == {m["uri"] for m in rec["modules"]}
    for m in res["modules"]:
        assert m["is_aot"] and m["loaded"] and pathlib.Path(m["path"]) == site / aot.aot_member(m["uri"])
        if not real:
            assert pathlib.Path(m["tvm_ffi_path"]) == site / aot.aot_member(m["uri"])
    if real:  # the very files the record describes
        by_uri = {m["uri"]: m for m in rec["modules"]}
        for m in res["modules"]:
            assert kit.sha256_of(m["path"]) == by_uri[m["uri"]]["sha256"]
    print(f"loaded {len(res['modules'])} modules, {'real .so files (dlopen)' if real else 'fake files'}")


def _fatbin_blob(entries) -> bytes:
    """A fat binary blob: header + entries (kind, sm, payload), the layout prune_fatbin reads."""
    import struct

    body = b""
    for kind, sm, payload in entries:
        head = struct.pack("<HHIQ", kind, 0, 64, len(payload)) + bytes(12) + struct.pack("<I", sm)
        body += head + bytes(64 - len(head)) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_prune_fatbin_zeroes_only_other_architectures(tmp_path):
    blob = _fatbin_blob([(2, 80, b"A" * 96), (2, 90, b"B" * 96), (2, 100, b"C" * 96)])
    src = tmp_path / "f.c"
    src.write_text('__attribute__((section(".nv_fatbin"), used)) const unsigned char fb[] = {'
                   + ",".join(str(b) for b in blob) + "};\n")
    so = tmp_path / "libf.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    size = so.stat().st_size
    res = build_kit.prune_fatbin(so, keep_sm=(90,))
    data = so.read_bytes()
    assert res == {"zeroed_bytes": 192, "kept_bytes": 96, "by_sm": {80: 96, 90: 96, 100: 96}}
    assert so.stat().st_size == size and b"B" * 96 in data and b"A" * 96 not in data and b"C" * 96 not in data


def test_find_cuda_home_follows_a_wrapper_script(tmp_path):
    tk = tmp_path / "cuda-13.0"
    (tk / "bin").mkdir(parents=True)
    (tk / "include").mkdir()
    (tk / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tk / "include" / "cuda_runtime.h").write_text("")
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    (wrap / "nvcc").write_text(f'#!/bin/sh\nexec {tk}/bin/nvcc "$@"\n')
    (wrap / "nvcc").chmod(0o755)
    found = kit.find_cuda_home({"PATH": str(wrap)})
    assert found["cuda_home"] == str(tk) and "wrapper" in found["how"]
    assert kit.find_cuda_home({"PATH": str(wrap), "CUDA_HOME": str(tmp_path)})["cuda_home"] == str(tk)  # not a toolkit
    assert kit.find_cuda_home({"PATH": "/nonexistent", "CUDA_HOME": str(tk)})["how"] == "$CUDA_HOME"


def test_jit_env_links_the_driver_libcuda_when_the_toolkit_has_no_stub(tmp_path, monkeypatch):
    tk = tmp_path / "cuda"
    for d in ("bin", "include", "lib64"):
        (tk / d).mkdir(parents=True)
    (tk / "bin" / "nvcc").write_text("")
    (tk / "include" / "cuda_runtime.h").write_text("")
    (tk / "lib64" / "libcudart.so").write_text("")
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").write_text("")
    monkeypatch.setattr(kit, "DRIVER_DIRS", [str(driver)])
    monkeypatch.setattr(kit, "_ldconfig_paths", lambda name: [])
    env, rec = kit.jit_env({"PATH": "/usr/bin", "CUDA_HOME": str(tk)}, tmp_path / "shim")
    assert env["CUDA_HOME"] == str(tk) and env["SGLANG_FLASHINFER_USE_PAGED"] == "1"
    assert env["PATH"].startswith(str(tk / "bin"))
    assert env["FLASHINFER_EXTRA_LDFLAGS"] == f"-L{tmp_path / 'shim'}" and env["LIBRARY_PATH"] == str(tmp_path / "shim")
    assert os.readlink(tmp_path / "shim" / "libcuda.so") == str(driver / "libcuda.so.1")
    (tk / "lib64" / "stubs").mkdir()  # a toolkit with the stub needs no shim
    (tk / "lib64" / "stubs" / "libcuda.so").write_text("")
    env2, rec2 = kit.jit_env({"PATH": "/usr/bin", "CUDA_HOME": str(tk)}, tmp_path / "shim2")
    assert "FLASHINFER_EXTRA_LDFLAGS" not in env2 and rec2["link"]["dir"] is None


def test_kit_record_payload_per_tier(tmp_path, monkeypatch):
    """The builder's kit record: the site kit counts for tiers 0 and 2, the FlashInfer wheels for
    tier 1; payload = the repository's tracked files + the kit's files; the record names no machine
    path; rebuilding one kit keeps the other's entry."""
    repo = tmp_path / "repo"
    monkeypatch.setattr(kit, "REPO", repo)
    monkeypatch.setattr(build_kit, "repo_bytes", lambda repo=None: {"tracked": 23 * 2**20, "untracked": 123})

    def sparse(path, n):
        with open(path, "wb") as f:
            f.truncate(n)

    site_kit, fi_kit = repo / ".whl" / "site", repo / ".whl" / "fi"
    site_kit.mkdir(parents=True)
    sparse(site_kit / "sglang-0.0-h100-site.tar.xz", 40 * 2**20)
    (site_kit / aot.AOT_ARCHIVE).write_bytes(b"y" * 1000)
    (site_kit / kit.SUMS_FILE).write_text(f"{kit.sha256_of(site_kit / aot.AOT_ARCHIVE)}  {aot.AOT_ARCHIVE}\n")
    before = tmp_path / "shared" / "sglang-0.0-h100-site.tar.xz"
    before.parent.mkdir()
    sparse(before, 45 * 2**20)
    record = tmp_path / "kit-record.json"
    chk = {"ok": True, "failures": []}
    rec = build_kit.update_kit_record(site_kit, f"python gpu_kit/build_kit.py --out {site_kit} --restage {before}",
                                      record, before, chk)
    assert set(rec["payload_mib"]) == {"tier0", "tier2"}
    t2 = rec["payload_mib"]["tier2"]
    kit_bytes = sum(p.stat().st_size for p in site_kit.iterdir())
    assert t2["repo_tracked_mib"] == 23 and t2["kit_mib"] == round(kit_bytes / 2**20, 2)
    assert t2["total_mib"] == round(23 + kit_bytes / 2**20, 2) and t2["headroom_ok"] is False  # 63 MiB: < 2 free
    assert rec["payload_before"]["total_mib"] == 68 and rec["tier2_kit_files_bytes"][aot.AOT_ARCHIVE] == 1000
    assert rec["kits"]["site"]["import_check"] == chk and rec["kits"]["site"]["carry"] == ".whl/site"
    assert rec["kits"]["site"]["files"][aot.AOT_ARCHIVE]["sha256"] == kit.sha256_of(site_kit / aot.AOT_ARCHIVE)
    assert rec["kits"]["site"]["command"] == "python gpu_kit/build_kit.py --out .whl/site --restage " \
                                            "../shared/sglang-0.0-h100-site.tar.xz"
    fake_wheel(fi_kit, "flashinfer_python", "0.0.1", {"flashinfer/__init__.py": ""})
    rec = build_kit.update_kit_record(fi_kit, "python gpu_kit/build_kit.py --flashinfer-only", record)
    assert set(rec["payload_mib"]) == {"tier0", "tier1", "tier2"} and rec["kits"]["site"]["import_check"] == chk
    assert rec["payload_mib"]["tier1"]["headroom_ok"] is True and str(tmp_path) not in record.read_text()


def test_import_check_failures_and_what_slimming_lost():
    import import_check

    ok = {"modules": {"sglang.launch_server": "ok"},
          "archs": {"LlamaForCausalLM": "sglang.srt.models.llama.LlamaForCausalLM"},
          "transformers": {"llama": "LlamaConfig"}, "registry_failures": []}
    assert import_check.failures(ok) == []
    broken = {"modules": {"sglang.launch_server": "ModuleNotFoundError: Could not import module 'AutoProcessor'"},
              "archs": {"LlamaForCausalLM":
                        "ValueError: Model architectures ['TransformersForCausalLM'] are not supported"},
              "transformers": {"error": "ModuleNotFoundError: No module named 'transformers.models.encoder_decoder'"},
              "registry_failures": ["Ignore import error when loading sglang.srt.models.llama: ..."]}
    assert len(import_check.failures(broken)) == 3
    lost = import_check.compare(ok, broken)
    assert (any(x.startswith("modules.sglang.launch_server") for x in lost)
            and any(x.startswith("registry:") for x in lost))
    assert import_check.failures({"error": "Traceback ..."}) and import_check.compare(ok, ok) == []


def test_payload_of_the_recorded_kit_leaves_headroom():
    """The tier-2 carry (this repository as it is now + the recorded kit: site archive, AOT
    archive, SHA256SUMS, manifest) stays >= HEADROOM_MIB under the device tool's 64 MiB."""
    path = REPO / "gpu_kit" / "kit-record.json"
    if not path.exists():
        pytest.skip("no kit-record.json: the kit build was not recorded")
    rec = json.loads(path.read_text())
    kit_mib = sum(rec["tier2_kit_files_bytes"].values()) / 2**20
    repo = build_kit.repo_bytes()
    total = (repo["tracked"] + repo["untracked"]) / 2**20 + kit_mib
    assert build_kit.CARRY_LIMIT_MIB - total >= build_kit.HEADROOM_MIB, (total, kit_mib, repo)
    assert rec["payload_before"]["total_mib"] > rec["payload_after"]["total_mib"]


def test_timeline_summary_counts_busy_time_once_and_the_gaps():
    """The profile's device timeline: overlapping kernels count once as busy, idle time between
    them is the gap, and kernels are ranked by total time."""
    import bench_decode_step

    spans = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("a", 20.0, 30.0), ("c", 40.0, 41.0)]
    r = bench_decode_step.timeline_summary(spans)
    assert (r["kernels"], r["distinct"], r["span_us"], r["busy_us"], r["gaps_us"]) == (4, 3, 41.0, 23.0, 18.0)
    assert [t["name"] for t in r["top"]] == ["a", "b", "c"]
    assert r["top"][0] == {"name": "a", "count": 2, "total_us": 20.0}
    assert bench_decode_step.timeline_summary([]) == {"kernels": 0}


def test_a_step_killed_after_its_first_point_keeps_that_point(tmp_path):
    """Issue 64 item 1: the decode-step benchmark rewrites its record after every check, point and variant, so
    a step the runner kills at its deadline (here: SIGKILL to its process group as soon as the first of two
    points is complete) leaves that point in decode-step.json, marked partial, and the runner's summary embeds
    it. Before, the record was written once, after the last point and the profile: nothing survived."""
    import signal
    import time

    out = tmp_path / "work"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "gpu_kit/bench_decode_step.py", "--dry-run", "--quick", "--contexts",
                             "1024", "2048", "--no-check", "--no-profile", "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path, first = out / "decode-step.json", None
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if path.exists():
                rows = json.loads(path.read_text())["rows"]  # whole or absent: written by os.replace
                if rows and rows[0]["complete"]:
                    first = rows[0]
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first is not None, "no complete point was ever written"
    rec = json.loads(path.read_text())
    assert rec["complete"] is False and rec["rows"][0]["context"] == 1024
    assert rec["rows"][0]["sas"]["256"]["amortized_ms"] > 0 and rec["rows"][0]["dense_ms"] > 0
    assert "partial record" in (out / "decode-step.md").read_text()
    step = gpu_run.Step("decode-step", [], 1.0, produces=("decode-step.json", "decode-step.png"))
    srec = {"name": "decode-step", "rc": 124, "seconds": 1.0, "expected_minutes": 1.0}
    gpu_run.collect(step, out, tmp_path, srec)
    assert srec["partial"] == ["decode-step"] and srec["results"]["decode-step"]["rows"][0]["context"] == 1024
    assert "partial record" in srec["markdown"]


def test_the_end_to_end_record_is_rewritten_after_every_point(tmp_path):
    """bench/bench_decode.py's rows as measured: a point only the dense server reached has sas_ms None."""
    import bench_decode

    rows = bench_decode.rows_of({(8192, 1): {"dense": 2.0, "sas": 1.0}, (32768, 1): {"dense": 4.0}})
    assert rows == [{"context": 8192, "batch": 1, "dense_ms": 2.0, "sas_ms": 1.0, "ratio": 0.5},
                    {"context": 32768, "batch": 1, "dense_ms": 4.0, "sas_ms": None, "ratio": None}]
    from sas_backend.testing.report import environment

    rec = {"model": "m", "budget": 2048, "server_flags": [], "environment": environment(), "rows": rows,
           "complete": False}
    bench_decode.write_report(rec, tmp_path / "decode.json", plot=False)
    md = (tmp_path / "decode.md").read_text()
    assert "partial record" in md and "| 32768 | 1 | 4 | None | None |" in md


def test_a_variant_is_checked_after_its_timed_replays(request):
    """Issue 64 item 3: after a variant's timed calls (replays on CUDA) its last output must equal the eager step's
    and the oracle's over the blocks that call selected, and every fused workspace counter must be zero again;
    a merge that never ran (a counter left set), a wrong output or a wrong attention fails the check."""
    import argparse

    import bench_decode_step as bds

    torch = pytest.importorskip("torch")
    # as bench_decode_step.main runs; restored after, or every later test in this worker loses autograd
    request.addfinalizer(functools.partial(torch.set_grad_enabled, torch.is_grad_enabled()))
    torch.set_grad_enabled(False)
    w = bds.World(bds.TINY, 1024, 1, 2, "cpu")
    res = bds.time_variant(w, 256, bds.NEW, argparse.Namespace(graphs=False, reps=1))
    assert res["check"]["ok"] and res["check"]["block"]["ok"] and res["check"]["steady"]["ok"]
    assert res["check"]["steady"]["counters_set"] == dict.fromkeys(bds.COUNTERS, 0)
    st, outs = bds.ServedStep(w, 256, False, block_step=False), {}
    bds.time_ms(st.step, False, 1, outs, st.last_selected)
    assert bds.check_variant(st, outs)["ok"]
    st.step_obj.fused_ws.attend_counters[0] = 1  # a split's merge that never ran
    bad = bds.check_variant(st, outs)
    assert not bad["ok"] and bad["counters_set"]["attend_counters"] == 1
    st.step_obj.fused_ws.attend_counters.zero_()
    wrong = dict(outs, last=outs["last"] + 0.1)  # the replay computed something else than the eager step
    assert not bds.check_variant(st, wrong)["ok"]
    sel = outs["selected"]  # attention over blocks the step did not select
    other = torch.tensor([[[b for b in range(w.max_blocks) if b not in row.tolist()][: sel.shape[-1]] for row in r]
                          for r in sel], dtype=sel.dtype)
    assert not bds.check_variant(st, dict(outs, selected=other))["ok"]
    assert bds.check_variant(st, {})["ok"] is False  # nothing kept: unchecked is not ok


def test_the_sub_block_cost_variant_runs_checked_and_never_wins(request):
    """Issue 63's candidate timed for its cost (bench_decode_step.COSTS): the served step with 4 sub-block summaries
    runs the fused kernels over a 4x-wide pool and passes the same check as every variant; a "cost:" name is never
    adopted as the CUDA default, however fast."""
    import argparse

    import bench_decode_step as bds

    torch = pytest.importorskip("torch")
    request.addfinalizer(functools.partial(torch.set_grad_enabled, torch.is_grad_enabled()))
    torch.set_grad_enabled(False)
    w = bds.World(bds.TINY, 1024, 1, 2, "cpu")
    sub = next(v for v in bds.COSTS if v.sub_blocks == 4)
    res = bds.time_variant(w, 256, sub, argparse.Namespace(graphs=False, reps=1))
    assert res["check"]["ok"], res["check"]
    assert w.summaries_of(0, torch.bfloat16, 4).shape[-1] == 4 * bds.TINY.gate_dim
    assert all(not v.name.startswith("new") for v in bds.COSTS)
    row = {"context": 1024, "batch": 1, "dense_ms": 1.0, "variants": {"256": {
        bds.NEW.name: {"speedup": 1.0, "amortized_ms": 1.0, "check": {"ok": True}, "settings": bds.NEW.settings()},
        sub.name: {"speedup": 9.0, "amortized_ms": 0.1, "check": {"ok": True}, "settings": sub.settings()}}}}
    record = {"budgets": [256], "rows": [row], "mode": "dry run", "environment": {"device": "cpu"}}
    assert bds.NEW.name in bds.chosen_settings(record, "cpu", branches={})["source"]


@pytest.mark.parametrize("ranked", [True, False])
def test_the_exact_rerank_cost_variant_runs_checked(request, ranked):
    """Issue 63's two levels timed for their cost (bench_decode_step.COSTS): the served step with --sas-exact-rerank 2
    runs the fused select at 2 x K and the rerank kernel (its top-K in the attend, the default, or in its own launch),
    and its attention passes the check against the oracle over the blocks it selected (the selection itself differs
    from one level's by design)."""
    import argparse

    import bench_decode_step as bds

    torch = pytest.importorskip("torch")
    request.addfinalizer(functools.partial(torch.set_grad_enabled, torch.is_grad_enabled()))
    torch.set_grad_enabled(False)
    w = bds.World(bds.TINY, 1024, 1, 2, "cpu")
    two = next(v for v in bds.COSTS if v.exact_rerank == 2 and v.rerank_keys == "kv"
               and v.launch_options().rank_in_attend == ranked)
    assert ("own select" in two.name) != ranked
    res = bds.time_variant(w, 256, two, argparse.Namespace(graphs=False, reps=1))
    assert res["check"]["ok"], res["check"]
    assert not two.name.startswith("new")


def test_the_4bit_rerank_cost_variant_runs_checked(request):
    """--sas-rerank-keys int4 timed for its cost (bench_decode_step.COSTS): the served step's rerank reads the world's
    4-bit key codes (encoded from its K once), and its attention passes the check against the oracle over the blocks
    it selected."""
    import argparse

    import bench_decode_step as bds

    torch = pytest.importorskip("torch")
    request.addfinalizer(functools.partial(torch.set_grad_enabled, torch.is_grad_enabled()))
    torch.set_grad_enabled(False)
    w = bds.World(bds.TINY, 1024, 1, 2, "cpu")
    coded = next(v for v in bds.COSTS if v.rerank_keys == "int4")
    assert coded.exact_rerank == 2 and not coded.name.startswith("new")
    res = bds.time_variant(w, 256, coded, argparse.Namespace(graphs=False, reps=1))
    assert res["check"]["ok"], res["check"]
    packed, scales = w.key_codes()[0]
    assert packed.shape[0] == w.num_pages and bool(scales[1:, :, 1].abs().sum() > 0)


def test_the_fp8_cost_variant_reads_an_fp8_cache_checked(request):
    """Issue 66's GPU point (bench_decode_step.COSTS): the served step over fp8 e4m3 K / V (the world's buffers
    rounded, scale 1) runs the fused kernels and passes the check against the oracle over the same fp8 cache; the
    bf16 world is untouched, and the oracle over bf16 K / V differs (the fp8 rounding is real)."""
    import argparse

    import bench_decode_step as bds

    torch = pytest.importorskip("torch")
    request.addfinalizer(functools.partial(torch.set_grad_enabled, torch.is_grad_enabled()))
    torch.set_grad_enabled(False)
    w = bds.World(bds.TINY, 1024, 1, 2, "cpu")
    fp8 = next(v for v in bds.COSTS if v.kv == "fp8_e4m3")
    res = bds.time_variant(w, 256, fp8, argparse.Namespace(graphs=False, reps=1))
    assert res["check"]["ok"], res["check"]
    k8, _ = w.kv(0, torch.float8_e4m3fn)
    assert k8.dtype == torch.float8_e4m3fn and w.kv(0)[0].dtype == torch.bfloat16
    sel = bds.all_blocks(w)[..., :4]
    assert not torch.allclose(bds.reference_attention(w, 1, sel, kv_dtype=torch.float8_e4m3fn).float(),
                              bds.reference_attention(w, 1, sel).float(), atol=1e-3)
    assert not fp8.name.startswith("new")


def test_only_checked_variants_can_win():
    """chosen_settings adopts the fastest variant that passed its check at every point: a faster variant whose
    check failed (PDL here), one never checked, or one that raised (a refused capture) never wins."""
    import bench_decode_step as bds

    def v(speedup, check):
        return {"speedup": speedup, "amortized_ms": 1.0 / speedup, "ms": 1.0, "steady_ms": 1.0,
                **({"check": {"ok": check}} if check is not None else {})}

    variants = {bds.NEW.name: v(1.1, True), "new: fused, PDL": v(3.0, False),
                "new: fused, bf16 summaries": v(2.5, None),
                "new: fused, attend 8 warps": {"error": "RuntimeError: capture refused", "device_ok_after": True},
                "new: fused, 132 programs": v(1.5, True)}
    rows = [{"context": c, "batch": 1, "dense_ms": 1.0, "sas": {}, "variants": {"2048": dict(variants)}}
            for c in (8192, 32768)]
    rows[1]["variants"]["2048"]["new: fused, 132 programs"] = v(1.6, False)  # failed at one point: out
    record = {"budgets": [2048], "mode": "full", "environment": {"device": "NVIDIA H200"}, "rows": rows}
    chosen = bds.chosen_settings(record, "H200")
    assert "'new: fused, triton attend'" in chosen["source"], chosen["source"]
    for r in rows:
        r["variants"]["2048"][bds.NEW.name]["check"]["ok"] = False
    assert bds.chosen_settings(record, "H200") == {}  # nothing checked: nothing adopted
    md = bds.markdown({**record, "geometry_name": "x", "graphs": True, "peak_gbs": 1, "weights_floor_ms": 0,
                       "checks": [], "geometry": {"layers": 36}, "environment": _env()})
    assert "| new: fused, PDL | 8192 | 1 | 2048 |" in md and "FAILED" in md and "unchecked" in md


def test_select_chunk_is_chosen_per_batch_size():
    """Issue 64 item 6: the chunk variants differ from NEW only in the select chunk; at each batch size the
    fastest checked one wins, so a batch-1 winner (chunk 64) and a batch-8 winner (chunk 256) make a rule
    {"1": 64, "8": 256} joined to the best variant's settings (bf16 summaries here); the workspace reads it back.
    A chunk variant that failed its check at one point of a batch size does not compete there; the default
    chunk winning everywhere leaves the table's null."""
    import bench_decode_step as bds

    from sas_backend.ops import fused_step as fused

    def v(speedup, ok=True):
        return {"speedup": speedup, "amortized_ms": 1.0 / speedup, "ms": 1.0, "steady_ms": 1.0, "check": {"ok": ok}}

    c64, c256, bf16 = "new: fused, select chunk 64", "new: fused, select chunk 256", "new: fused, bf16 summaries"
    speeds = {1: {bds.NEW.name: 1.0, c64: 1.2, c256: 0.9, bf16: 1.3}, 8: {bds.NEW.name: 2.0, c64: 1.8, c256: 2.4,
                                                                         bf16: 2.6}}
    rows = [{"context": ctx, "batch": bs, "dense_ms": 1.0, "sas": {},
             "variants": {"2048": {n: v(x) for n, x in speeds[bs].items()}}}
            for ctx, bs in ((8192, 1), (32768, 1), (32768, 8))]
    record = {"budgets": [2048], "mode": "full", "environment": {"device": "NVIDIA H200"}, "rows": rows}
    chosen = bds.chosen_settings(record, "H200", branches={})
    entry = chosen["devices"]["H200"]
    assert entry["summary_dtype"] == "bf16" and entry["select_chunk"] == {"1": 64, "8": 256}, entry
    assert chosen["select_chunk_decision"]["per_batch"]["8"]["chunk"] == 256
    geo = fused.StepGeometry(8, 4, 128, 128, 128, 32, 64)
    ws = fused.DecodeStepWorkspace(geo, 16, 4097, "meta", chunk=entry["select_chunk"])
    assert [ws.select_chunk(bs) for bs in (1, 7, 8, 16)] == [64, 64, 256, 256]
    rows[2]["variants"]["2048"][c256]["check"]["ok"] = False  # failed at batch 8: the default (128) wins there
    assert bds.chosen_settings(record, "H200", branches={})["devices"]["H200"]["select_chunk"] == {"1": 64, "8": 128}
    for r in rows:
        r["variants"]["2048"][c64]["speedup"] = 0.5
    assert bds.chosen_settings(record, "H200", branches={})["devices"]["H200"]["select_chunk"] is None


def _env():
    from sas_backend.testing.report import environment

    return environment()


def _pt(ctx, bs, dense, sparse, if_dense=None, if_sparse=None):
    return {"context": ctx, "batch": bs, "dense_ms": dense, "sparse_ms": sparse, "if_dense_ms": if_dense,
            "if_sparse_ms": if_sparse}


def test_dense_below_is_decided_per_point_not_by_the_most_tokens_dense_won():
    """Issue 64 item 7, first case: a slow 8K x 8 point (65536 tokens, dense 2.0 vs sparse 2.2 ms) must not send
    64K batch-1 steps (also 65536 tokens, where sparse is 3x faster) dense. The old rule took the most tokens at which
    dense won (65536); the decision weighs every point: 8192."""
    import bench_decode_step as bds

    points = [_pt(8192, 1, 0.60, 0.90, 0.65, 0.95), _pt(65536, 1, 3.0, 1.0, 3.1, 1.05),
              _pt(8192, 8, 2.0, 2.2, 2.1, 2.3)]
    d = bds.decide_dense_below(points)
    assert d["dense_below"] == 8192, d["geomean_ms"]
    assert [p["runs"] for p in d["points"]] == ["dense", "sparse", "sparse"]
    assert [p["faster_branched"] for p in d["points"]] == ["dense", "sparse", "dense"]


def test_dense_below_pays_for_the_branched_mode():
    """Item 7, second case: dense beats the plain sparse graph at 8K (0.60 vs 0.62 ms), but the branched graph's IF
    nodes cost more than that everywhere (0.70 dense, and the sparse side 0.70 / 0.80 where plain is 0.62 / 0.70):
    no branching (0). Unmeasured branches: never adopted (0)."""
    import bench_decode_step as bds

    points = [_pt(8192, 1, 0.60, 0.62, 0.70, 0.70), _pt(32768, 1, 2.0, 0.70, 2.1, 0.80)]
    assert bds.decide_dense_below(points)["dense_below"] == 0
    cheap = [_pt(8192, 1, 0.60, 0.62, 0.605, 0.625), _pt(32768, 1, 2.0, 0.70, 2.1, 0.705)]
    assert bds.decide_dense_below(cheap)["dense_below"] == 8192  # cheap IF nodes: worth it
    assert bds.decide_dense_below([_pt(8192, 1, 0.60, 0.62), _pt(32768, 1, 2.0, 0.70)])["dense_below"] == 0


def test_chosen_settings_reads_the_branch_costs_of_the_decode_step_record():
    """The tournament runs without IF-node timings; chosen_settings takes them from the decode-step record (scaling
    the branched sparse side by its IF / plain ratio) and writes the decision beside the table."""
    import bench_decode_step as bds

    name = bds.NEW.name
    ok = {"check": {"ok": True}, "ms": 1.0, "steady_ms": 1.0}
    tour = {"budgets": [2048], "mode": "full", "environment": {"device": "NVIDIA H200"}, "rows": [
        {"context": 8192, "batch": 1, "dense_ms": 0.6, "sas": {}, "variants": {"2048": {name: {
            **ok, "amortized_ms": 0.9, "speedup": 0.6 / 0.9}}}},
        {"context": 65536, "batch": 1, "dense_ms": 3.0, "sas": {}, "variants": {"2048": {name: {
            **ok, "amortized_ms": 1.0, "speedup": 3.0}}}}]}
    step = {"budgets": [2048], "rows": [
        {"context": 8192, "batch": 1, "sas": {"2048": {"steady_ms": 0.9, "branch": {"dense_ms": 0.62,
                                                                                   "sparse_ms": 0.95}}}},
        {"context": 65536, "batch": 1, "sas": {"2048": {"steady_ms": 1.0, "branch": {"dense_ms": 3.1,
                                                                                    "sparse_ms": 1.02}}}}]}
    chosen = bds.chosen_settings(tour, "H200", bds.branch_costs(step))
    assert chosen["devices"]["H200"]["dense_below"] == 8192
    assert chosen["dense_below_decision"]["points"][1]["ms"] == pytest.approx(1.02)
    assert bds.chosen_settings(tour, "H200")["devices"]["H200"]["dense_below"] == 0  # no IF timings: not adopted


def test_a_refused_pdl_capture_sinks_no_other_variant(tmp_path, monkeypatch):
    """Issue 64 item 3: PDL (DEFERRED) is timed after every other variant of every point, its failure (here: the
    capture refused) is recorded with whether the device still works, every other variant is measured at every
    point, and the tournament chooses among those that ran and passed their check."""
    import bench_decode_step as bds

    order = []

    def fake_time_variant(w, budget, variant, args, breakdown=False):
        order.append((w.ctx, variant.name))
        if variant.name in bds.DEFERRED:
            raise RuntimeError("operation not permitted when stream is capturing")
        ms = 1.0 if variant is bds.NEW else 2.0
        return {"ms": ms, "steady_ms": ms, "amortized_ms": ms, "breakdown_ms": {}, "check": {"ok": True},
                "settings": variant.settings(), "block_over_steady": 1.0}

    monkeypatch.setattr(bds, "time_variant", fake_time_variant)
    rc = bds.main(["--dry-run", "--variants", "tournament", "--points", "1024x1", "2048x1", "--no-check",
                   "--no-branches", "--no-profile", "--name", "tournament", "--out", str(tmp_path)])
    assert rc == 0
    others = [v.name for v in bds.VARIANTS if v.name not in bds.DEFERRED]
    deferred = [v.name for v in bds.VARIANTS if v.name in bds.DEFERRED]
    assert deferred and order == [(c, n) for c in (1024, 2048) for n in others] + [(c, n) for c in (1024, 2048)
                                                                                   for n in deferred]
    rec = json.loads((tmp_path / "tournament.json").read_text())
    assert rec["complete"]
    for row in rec["rows"]:
        vs = row["variants"]["256"]
        assert all("error" not in vs[n] for n in others)
        assert vs[deferred[0]]["error"].startswith("RuntimeError") and vs[deferred[0]]["device_ok_after"] is True
    assert "'new: fused, triton attend'" in rec["chosen_settings"]["source"]


def test_points_are_context_by_batch():
    """The benchmarks' one --points parser: CONTEXTxBATCH, case-insensitive; anything else refused."""
    from sas_backend.testing.report import parse_points

    assert parse_points(["8192x1", "32768X8"]) == [(8192, 1), (32768, 8)]
    for bad in ("8192", "8192x1x2", "ax1"):
        with pytest.raises(ValueError):
            parse_points([bad])
