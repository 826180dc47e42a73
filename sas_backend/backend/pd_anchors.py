"""Prompt anchors across prefill-decode disaggregation (`--disaggregation-mode prefill|decode`).

The anchors (`--sas-prompt-anchors R`: per request, sparse layer and kv head, the R blocks the prompt's last token
attended most; backend/anchor_pool.py) are computed at the prompt's extend, which a PD pair runs on the prefill
server. They travel with the request's first output token: SGLang's PD metadata (`disaggregation.utils.
MetadataBuffers`, one row per request moved by the transfer engine beside the KV pages) gets one more int32 buffer,
`sas_prompt_anchors`, appended last to the buffers it registers. A `sas` prefill server writes the request's
anchors there when SGLang fills the row (`set_buf`); the decode server reads them when it commits the transfer
(`DecodeTransferQueue._commit_transfer_to_req`) into its anchor pool at the request's slot, before the request's
first decode step. The decode step then reads them as a colocated server's does. A request the decode server
retracts with its KV backed up (`--disaggregation-decode-retraction-backup`) keeps its anchors on the request and
gets them back in the slot it resumes in (`backup_kv_cache` / `restore_kv_cache`).

Wire format: every PD server whose process loads this plugin adds the buffer, prefill and decode side alike,
whatever its attention backend and flags (a dense prefill server sends rows no decode server accepts; a decode
server without anchors ignores them), so any two such servers register the same buffers: SGLang's transfer engines
address a row on one side with the other side's row length and buffer index. The width depends only on the model
(`slot_width`). A server without this plugin registers one buffer fewer: install sas-backend on both sides (read
from SGLang 0.5.21's Mooncake path, not run: a prefill server without it indexes its own shorter list with the
decode side's buffers and fails the transfer; the other way round the extra buffer is not sent; docs/pd.md).

A row is `[HEADER]` int32 (magic, the request's bootstrap room as two int32, R, the sparse layer count, the first
sparse layer, kv heads, 0), then `[layers, kv heads, R]` block ids. The decode server takes a row only when its
magic and room are the request's and its R and layers are its own; otherwise the request decodes without anchors,
counted as missing (GET /sas/info: `pd_prompt_anchors`) with one warning a reason.
"""

from __future__ import annotations

import logging
import pkgutil
import threading
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

CAPACITY = 8  # anchors a (layer, kv head) row holds: the most --sas-prompt-anchors a PD decode server serves
HEADER = 8
MAGIC = 0x5A5A0A0C
BUFFER = "sas_prompt_anchors"

INIT_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"
BUFFERS_INIT = "sglang.srt.disaggregation.utils.MetadataBuffers.__init__"
BUF_INFOS = "sglang.srt.disaggregation.utils.MetadataBuffers.get_buf_infos"
SET_BUF = "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf"
COMMIT = "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
# A retracted request's KV backed up and restored later into another request slot (the decode server's retraction
# backup, cpu_tensor or host_pool): its anchors go with it. The names as the calling modules import them.
BACKUP = "sglang.srt.managers.schedule_batch.backup_kv_cache"
RESTORE = "sglang.srt.disaggregation.decode.restore_kv_cache"
TARGETS = (INIT_TARGET, BUFFERS_INIT, BUF_INFOS, SET_BUF, COMMIT, BACKUP, RESTORE)
STASH = "_sas_prompt_anchors"  # a retracted request's anchors, `[layers, kv heads, R]` on the host


def slot_width(num_layers: int, num_kv_heads: int) -> int:
    """int32 entries of one request's row for a model of `num_layers` layers and `num_kv_heads` kv heads (a TP
    rank's): the header and CAPACITY anchors per (layer, kv head)."""
    return HEADER + int(num_layers) * int(num_kv_heads) * CAPACITY


def _room_words(room: int) -> list:
    return np.array([int(room or 0) % 2**64], dtype=np.uint64).view(np.int32).tolist()


def encode(anchors: torch.Tensor, room: int, first_layer: int, width: int) -> torch.Tensor:
    """One request's row: `[width]` int32 (CPU). anchors: `[layers, kv_heads, R]` int32 block ids (-1: none)."""
    layers, heads, count = anchors.shape
    if HEADER + anchors.numel() > width:
        raise ValueError(f"{layers} layers x {heads} kv heads x {count} anchors exceed the PD row of {width} entries")
    row = torch.full((width,), -1, dtype=torch.int32)
    row[:HEADER] = torch.tensor([MAGIC, *_room_words(room), count, layers, first_layer, heads, 0], dtype=torch.int32)
    row[HEADER: HEADER + anchors.numel()] = anchors.reshape(-1).to(device="cpu", dtype=torch.int32)
    return row


def decode(row: torch.Tensor, room: int, count: int, first_layer: int, layers: int, heads: int):
    """(`[layers, heads, count]` int32 anchors, None) from a received row when it is the request's and matches this
    server's anchors, else (None, why)."""
    head = row[:HEADER].tolist()
    if head[0] != MAGIC:
        return None, ("the prefill server sent no prompt anchors (serve it with --attention-backend sas and prompt "
                      "anchors)")
    if head[1:3] != _room_words(room):
        return None, "the anchor row belongs to another request (bootstrap room mismatch)"
    sent = {"prompt anchors": head[3], "sparse layers": head[4], "first sparse layer": head[5], "kv heads": head[6]}
    want = {"prompt anchors": count, "sparse layers": layers, "first sparse layer": first_layer, "kv heads": heads}
    if sent != want:
        return None, f"the prefill server's anchors ({sent}) are not this server's ({want})"
    n = layers * heads * count
    return row[HEADER: HEADER + n].reshape(layers, heads, count).clone(), None


class _Served:
    """This process's anchor pool (the sas backend's, when it keeps anchors) and what arrived for it."""

    def __init__(self):
        self.pool = None  # an AnchorPool
        self.model_shape: Optional[tuple] = None  # (layers, kv heads) while the scheduler builds its PD buffers
        self.received = 0
        self.missing = 0
        self.restored = 0
        self._warned: set = set()
        self._lock = threading.Lock()

    def counts(self) -> dict:
        return {"received": self.received, "missing": self.missing, "restored": self.restored}

    def warn_once(self, reason: str) -> None:
        with self._lock:
            self.missing += 1
            if reason in self._warned:
                return
            self._warned.add(reason)
        logger.warning("sas: a transferred request decodes without prompt anchors: %s (GET /sas/info counts them "
                       "under pd_prompt_anchors.missing)", reason)


SERVED = _Served()


def attach(pool) -> None:
    """Called by the sas backend that keeps prompt anchors (the target model's: the first to attach)."""
    if SERVED.pool is None:
        SERVED.pool = pool


def hooks_available() -> bool:
    """Whether this SGLang has every function the transfer hooks wrap."""
    for target in TARGETS:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            return False
    return True


def register(registry, hook_type) -> None:
    """Plugin hook registration (every SGLang process); nothing happens outside PD modes."""
    if not hooks_available():
        logger.debug("sas: this SGLang lacks a PD metadata function; prompt anchors do not travel under PD")
        return
    registry.register(INIT_TARGET, _around_init_disaggregation, hook_type.AROUND)
    registry.register(BUFFERS_INIT, _around_buffers_init, hook_type.AROUND)
    registry.register(BUF_INFOS, _around_buf_infos, hook_type.AROUND)
    registry.register(SET_BUF, _around_set_buf, hook_type.AROUND)
    registry.register(COMMIT, _around_commit, hook_type.AROUND)
    registry.register(BACKUP, _around_backup, hook_type.AROUND)
    registry.register(RESTORE, _around_restore, hook_type.AROUND)


def _around_init_disaggregation(original, scheduler, *args, **kwargs):
    """The model's shape, for the MetadataBuffers built inside."""
    # init_disaggregation itself sets scheduler.disaggregation_mode: the launch flag says it beforehand
    mode = str(getattr(scheduler.server_args, "disaggregation_mode", None) or "null").lower()
    if mode in ("prefill", "decode"):
        cfg = scheduler.model_config
        tp = int(getattr(scheduler, "attn_tp_size", None) or getattr(scheduler, "tp_size", 1) or 1)
        SERVED.model_shape = (int(cfg.num_hidden_layers), int(cfg.get_num_kv_heads(tp)))
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        SERVED.model_shape = None


def _around_buffers_init(original, buffers, *args, **kwargs):
    original(buffers, *args, **kwargs)
    setattr(buffers, BUFFER, None)
    if SERVED.model_shape is not None:
        rows, width = buffers.output_ids.shape[0], slot_width(*SERVED.model_shape)
        setattr(buffers, BUFFER, torch.full((rows, width), -1, dtype=torch.int32, device=buffers.output_ids.device))
        logger.info("sas: SGLang's PD metadata carries prompt anchors: %d rows x %d int32 (%.1f MiB of host memory)",
                    rows, width, rows * width * 4 / 2**20)


def _around_buf_infos(original, buffers, *args, **kwargs):
    ptrs, data_lens, item_lens = original(buffers, *args, **kwargs)
    buf = getattr(buffers, BUFFER, None)
    if buf is not None:  # last, so every SGLang buffer keeps its index
        ptrs, data_lens, item_lens = [*ptrs, buf.data_ptr()], [*data_lens, buf.nbytes], [*item_lens, buf[0].nbytes]
    return ptrs, data_lens, item_lens


def _slot(req) -> Optional[int]:
    kv = getattr(req, "kv", req)  # SGLang 0.5.21+ keeps the slot under req.kv
    idx = getattr(kv, "req_pool_idx", None)
    return None if idx is None else int(idx)


def _fake(req) -> bool:
    try:
        from sglang.srt.disaggregation.utils import _is_fake_transfer
    except ImportError:
        return False
    return bool(_is_fake_transfer(req))


def _around_set_buf(original, buffers, req, *args, **kwargs):
    """Prefill side: the request's anchors into its metadata row (or an invalid row)."""
    result = original(buffers, req, *args, **kwargs)
    buf = getattr(buffers, BUFFER, None)
    if buf is None:
        return result
    idx = req.metadata_buffer_index
    pool, slot = SERVED.pool, _slot(req)
    if pool is None or slot is None:
        buf[idx].fill_(-1)
        return result
    buf[idx].copy_(encode(_rows(pool, slot), req.bootstrap_room, min(pool.anchors), buf.shape[1]))
    return result


def _rows(pool, slot: int) -> torch.Tensor:
    """`[layers, kv heads, R]` int32 on the host: one request slot's anchors in every sparse layer (one copy)."""
    return torch.stack([pool[lid][slot] for lid in sorted(pool.anchors)]).cpu()


def _write(pool, slot: int, rows: Optional[torch.Tensor]) -> None:
    """rows (None: none, -1) into every sparse layer's anchors at `slot`, complete before this returns."""
    layers = sorted(pool.anchors)
    device = pool[layers[0]].device
    if rows is not None:
        rows = rows.to(device)
    for i, lid in enumerate(layers):
        pool[lid][slot] = -1 if rows is None else rows[i]
    if device.type == "cuda":  # the request's next step may run on SGLang's forward stream
        torch.cuda.current_stream(device).synchronize()


def _around_backup(original, req, *args, **kwargs):
    """Decode side, a request retracted with its KV backed up: its anchors kept on the request (its slot is freed)."""
    pool, slot = SERVED.pool, _slot(req)
    if pool is not None and slot is not None:
        setattr(req, STASH, _rows(pool, slot))
    return original(req, *args, **kwargs)


def _around_restore(original, req, *args, **kwargs):
    """Decode side, a retracted request resumed in a new slot with its KV restored: its anchors there too."""
    result = original(req, *args, **kwargs)
    rows, pool, slot = getattr(req, STASH, None), SERVED.pool, _slot(req)
    if rows is not None and pool is not None and slot is not None:
        _write(pool, slot, rows)
        setattr(req, STASH, None)
        SERVED.restored += 1
    return result


def _around_commit(original, queue, decode_req, *args, **kwargs):
    """Decode side: after SGLang commits the transfer, the request's anchors into this server's pool."""
    buf = getattr(queue.metadata_buffers, BUFFER, None)
    pool = SERVED.pool
    row = None if buf is None else buf[decode_req.metadata_buffer_index].clone()  # before SGLang frees the row
    result = original(queue, decode_req, *args, **kwargs)
    req = decode_req.req
    slot = _slot(req)
    if pool is None or row is None or slot is None or req.finished():
        return result
    layers = sorted(pool.anchors)
    if _fake(req):  # SGLang's warmup (or the `fake` backend): no prefill server, nothing to receive or count
        _write(pool, slot, None)
        return result
    got, why = decode(row, req.bootstrap_room, pool.count, layers[0], len(layers), pool[layers[0]].shape[1])
    if got is None:
        SERVED.warn_once(why)
        _write(pool, slot, None)
        return result
    _write(pool, slot, got)
    SERVED.received += 1
    return result
