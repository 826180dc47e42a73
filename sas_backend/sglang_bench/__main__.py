"""`python -m sas_backend.sglang_bench TOOL ...`: see sas_backend/sglang_bench/__init__.py."""

import sys

from sas_backend.sglang_bench import main

if __name__ == "__main__":
    sys.exit(main())
