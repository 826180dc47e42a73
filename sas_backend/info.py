"""GET /sas/info: the SAS configuration, gate checkpoint identity and KV/summary pool state of the server."""

from __future__ import annotations

import functools
import os

from sas_backend import __version__
from sas_backend.config import SETTINGS, SASConfig, SASConfigError


def sas_info() -> dict:
    """JSON body: package version, SAS config (from the same env the schedulers read), gate identity.

    Computed once per server: loading and hashing the gate on every request would cost a full
    read of the weights each time. The cache is keyed on the `SAS_*` variables (fixed once the
    launcher has applied the flags), so a process whose settings change gets a fresh body.
    """
    key = tuple(os.environ.get(s.env) for s in SETTINGS) + (os.environ.get("SAS_ACTIVE"),)
    return dict(_info_for(key))


@functools.lru_cache(maxsize=4)
def _info_for(_env_key: tuple) -> dict:
    import sglang

    try:
        cfg = SASConfig.from_env()
        body = {
            "sas_backend": __version__,
            "sglang": sglang.__version__,
            "active": os.environ.get("SAS_ACTIVE") == "1",  # --attention-backend sas on this server
            "config": cfg.as_dict(),
        }
    except SASConfigError as e:
        return {"sas_backend": __version__, "error": str(e)}
    if cfg.gate_path:
        try:
            from sas_backend.gate.gate_file import checkpoint_identity

            body["gate"] = checkpoint_identity(cfg.gate_path)
        except Exception as e:  # report, never break the route
            body["gate"] = {"path": cfg.gate_path, "error": str(e)}
    return body


async def sas_info_route(pool: bool = True) -> dict:
    """The route: `sas_info()` plus, unless `?pool=false`, `"pool"`: one entry per scheduler (data-
    parallel rank) with its KV pages and summary rows (`pool_state.scheduler_pool_state`), asked
    through SGLang's internal-state request (answered between batches: a long prefill delays it)."""
    body = sas_info()
    if pool:
        body["pool"] = await _scheduler_pool_states()
    return body


async def _scheduler_pool_states():
    from sas_backend.pool_state import STATE_KEY

    try:
        from sglang.srt.entrypoints.http_server import get_global_state

        states = await get_global_state().tokenizer_manager.get_internal_state()
    except Exception as e:  # report, never break the route
        return {"error": f"{type(e).__name__}: {e}"}
    return [s.get(STATE_KEY) for s in states]
