"""`python -m sas_backend.bench TOOL ...`: see sas_backend/bench/__init__.py."""

import sys

from sas_backend.bench import main

if __name__ == "__main__":
    sys.exit(main())
