"""Prompt anchors across PD (backend/pd_anchors.py): the row format, and the hooks on SGLang's real
`MetadataBuffers` (one more buffer, last, of a width both sides agree on; the prefill side's row from its anchor
pool; the decode side's pool row from the received one). The pair of real servers: tests/server/test_pd.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sas_backend.backend import pd_anchors
from sas_backend.backend.anchor_pool import AnchorPool

MetadataBuffers = pytest.importorskip("sglang.srt.disaggregation.utils").MetadataBuffers

LAYERS, HEADS, COUNT, FIRST = 6, 3, 4, 2  # a model of 6 layers, sparse from layer 2: 4 sparse layers
ROOM = 2**62 + 12345


def _anchors(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, 500, (LAYERS - FIRST, HEADS, COUNT), generator=g, dtype=torch.int32)
    out[0, 1, 3] = -1  # a head with fewer blocks than anchors
    return out


def test_row_round_trip_and_rejections():
    width = pd_anchors.slot_width(LAYERS, HEADS)
    assert width == pd_anchors.HEADER + LAYERS * HEADS * pd_anchors.CAPACITY
    sent = _anchors(0)
    row = pd_anchors.encode(sent, ROOM, FIRST, width)
    assert row.shape == (width,) and row.dtype == torch.int32
    got, why = pd_anchors.decode(row, ROOM, COUNT, FIRST, LAYERS - FIRST, HEADS)
    assert why is None and torch.equal(got, sent)
    # another request's row, an empty row, other anchors than this server's
    assert pd_anchors.decode(row, ROOM + 1, COUNT, FIRST, LAYERS - FIRST, HEADS)[1].endswith("mismatch)")
    empty = torch.full((width,), -1, dtype=torch.int32)
    assert "sent no prompt anchors" in pd_anchors.decode(empty, ROOM, COUNT, FIRST, LAYERS - FIRST, HEADS)[1]
    assert "not this server's" in pd_anchors.decode(row, ROOM, 2, FIRST, LAYERS - FIRST, HEADS)[1]
    assert "not this server's" in pd_anchors.decode(row, ROOM, COUNT, FIRST + 1, LAYERS - FIRST, HEADS)[1]
    with pytest.raises(ValueError, match="exceed the PD row"):
        pd_anchors.encode(torch.zeros(LAYERS, HEADS, pd_anchors.CAPACITY + 1, dtype=torch.int32), ROOM, 0, width)


def _scheduler(mode: str):
    cfg = SimpleNamespace(num_hidden_layers=LAYERS, get_num_kv_heads=lambda tp: HEADS // tp)
    return SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode=mode), model_config=cfg, tp_size=1)


def _buffers(mode: str, pool) -> MetadataBuffers:
    """SGLang's MetadataBuffers as its scheduler builds them in `mode`, through the plugin's hooks, with `pool` as
    this process's anchor pool."""
    saved = pd_anchors.SERVED.pool
    pd_anchors.SERVED.pool = pool
    try:
        built = {}

        def init_disaggregation(scheduler):
            buffers = MetadataBuffers.__new__(MetadataBuffers)
            pd_anchors._around_buffers_init(MetadataBuffers.__init__, buffers, 8, hidden_size=16,
                                            hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
            built["buffers"] = buffers

        pd_anchors._around_init_disaggregation(init_disaggregation, _scheduler(mode))
        return built["buffers"]
    finally:
        pd_anchors.SERVED.pool = saved


def _infos(buffers):
    return pd_anchors._around_buf_infos(MetadataBuffers.get_buf_infos, buffers)


def test_both_sides_register_one_more_buffer_last_of_the_same_width():
    pool = AnchorPool(range(FIRST, LAYERS), 5, HEADS, COUNT, "cpu")
    prefill_dense, prefill_sas = _buffers("prefill", None), _buffers("prefill", pool)
    decode_sas = _buffers("decode", pool)
    stock = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
    base = stock.get_buf_infos()
    for buffers in (prefill_dense, prefill_sas, decode_sas):
        ptrs, data_lens, item_lens = _infos(buffers)
        assert item_lens[:-1] == base[2] and data_lens[:-1] == base[1]  # SGLang's own buffers keep their index
        assert item_lens[-1] == 4 * pd_anchors.slot_width(LAYERS, HEADS)
        assert ptrs[-1] == getattr(buffers, pd_anchors.BUFFER).data_ptr()
    # a decode server without prompt anchors (or not sas) registers it too: any two PD servers with the plugin agree;
    # outside PD nothing changes
    assert _infos(_buffers("decode", None))[2] == _infos(decode_sas)[2]
    assert _infos(_buffers("null", pool))[2] == base[2]


def _req(slot: int, room: int, index: int, host: str = "127.0.0.1"):
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=slot), bootstrap_room=room, metadata_buffer_index=index,
                           bootstrap_host=host, finished=lambda: False)


def test_prefill_row_reaches_the_decode_pool():
    prefill_pool = AnchorPool(range(FIRST, LAYERS), 5, HEADS, COUNT, "cpu")
    sent = _anchors(1)
    for i, lid in enumerate(range(FIRST, LAYERS)):
        prefill_pool[lid][3] = sent[i]
    prefill = _buffers("prefill", prefill_pool)
    saved = pd_anchors.SERVED.pool
    try:
        pd_anchors.SERVED.pool = prefill_pool
        pd_anchors._around_set_buf(lambda *a: None, prefill, _req(3, ROOM, 6))
        row = getattr(prefill, pd_anchors.BUFFER)[6].clone()
        assert torch.equal(row, pd_anchors.encode(sent, ROOM, FIRST, row.numel()))
        # a dense prefill server (no pool) sends an invalid row
        dense = _buffers("prefill", None)
        pd_anchors.SERVED.pool = None
        pd_anchors._around_set_buf(lambda *a: None, dense, _req(3, ROOM, 6))
        assert int(getattr(dense, pd_anchors.BUFFER)[6, 0]) == -1

        decode_pool = AnchorPool(range(FIRST, LAYERS), 7, HEADS, COUNT, "cpu")
        pd_anchors.SERVED.pool = decode_pool
        decode = _buffers("decode", decode_pool)
        queue = SimpleNamespace(metadata_buffers=decode)
        before = pd_anchors.SERVED.counts()

        def commit(received_row, slot, room, host="127.0.0.1"):
            getattr(decode, pd_anchors.BUFFER)[2] = received_row  # what the transfer engine wrote
            freed = []  # SGLang frees the metadata row inside the commit: the hook read it before

            def original(q, decode_req):
                getattr(decode, pd_anchors.BUFFER)[2] = 0
                freed.append(True)
            decode_req = SimpleNamespace(req=_req(slot, room, 2, host), metadata_buffer_index=2)
            pd_anchors._around_commit(original, queue, decode_req)
            assert freed

        commit(row, 5, ROOM)
        for i, lid in enumerate(range(FIRST, LAYERS)):
            assert torch.equal(decode_pool[lid][5], sent[i])
        after = pd_anchors.SERVED.counts()
        assert after["received"] == before["received"] + 1
        # another request's row (or a dense prefill server's) leaves the slot without anchors, counted
        decode_pool[FIRST][4] = 9
        commit(row, 4, ROOM + 1)
        assert all(int(decode_pool[lid][4].max()) == -1 for lid in range(FIRST, LAYERS))
        assert pd_anchors.SERVED.counts()["missing"] == after["missing"] + 1
        # SGLang's warmup request (a fake transfer, no prefill server): no anchors, not counted
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        decode_pool[FIRST][1] = 9
        counts = pd_anchors.SERVED.counts()
        commit(row, 1, ROOM, host=FAKE_BOOTSTRAP_HOST)
        assert int(decode_pool[FIRST][1].max()) == -1 and pd_anchors.SERVED.counts() == counts
    finally:
        pd_anchors.SERVED.pool = saved


def test_retracted_request_takes_its_anchors_to_its_new_slot():
    """The decode server retracts a request with its KV backed up (its slot freed, perhaps reused) and resumes it
    in another slot: its anchors follow it there."""
    pool = AnchorPool(range(FIRST, LAYERS), 7, HEADS, COUNT, "cpu")
    sent = _anchors(2)
    for i, lid in enumerate(range(FIRST, LAYERS)):
        pool[lid][2] = sent[i]
    req = _req(2, ROOM, 0)
    saved = pd_anchors.SERVED.pool
    try:
        pd_anchors.SERVED.pool = pool
        before = pd_anchors.SERVED.counts()["restored"]
        assert pd_anchors._around_backup(lambda r, *a: True, req, "tree", "pool", "alloc", "cpu_tensor") is True
        for lid in range(FIRST, LAYERS):
            pool[lid][2] = 99  # the freed slot handed to another request

        def resume(r, *a):
            r.kv.req_pool_idx = 6  # SGLang's _pre_alloc gives it a new slot before the restore

        pd_anchors._around_restore(resume, req, "tree", "pool", "alloc", "cpu_tensor")
        for i, lid in enumerate(range(FIRST, LAYERS)):
            assert torch.equal(pool[lid][6], sent[i])
        assert pd_anchors.SERVED.counts()["restored"] == before + 1
        assert getattr(req, pd_anchors.STASH) is None
    finally:
        pd_anchors.SERVED.pool = saved
