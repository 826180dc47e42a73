"""`gate.narrow`: a gate cut to a quarter of its width keeps rotary pairs whose frequencies are exactly the narrow
gate's own, so on the dims it keeps the cut gate's RoPE'd projections are the full gate's (the init a quarter-width
gate with 4 runs a block trains from)."""

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.gate.narrow import kept_dims, narrow_gate_tensors
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table


def test_kept_dims_are_every_rth_pair_in_both_halves():
    assert kept_dims(8, 4).tolist() == [0, 2, 4, 6]
    assert kept_dims(128, 32).tolist() == list(range(0, 64, 4)) + list(range(64, 128, 4))
    assert kept_dims(128, 128).tolist() == list(range(128))
    for bad in (3, 48, 256, 0):
        with pytest.raises(ValueError, match="even width dividing"):
            kept_dims(128, bad)


@pytest.mark.parametrize("theta", [1e4, 1e6])
def test_the_narrow_table_is_the_full_tables_kept_columns(theta):
    full, narrow = rope_cos_sin_table(128, 300, theta), rope_cos_sin_table(32, 300, theta)
    torch.testing.assert_close(narrow, full[:, kept_dims(128, 32)], rtol=1e-6, atol=1e-6)


def test_cut_gate_projects_and_rotates_as_the_full_gate_on_its_dims():
    torch.manual_seed(0)
    h_kv, g, d, dg, width = 2, 3, 16, 64, 16
    gate = AttnGate(h_kv, g, d, dg)
    for p in gate.parameters():
        p.data.normal_()
    tensors = {0: {k: v.detach().clone() for k, v in gate.state_dict().items()}}
    cut = narrow_gate_tensors(tensors, width)[0]
    assert cut["attngate_linear_q.weight"].shape == (h_kv, g, d, width)
    assert cut["attngate_linear_k.weight"].shape == (h_kv, 3 * d, width)
    assert cut["attngate_qnorm.weight"].shape == cut["attngate_knorm.weight"].shape == (width,)
    idx = kept_dims(dg, width)
    x = torch.randn(5, h_kv, 3 * d)
    pos = torch.tensor([0, 7, 64, 1000, 4095])
    full = apply_rope(torch.einsum("nhc,hcg->nhg", x, tensors[0]["attngate_linear_k.weight"]),
                      rope_cos_sin_table(dg, 4096, 1e6)[pos])
    narrow = apply_rope(torch.einsum("nhc,hcg->nhg", x, cut["attngate_linear_k.weight"]),
                        rope_cos_sin_table(width, 4096, 1e6)[pos])
    torch.testing.assert_close(narrow, full[..., idx], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cut["attngate_knorm.weight"], tensors[0]["attngate_knorm.weight"][idx])
