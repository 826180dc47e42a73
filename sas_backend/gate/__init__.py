"""The AttnGate block selector and its checkpoints.

`sas_backend.gate.module.AttnGate` (the per-layer module) and `sas_backend.gate.checkpoint`
(save/load/validate/shard gate checkpoints) are imported from their modules directly.
"""
