"""What a running sas server holds beside its KV pool against what its launch reserved (`/sas/info`'s pool state,
`memory`): the reservation (`backend.memory`, made before the backend exists) must leave room for every object
the backend then allocates, so SGLang's KV pool is never sized into memory sas takes later."""

from __future__ import annotations

import requests

from sas_backend.backend.memory import TRANSIENT


def assert_held_as_reserved(url: str, exact: bool = True) -> dict:
    """Every scheduler's held bytes by name equal its reserved ones (the prompt anchors' extend scratch aside: it
    exists only during an extend). exact=False (GPU: FlashInfer's per-graph wrappers appear as graphs are captured):
    the same names, each held <= reserved. Returns the first scheduler's `{"held", "reserved"}`."""
    pools = requests.get(f"{url}/sas/info", timeout=60).json()["pool"]
    assert pools, "no scheduler answered /sas/info"
    for rank, pool in enumerate(pools):
        memory = pool["memory"]
        assert memory is not None and memory["reserved"] is not None, (rank, memory)
        held, reserved = memory["held"], {k: v for k, v in memory["reserved"].items() if k != TRANSIENT}
        if exact:
            assert held == reserved, (rank, held, reserved)
        else:
            assert held.keys() == reserved.keys() and all(held[k] <= reserved[k] for k in held), (rank, held, reserved)
    return pools[0]["memory"]
