"""TRITON_INTERPRET=1 (Triton kernels on CPU) is set by the top-level tests/conftest.py only
where CUDA is unavailable, before any `sas_backend.training.ops.*` import; on a GPU the kernels
compile. Kernel tests build their inputs on tests.devices.DEVICE."""

from tests.devices import DEVICE, _no_tf32  # noqa: F401  (_no_tf32: autouse fixture)
