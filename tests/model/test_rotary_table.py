"""The fused path's cos/sin table against ``rotary`` computed per step (the ground truth)."""

import pytest
import torch

from pagedllm.model.config import RopeConfig
from pagedllm.model.llama import RotaryTable, rope_inv_freq, rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_matches_rotary_per_step(dtype):
    inv_freq = rope_inv_freq(RopeConfig(theta=10000.0), 64)
    table = RotaryTable(inv_freq)
    gen = torch.Generator().manual_seed(0)
    for num_positions in (1, 17, 900, 3000):  # grows twice, past its first 1024 rows
        positions = torch.randint(0, num_positions, (67,), generator=gen)
        cos, sin = table.lookup(positions, dtype, num_positions)
        want_cos, want_sin = rotary(positions, inv_freq, dtype)
        assert cos.shape == sin.shape == (67, 64) and cos.dtype == dtype
        # torch's vector and scalar cos/sin may differ in a float32 ulp
        atol = 1e-6 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(cos, want_cos, atol=atol, rtol=0)
        torch.testing.assert_close(sin, want_sin, atol=atol, rtol=0)
    assert table.table[0].shape[0] == 4096


def test_lookup_rebuilds_for_another_dtype_and_refuses_positions_past_the_table():
    table = RotaryTable(rope_inv_freq(RopeConfig(theta=10000.0), 8))
    positions = torch.tensor([0, 5, 3])
    cos32, _ = table.lookup(positions, torch.float32, 6)
    cos16, _ = table.lookup(positions, torch.bfloat16, 6)
    assert cos16.dtype == torch.bfloat16
    torch.testing.assert_close(cos16.float(), cos32, atol=2**-8, rtol=0)
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([5000]), torch.bfloat16, 6)  # a caller's wrong bound
