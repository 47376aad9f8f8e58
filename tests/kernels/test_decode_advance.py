"""`kernels.advance_decode`: one launch doing the rollout engine's `DecodeInputs.advance` and the [2, B] record
of a step, checked bit for bit against that torch reference (integer arithmetic, and a float copy of the token
id and log-prob, so no tolerance)."""

import pytest
import torch

from orbit_lightning import kernels
from orbit_lightning.rollout.blocks import NULL_BLOCK
from orbit_lightning.rollout.runner import DecodeInputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(b: int, w: int, page: int, device: str, seed: int) -> DecodeInputs:
    """b rows: real ones with random tables and positions (some at a block's last slot, so the next position
    needs the next block; some with the table's last block full, where the clamp applies) and padding rows
    (token 0 at position 0, an all-null table), as the graphs pad a batch bucket."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 100, (b, w), generator=g)
    pos = torch.randint(0, w * page, (b, 1), generator=g)
    pos[0, 0] = page - 1  # the next token opens block 1
    pos[1 % b, 0] = w * page - 1  # past the table: the clamp keeps the read in bounds
    pad = b // 3
    if pad:
        table[-pad:], pos[-pad:] = NULL_BLOCK, 0
    slots = table.gather(1, pos // page) * page + pos % page
    fields = (torch.randint(0, 1000, (b, 1), generator=g), pos, slots, table, pos[:, 0] + 1, torch.rand(b, generator=g),
              torch.randint(0, 99, (b,), generator=g), torch.randint(0, 50, (b,), generator=g))
    return DecodeInputs(*(t.to(device) for t in fields))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [1, 5, 1100])  # 1100: two programs of 1024 rows
def test_advance_decode_equals_decode_inputs_advance(device, b, request):
    if device == "cpu":
        request.getfixturevalue("cpu_kernels")
    page, w = 4, 8
    ref = _inputs(b, w, page, device, seed=b)
    got = _inputs(b, w, page, device, seed=b)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 151936, (b,), generator=g).to(device)
    logprobs = -torch.rand(b, generator=g).to(device) * 20
    out = kernels.advance_decode(tokens, logprobs, got.ids, got.positions, got.slots, got.block_tables,
                                 got.context_lens, got.steps, page)
    ref.advance(tokens, page)
    for name, want, have in zip(("ids", "positions", "slots", "block_tables", "context_lens", "temperature",
                                 "seeds", "steps"), ref.tensors(), got.tensors()):  # fmt: skip
        assert torch.equal(have, want), name
    assert torch.equal(out, torch.stack([tokens.float(), logprobs]))


def test_advance_decode_rejects_inputs_it_cannot_update_in_place():
    inputs = _inputs(3, 4, 4, "cpu", seed=0)
    args = (inputs.ids, inputs.positions, inputs.slots, inputs.block_tables, inputs.context_lens, inputs.steps, 4)
    with pytest.raises(ValueError, match="tokens must be int64 with 3 rows"):
        kernels.advance_decode(torch.zeros(3, dtype=torch.int32), torch.zeros(3), *args)
    with pytest.raises(ValueError, match="logprobs must be fp32"):
        kernels.advance_decode(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.float64), *args)
    strided = torch.zeros(3, 2, dtype=torch.long)[:, :1]
    with pytest.raises(ValueError, match="ids must be contiguous"):
        kernels.advance_decode(torch.zeros(3, dtype=torch.long), torch.zeros(3), strided, *args[1:])
