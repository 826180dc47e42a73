"""Make PyPI's (CUDA) torchvision importable next to CPU torch; idempotent.

`torchvision/_meta_registrations.py` registers fake kernels for `torchvision::nms` and
`torchvision::qnms`, ops that only its compiled extension defines. With a CPU build of torch
that extension does not load, so the registration raises and the whole import fails. We skip
those two registrations when the op does not exist; nothing else changes.
"""

import importlib.util
import pathlib
import sys

MARK = "# sas-backend: guarded for CPU torch"
GUARD = '''{mark}
def _sas_register_fake_if_defined(name):
    try:
        torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        return torch.library.register_fake(name)
    except RuntimeError:
        return lambda fn: fn
'''


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("[patch_torchvision_cpu] torchvision not installed; nothing to do")
        return 0
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    src = path.read_text()
    if MARK in src:
        print(f"[patch_torchvision_cpu] already patched: {path}")
        return 0
    targets = ['@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")']
    if not all(t in src for t in targets):
        print(f"[patch_torchvision_cpu] unexpected file layout, left unchanged: {path}", file=sys.stderr)
        return 0
    for t in targets:
        src = src.replace(t, t.replace("torch.library.register_fake", "_sas_register_fake_if_defined"))
    anchor = "import torchvision.extension  # noqa: F401\n"
    src = src.replace(anchor, anchor + GUARD.format(mark=MARK), 1)
    path.write_text(src)
    print(f"[patch_torchvision_cpu] patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
