"""Where the project's prepared files live: the default model and the text corpora.

In a source checkout (the package imported from the repository, as an editable install does) they
live under `<repo>/models/` (gitignored), where `serve/prepare_model.py` and `serve/prepare_text.py`
put them. An installed package has no repository, so there they live under `<cache>/models/`, the
cache being `$SAS_CACHE_DIR` or `~/.cache/sas-backend` (the serve scripts' download cache).
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def source_checkout() -> Optional[pathlib.Path]:
    """The repository this package was imported from, or None for an installed package."""
    root = pathlib.Path(__file__).resolve().parent.parent
    # site-packages holds neither file; a checkout holds both
    if (root / "pyproject.toml").is_file() and (root / "serve").is_dir():
        return root
    return None


def cache_dir() -> pathlib.Path:
    """`$SAS_CACHE_DIR`, else `~/.cache/sas-backend`."""
    return pathlib.Path(os.environ.get("SAS_CACHE_DIR") or pathlib.Path.home() / ".cache" / "sas-backend")


def models_dir() -> pathlib.Path:
    """`<repo>/models` in a source checkout, `<cache>/models` otherwise."""
    repo = source_checkout()
    return (repo if repo is not None else cache_dir()) / "models"


def default_model_dir() -> pathlib.Path:
    """The prepared default model (SmolLM2-135M-Instruct as an HF directory)."""
    return models_dir() / DEFAULT_MODEL_NAME
