"""4-bit key codes (`ops.key_codes`): the Triton kernel and the torch path against the plain statement, bit for bit
(codes and fp16 scales), on bf16 / fp32 / fp8 keys with outlier channels, a constant channel, head dims that are and
are not a power of two, skipped (-1) entries and untouched pages; the decoded keys within half a step."""

import pytest
import torch

from sas_backend.ops.key_codes import code_bytes, decode_pages, encode_pages
from sas_backend.ops.key_codes import naive
from tests.devices import DEVICE

B = 16


def _keys(pages: int, h_kv: int, d: int, dtype, seed: int = 0):
    """(k_buffer [pages * B, h_kv, d] on DEVICE, k_scale): random keys, a few outlier channels, channel 1 of every
    head constant (step 0)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(pages * B, h_kv, d, generator=gen)
    kv[:, :, :3] *= 20  # outlier channels, as real keys have (their own range per block)
    kv[:, :, 1] = 0.75
    if dtype == torch.float8_e4m3fn:
        return (kv / 0.5).to(dtype).to(DEVICE), 0.5
    return kv.to(dtype).to(DEVICE), 1.0


def _pools(pages: int, h_kv: int, d: int):
    packed = torch.full((pages, h_kv, B * d // 2), 7, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((pages, h_kv, 2, d), -3.0, dtype=torch.float16, device=DEVICE)
    return packed, scales


def _statement(k_buffer, listed, k_scale):
    return naive.encode_pages(k_buffer.cpu(), [p for p in listed if p >= 0], B, k_scale)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype,d,h_kv", [(torch.float32, 32, 1), (torch.bfloat16, 64, 3),
                                          (torch.bfloat16, 48, 2), (torch.float8_e4m3fn, 32, 2)])
def test_codes_match_the_statement(kernel, dtype, d, h_kv):
    k_buffer, k_scale = _keys(7, h_kv, d, dtype, seed=d + h_kv)
    listed = [5, -1, 2, 6, -1]
    packed, scales = _pools(7, h_kv, d)
    encode_pages(k_buffer, torch.tensor(listed, device=DEVICE), B, packed, scales, k_scale, kernel=kernel)
    want = _statement(k_buffer, listed, k_scale)
    for page in range(7):
        if page in want:
            assert torch.equal(packed[page].cpu(), want[page][0]), page
            assert torch.equal(scales[page].cpu(), want[page][1]), page
        else:  # not listed: untouched
            assert bool((packed[page] == 7).all()) and bool((scales[page] == -3.0).all()), page


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_keys_are_within_half_a_step(dtype):
    """key = lo + step * code: within step / 2 of the key (plus fp16's rounding of lo and step), the min exact, a
    constant channel exact, and much closer than 2 bits would be."""
    k_buffer, _ = _keys(4, 2, 32, dtype, seed=3)
    packed, scales = _pools(4, 2, 32)
    encode_pages(k_buffer, torch.arange(4, device=DEVICE), B, packed, scales)
    got = decode_pages(packed, scales, torch.arange(4, device=DEVICE), B)  # [4, H_kv, b, D]
    keys = k_buffer.float().view(4, B, 2, 32).permute(0, 2, 1, 3)
    step = scales[:, :, 1].float()[:, :, None, :]
    lo = scales[:, :, 0].float()[:, :, None, :]
    tol = step / 2 + 16 * step * 2 ** -11 + (keys.amin(2, keepdim=True) - lo).abs()
    assert bool(((got - keys).abs() <= tol + 1e-6).all())
    assert torch.equal(got[:, :, :, 1], keys[:, :, :, 1])  # the constant channel: step 0, decoded exactly
    assert float((got - keys).abs().mean()) < float(keys.std()) / 15


def test_decode_reads_any_page_shape():
    """decode_pages takes pages of any shape ([rows, H_kv, C] as the second level holds them)."""
    k_buffer, _ = _keys(5, 2, 32, torch.float32, seed=4)
    packed, scales = _pools(5, 2, 32)
    encode_pages(k_buffer, torch.arange(5, device=DEVICE), B, packed, scales)
    pages = torch.tensor([[3, 1], [0, 4]], device=DEVICE)
    got = decode_pages(packed, scales, pages, B)
    assert got.shape == (2, 2, 2, B, 32)
    assert torch.equal(got[1, 0], decode_pages(packed, scales, torch.tensor([0], device=DEVICE), B)[0])


def test_the_screen_measured_these_codes():
    """`hf.candidates.quantize_keys(k, 4)` (what bench/results/2026-12-07-quantized-rerank measured) and these codes
    decode to the same keys up to fp16's rounding of lo and step: at most one step apart, equal at nearly all
    values."""
    from sas_backend.hf.candidates import quantize_keys

    k_buffer, _ = _keys(6, 2, 32, torch.float32, seed=5)
    packed, scales = _pools(6, 2, 32)
    encode_pages(k_buffer, torch.arange(6, device=DEVICE), B, packed, scales)
    got = decode_pages(packed, scales, torch.arange(6, device=DEVICE), B).permute(0, 2, 1, 3).reshape(-1, 2, 32)
    screen = quantize_keys(k_buffer.cpu(), 4, B)
    step = scales[:, :, 1].float().repeat_interleave(B, 0).cpu()  # [slots, H_kv, D]
    diff = (got.cpu() - screen).abs()
    assert bool((diff <= step * 1.01 + 1e-5).all())
    assert float((diff > step * 0.01 + 1e-5).float().mean()) < 0.02


def test_bad_arguments_are_refused():
    k_buffer, _ = _keys(2, 2, 32, torch.float32)
    packed, scales = _pools(2, 2, 32)
    pages = torch.arange(2, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        encode_pages(torch.zeros(2 * B, 2, 31, device=DEVICE), pages, B, packed, scales)
    with pytest.raises(ValueError, match="packed"):
        encode_pages(k_buffer, pages, B, packed.to(torch.int16), scales)
    with pytest.raises(ValueError, match="scales"):
        encode_pages(k_buffer, pages, B, packed, scales.float())
    assert code_bytes(64, 128) == 4608  # 0.28 of a block's bf16 keys (16384 bytes)
