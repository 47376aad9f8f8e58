"""A small interpreter of the PTX text the kernels inline for the int4 decode (shr, prmt, lop3, mov, bf16x2 fma) and,
for a warp, the mma GEMV's m16n8k16 mma, so that CPU tests can run it: the kernels themselves run only on a GPU."""

from __future__ import annotations

import torch


def _halves(v: int) -> list[float]:
    """The two bf16 halves of a 32-bit register, as floats."""
    return [torch.tensor([(v >> sh) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()
            for sh in (0, 16)]  # (int32 -> int16 wraps: the low 16 bits)


def _pack(lo: float, hi: float) -> int:
    """Two values rounded once to bf16 (through fp32: exact for the sums below) into one 32-bit register."""
    b = torch.tensor([lo, hi], dtype=torch.float64).to(torch.float32).to(torch.bfloat16).view(torch.int16)
    return (b[0].item() & 0xFFFF) | (b[1].item() & 0xFFFF) << 16


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run `text` with the operands `inputs` ("$2": value, ...; 16-bit operands as their bit patterns) and return every
    register and operand afterwards. bf16x2 fma rounds the exact result to nearest even, as the hardware does (each
    product here is exact: integers times one bf16 scale); an instruction outside the set fails the test."""
    regs = dict(inputs)
    for line in text.splitlines():
        _step(*_parse(line), regs)
    return regs


def run_ptx_warp(text: str, lanes: list[dict[str, int | float]]) -> list[dict[str, int | float]]:
    """run_ptx for the 32 lanes of a warp in lockstep, with `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
    as the warp-wide product it is (PTX ISA fragments: lane (g, t) = (lane // 4, lane % 4) holds A rows g, g + 8 at
    k 2t, 2t + 1 and 2t + 8, 2t + 9; B at those k, column g; C and D rows g, g + 8 at columns 2t, 2t + 1), summed in
    float64 and rounded once to fp32. f32 registers hold Python floats."""
    regs = [dict(lane) for lane in lanes]
    for line in text.splitlines():
        op, args = _parse(line)
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
            _mma(args, regs)
        else:
            for lane in regs:
                _step(op, args, lane)
    return regs


def _parse(line: str) -> tuple[str, list[str]]:
    op, _, rest = line.strip().rstrip(";").partition(" ")
    return op, [a.strip() for a in rest.replace("{", "").replace("}", "").split(",")]


def _mma(args: list[str], regs: list[dict]) -> None:
    """D = A B + C over the warp; args: 4 D, 4 A, 2 B, 4 C registers."""
    d, a, b, c = args[0:4], args[4:8], args[8:10], args[10:14]
    A = [[0.0] * 16 for _ in range(16)]
    B = [[0.0] * 8 for _ in range(16)]
    for lane, r in enumerate(regs):
        g, t = lane // 4, lane % 4
        for i, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row][k], A[row][k + 1] = _halves(r[a[i]])
        for i, k in enumerate((2 * t, 2 * t + 8)):
            B[k][g], B[k + 1][g] = _halves(r[b[i]])
    out = []
    for lane, r in enumerate(regs):
        g, t = lane // 4, lane % 4
        cells = ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))
        out.append([float(torch.tensor(r[c[i]] + sum(A[row][k] * B[k][col] for k in range(16)), dtype=torch.float64)
                          .float()) for i, (row, col) in enumerate(cells)])  # fmt: skip
    for r, values in zip(regs, out):
        for i in range(4):
            r[d[i]] = values[i]


def _step(op: str, args: list[str], regs: dict) -> None:
    """One per-lane instruction on the registers `regs`."""

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    if op == "shr.u32":
        regs[args[0]] = (val(args[1]) & 0xFFFFFFFF) >> val(args[2])
    elif op == "prmt.b32":  # default mode: byte i of the result is byte (selector nibble i) of {b, a}
        src = (val(args[1]) & 0xFFFFFFFF) | (val(args[2]) & 0xFFFFFFFF) << 32
        sel = val(args[3])
        regs[args[0]] = sum(((src >> 8 * ((sel >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
    elif op == "lop3.b32":
        assert args[4] == "0xEA"  # (a & b) | c
        regs[args[0]] = (val(args[1]) & val(args[2])) | val(args[3])
    elif op == "mov.b32" and len(args) == 3 and args[0].startswith("$"):  # unpack {$0, $1}, r
        regs[args[0]], regs[args[1]] = val(args[2]) & 0xFFFF, val(args[2]) >> 16
    elif op == "mov.b32" and len(args) == 3:  # pack r, {h, h}
        regs[args[0]] = (val(args[1]) & 0xFFFF) | (val(args[2]) & 0xFFFF) << 16
    elif op == "mov.b32":
        regs[args[0]] = val(args[1])
    elif op == "mov.f32":
        regs[args[0]] = regs[args[1]]
    elif op == "fma.rn.bf16x2":
        a, b, c = (_halves(val(t)) for t in args[1:])
        regs[args[0]] = _pack(*(x * y + z for x, y, z in zip(a, b, c)))
    else:
        assert op in ("{", "}", ".reg", ""), f"unexpected PTX: {op} {args}"


def int4_decode_cases(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int4 words (int32, `shape`; the first two hold every nibble value once each) and bf16 scales over 2^-12
    to 2^3, for the decode-text tests: seeded, so every test reads the same cases."""
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)
    words.view(-1)[:2] = torch.tensor([0x76543210, -0x789ABCDF - 1], dtype=torch.int32)
    scales = (torch.rand(shape, generator=gen) * 2.0 ** torch.randint(-12, 3, shape, generator=gen)).bfloat16()
    return words, scales


def int4_decoded_bits(word: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int4 format's own dequantization of one word by one bf16 scale: its 8 values' bf16 bit patterns, int32."""
    from orbit_lightning.quant.formats.int4 import unpack_int4

    return (unpack_int4(word.reshape(1)).float() * scale.float()).bfloat16().view(torch.int16).int() & 0xFFFF
