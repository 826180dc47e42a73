"""Triton kernels run on CPU under the interpreter: the variable must be set before triton
decorates any kernel, i.e. before the first `sas_backend.training.ops.*` import."""

import os

os.environ["TRITON_INTERPRET"] = "1"
