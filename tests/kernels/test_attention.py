"""Attention kernels: `attention` (teacher forcing / prefill) and `paged_attention` (decode).

The CPU tests run under Triton's interpreter in fp32 / fp16 (bf16 dots are wrong there) against a float64
SDPA oracle; the GPU tests check bf16 accuracy, bit-exact batch invariance (a sequence alone, left-padded in a
batch, decoded token by token through a shuffled paged cache) and CUDA-graph replay.

Tolerance. An output row is a convex combination of value rows, so |out| <= vmax = max |v|. The kernel rounds
each softmax weight p to the input dtype for the p @ v product (unit roundoff u; it still divides by the
unrounded sum, like flash attention), which moves the output by at most u * vmax, and rounds the output once
(u * |out|). Everything else is fp32: score errors of ~1e-7 relative and exp2's approximation (2^-22 on the
GPU) perturb p by ~1e-6 relative. So |out - ref| <= u * vmax + u * |ref| + ~1e-6 * vmax; the tests allow
(2u + 1e-5) * vmax + u * |ref|. The split (flash-decoding) path rounds each p relative to its chunk's max
instead (still p <= 1, so still u * vmax) and merges the chunks in fp32 (weights <= 1, a few fp32 ulps), so
the same bound holds; a split and an unsplit output, each within it of the reference, differ by at most twice it.
"""

import pytest
import torch
import torch.nn.functional as F
from orbit_lightning.kernels.attention_split import CHUNK, should_split, split_chunk

from orbit_lightning import kernels

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _randn(*shape, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def _bhtd(b, t, h, d, seed, device="cpu", dtype=torch.float32):
    """A [B, H, T, D] view of a [B, T, H, D] tensor: non-contiguous, the layout the models hand over."""
    return _randn(b, t, h, d, seed=seed, device=device, dtype=dtype).transpose(1, 2)


def _reference(q, k, v, scale, kv_start=None):
    """float64 SDPA: query i (at key tk - tq + i) sees keys kv_start[b] <= j <= its position; none -> 0."""
    b, h, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    kd = k.double().repeat_interleave(h // hkv, dim=1)
    vd = v.double().repeat_interleave(h // hkv, dim=1)
    start = torch.zeros(b, dtype=torch.long, device=q.device) if kv_start is None else kv_start
    key = torch.arange(tk, device=q.device)
    allowed = (key <= torch.arange(tk - tq, tk, device=q.device)[:, None]) & (key >= start[:, None, None, None])
    out = F.scaled_dot_product_attention(q.double(), kd, vd, attn_mask=allowed, scale=scale)
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0)  # SDPA gives NaN for a row with no key


def _assert_close(out, ref, v, slack=1.0):
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    u = ROUNDOFF[out.dtype]
    bound = slack * ((2 * u + 1e-5) * v.abs().max().double() + u * ref.abs())
    err = (out.double() - ref).abs()
    assert not out.isnan().any()
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, bound at worst {(err - bound).max().item():.3e}"


def _paged(k_seq, v_seq, lens, page, num_blocks, seed):
    """Scatter each sequence's first lens[b] keys ([B, Hkv, T, D]) into a NaN-filled cache through a shuffled
    block table; table entries past a sequence's blocks are -1. NaN and -1 must never be read."""
    b, hkv, _, dk = k_seq.shape
    dev = k_seq.device
    width = max(1, max(-(-n // page) for n in lens))
    k_cache = torch.full((num_blocks, page, hkv, dk), float("nan"), dtype=k_seq.dtype, device=dev)
    v_cache = torch.full((num_blocks, page, hkv, v_seq.shape[-1]), float("nan"), dtype=v_seq.dtype, device=dev)
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((b, width), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        for w in range(-(-n // page)):
            blk = free.pop()
            table[i, w] = blk
            stop = min(n, (w + 1) * page)
            k_cache[blk, : stop - w * page] = k_seq[i, :, w * page : stop].transpose(0, 1)
            v_cache[blk, : stop - w * page] = v_seq[i, :, w * page : stop].transpose(0, 1)
    return k_cache, v_cache, table.to(dev)


def _check_rows_invariant(n, h, hkv, dk, dv, dtype, device):
    """A length-n sequence's output rows must be bitwise the same scored alone, as a suffix (Tq < Tk),
    left-padded in a batch, decoded token by token through a shuffled paged cache, and decoded in a batch
    through another cache layout. Decode is unsplit (split=False), the batch-invariant path."""
    scale = dk**-0.5
    q = _bhtd(1, n, h, dk, seed=15, device=device, dtype=dtype)
    k = _bhtd(1, n, hkv, dk, seed=16, device=device, dtype=dtype)
    v = _bhtd(1, n, hkv, dv, seed=17, device=device, dtype=dtype)
    alone = kernels.attention(q, k, v, scale)[0]  # [H, n, Dv]
    assert torch.equal(kernels.attention(q[:, :, -1:], k, v, scale)[0], alone[:, -1:]), "Tq = 1"
    assert torch.equal(kernels.attention(q[:, :, -100:], k, v, scale)[0], alone[:, -100:]), "Tq = 100"

    # Left-padded at row `row` of a batch of 3 (random padding and other rows), Tq = Tk and Tq < Tk.
    for pad, row in ((1, 0), (64, 1), (77, 2)):
        qb = _bhtd(3, n + pad, h, dk, seed=pad, device=device, dtype=dtype)
        kb = _bhtd(3, n + pad, hkv, dk, seed=pad + 1, device=device, dtype=dtype)
        vb = _bhtd(3, n + pad, hkv, dv, seed=pad + 2, device=device, dtype=dtype)
        qb[row, :, pad:], kb[row, :, pad:], vb[row, :, pad:] = q[0], k[0], v[0]
        kv_start = torch.tensor([5, 0, 40], device=device)
        kv_start[row] = pad
        out = kernels.attention(qb, kb, vb, scale, kv_start)
        assert torch.equal(out[row, :, pad:], alone), f"left pad {pad} at row {row}"
        out = kernels.attention(qb[:, :, -37:], kb, vb, scale, kv_start)
        assert torch.equal(out[row], alone[:, -37:]), f"left pad {pad} at row {row}, Tq = 37"

    # Decoded token by token: key i is written to a shuffled block just before query i reads it.
    page, num_blocks = 16, 64
    k_cache = torch.zeros(num_blocks, page, hkv, dk, dtype=dtype, device=device)
    v_cache = torch.zeros(num_blocks, page, hkv, dv, dtype=dtype, device=device)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(18))[: -(-n // page)]
    table = blocks[None].int().to(device)
    for i in range(n):
        blk = blocks[i // page].item()
        k_cache[blk, i % page], v_cache[blk, i % page] = k[0, :, i], v[0, :, i]
        ctx = torch.tensor([i + 1], device=device)
        step = kernels.paged_attention(q[:, :, i : i + 1], k_cache, v_cache, table, ctx, scale, split=False)
        assert torch.equal(step[0, :, 0], alone[:, i]), f"decode step {i}"

    # 40 shuffled positions decoded as one batch through another layout (block size 32, NaN-filled cache).
    sel = torch.randperm(n, generator=torch.Generator().manual_seed(19))[:40]
    k_many, v_many = k.expand(40, -1, -1, -1), v.expand(40, -1, -1, -1)
    k_cache, v_cache, table = _paged(k_many, v_many, (sel + 1).tolist(), 32, num_blocks=40 * -(-n // 32), seed=20)
    qs = q[0][:, sel.to(device)].transpose(0, 1)[:, :, None]  # [40, H, 1, Dk]: the query at position sel[b]
    out = kernels.paged_attention(qs, k_cache, v_cache, table, (sel + 1).to(device), scale, split=False)
    assert torch.equal(out[:, :, 0], alone[:, sel.to(device)].transpose(0, 1)), "batched decode"


# ---------------------------------------------------------------- CPU (Triton interpreter)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(
    ("tq", "tk", "h", "hkv", "dk", "dv", "dtype"),
    [
        (150, 150, 2, 2, 16, 16, torch.float32),  # Tq == Tk, Tk not a multiple of BLOCK_N
        (150, 150, 4, 2, 24, 16, torch.float16),  # GQA 2; Dk != Dv, Dk padded (MLA's 192/128, scaled down)
        (37, 150, 4, 1, 32, 32, torch.float32),  # Tq < Tk, GQA 4
        (70, 130, 8, 2, 24, 16, torch.float16),  # Tq < Tk over two row tiles, GQA 4
    ],
)
def test_attention_matches_reference(tq, tk, h, hkv, dk, dv, dtype):
    q = _bhtd(2, tq, h, dk, seed=1, dtype=dtype)
    k = _bhtd(2, tk, hkv, dk, seed=2, dtype=dtype)
    v = _randn(2, hkv, tk, dv, seed=3, dtype=dtype)  # a contiguous v next to strided q and k
    assert not q.is_contiguous()
    out = kernels.attention(q, k, v, dk**-0.5)
    assert out.dtype == dtype
    _assert_close(out, _reference(q, k, v, dk**-0.5), v)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("tq", [100, 40])
def test_left_padding(tq):
    tk, h, hkv = 100, 4, 2
    kv_start = torch.tensor([0, 70, 100])  # none, across a BLOCK_N boundary, the whole row
    q = _bhtd(3, tq, h, 16, seed=4)
    k = _randn(3, hkv, tk, 16, seed=5)
    v = _randn(3, hkv, tk, 16, seed=6)
    ref = _reference(q, k, v, 0.25, kv_start)
    k_pad, v_pad = k.clone(), v.clone()
    for b, s in enumerate(kv_start.tolist()):  # left-pad keys must never be read
        k_pad[b, :, :s] = float("nan")
        v_pad[b, :, :s] = float("nan")
    out = kernels.attention(q, k_pad, v_pad, 0.25, kv_start.int())
    _assert_close(out, ref, v)
    pad_rows = torch.arange(tk - tq, tk)[None, :] < kv_start[:, None]  # [B, Tq] queries before kv_start
    assert pad_rows.any(), "the case must contain left-pad queries"
    assert torch.equal(out.transpose(1, 2)[pad_rows], torch.zeros_like(out.transpose(1, 2)[pad_rows]))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(
    ("h", "hkv", "dk", "dv", "page", "dtype"),
    [
        (4, 1, 24, 16, 16, torch.float16),  # GQA 4 packed as rows, Dk padded
        (2, 2, 16, 16, 5, torch.float32),  # no GQA; a block size that is not a power of two
        (4, 2, 32, 16, 8, torch.float32),
    ],
)
def test_paged_decode_matches_reference(h, hkv, dk, dv, page, dtype):
    lens = [150, 1, 64, 97, 0]  # several blocks, one key, one exact BLOCK_N, a partial block, empty
    k_seq = _randn(len(lens), hkv, max(lens), dk, seed=7, dtype=dtype)
    v_seq = _randn(len(lens), hkv, max(lens), dv, seed=8, dtype=dtype)
    q = _bhtd(len(lens), 1, h, dk, seed=9, dtype=dtype)
    k_cache, v_cache, table = _paged(k_seq, v_seq, lens, page, num_blocks=80, seed=10)
    out = kernels.paged_attention(q, k_cache, v_cache, table, torch.tensor(lens), dk**-0.5)
    assert out.shape == (len(lens), h, 1, dv) and out.dtype == dtype
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        ref = _reference(q[b : b + 1], k_seq[b : b + 1, :, :n], v_seq[b : b + 1, :, :n], dk**-0.5)
        _assert_close(out[b : b + 1], ref, v_seq)


@pytest.mark.usefixtures("cpu_kernels")
def test_rows_are_bitwise_invariant_in_interpreter():
    # No hardware guarantee here (numpy does the dots), but the interpreter is deterministic per row, so this
    # catches logic that breaks invariance: a key loop not aligned to kv_start, masked blocks that are not
    # exact no-ops, different tiles for prefill and decode.
    _check_rows_invariant(150, 4, 2, 24, 16, torch.float32, "cpu")


# Empty, one key, exactly one chunk, one key into the second, several chunks next to a short row.
SPLIT_LENS = [0, 1, CHUNK, CHUNK + 1, 2 * CHUNK + 37, 70]


def _split_case(lens, h, hkv, dk, dv, page, dtype, seed=30):
    k_seq = _randn(len(lens), hkv, max(lens), dk, seed=seed, dtype=dtype)
    v_seq = _randn(len(lens), hkv, max(lens), dv, seed=seed + 1, dtype=dtype)
    q = _bhtd(len(lens), 1, h, dk, seed=seed + 2, dtype=dtype) * 2  # a sharper softmax: chunk maxima differ
    k_cache, v_cache, table = _paged(k_seq, v_seq, lens, page, num_blocks=sum(lens) // page + len(lens), seed=seed)
    return q, k_seq, v_seq, k_cache, v_cache, table


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(
    ("h", "hkv", "dk", "dv", "page", "dtype"),
    [
        (4, 2, 32, 16, 16, torch.float32),  # GQA 2
        (8, 1, 24, 16, 8, torch.float16),  # GQA 8 packed as rows; Dk != Dv, Dk padded (MLA's 192/128)
        (66, 1, 16, 16, 16, torch.float32),  # GQA 66: two row tiles, the second with 2 rows
        (2, 1, 192, 128, 16, torch.float16),  # MLA's real head dims
    ],
)
def test_split_decode_matches_reference(h, hkv, dk, dv, page, dtype):
    q, k_seq, v_seq, k_cache, v_cache, table = _split_case(SPLIT_LENS, h, hkv, dk, dv, page, dtype)
    ctx = torch.tensor(SPLIT_LENS)
    out = kernels.paged_attention(q, k_cache, v_cache, table, ctx, dk**-0.5, split=True)
    assert out.shape == (len(SPLIT_LENS), h, 1, dv) and out.dtype == dtype
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no key: zeros, as unsplit
    for b, n in enumerate(SPLIT_LENS[1:], 1):
        ref = _reference(q[b : b + 1], k_seq[b : b + 1, :, :n], v_seq[b : b + 1, :, :n], dk**-0.5)
        _assert_close(out[b : b + 1], ref, v_seq)
    unsplit = kernels.paged_attention(q, k_cache, v_cache, table, ctx, dk**-0.5, split=False)
    _assert_close(out, unsplit.double(), v_seq, slack=2)
    assert torch.equal(out, kernels.paged_attention(q, k_cache, v_cache, table, ctx, dk**-0.5, split=True))


@pytest.mark.usefixtures("cpu_kernels")
def test_split_chunks_past_the_context_are_no_ops():
    # A wider block table adds chunks that no row reaches (and -1 entries): a row's chunks and their merge order
    # are unchanged, so its output must be bitwise the same. Rows that end on, just past and far from a chunk
    # boundary; 17 chunks in one row cross the merge's 16-chunk step.
    lens = [CHUNK, CHUNK + 1, 5, 17 * CHUNK - 3]
    q, _, v_seq, k_cache, v_cache, table = _split_case(lens, 2, 1, 16, 16, 64, torch.float32, seed=40)
    ctx = torch.tensor(lens)
    out = kernels.paged_attention(q, k_cache, v_cache, table, ctx, 0.25, split=True)
    wide = torch.cat([table, torch.full((len(lens), 3 * CHUNK // 64), -1, dtype=table.dtype)], 1)
    assert torch.equal(out, kernels.paged_attention(q, k_cache, v_cache, wide, ctx, 0.25, split=True))
    _assert_close(out, kernels.paged_attention(q, k_cache, v_cache, table, ctx, 0.25, split=False).double(), v_seq, 2)


@pytest.mark.usefixtures("cpu_kernels")
def test_split_dispatch():
    cpu = torch.device("cpu")  # decided as for an H200's 132 SMs
    assert split_chunk(8, 592, cpu) == 64  # Qwen3-8B at batch 1 (8 programs): 10 chunks of one key block
    assert split_chunk(8, 4096, cpu) == 128  # 32 chunks: 256 programs
    assert split_chunk(64, 592, cpu) == 128  # Qwen3-30B-A3B at batch 16 (4 kv heads): 5 chunks
    assert not should_split(8, 64, cpu)  # one key block: nothing to split
    assert not should_split(128, 4096, cpu)  # Qwen3-8B at batch 16 already reaches most SMs
    lens = [CHUNK + 40, 3]
    q, _, _, k_cache, v_cache, table = _split_case(lens, 4, 2, 16, 16, 16, torch.float32, seed=50)
    args = (q, k_cache, v_cache, table, torch.tensor(lens), 0.25)
    split, unsplit = kernels.paged_attention(*args, split=True), kernels.paged_attention(*args, split=False)
    assert not torch.equal(split, unsplit), "the case must tell the two paths apart"
    assert torch.equal(kernels.paged_attention(*args), split)  # 2 x 2 programs, 2 chunks: split
    with kernels.batch_invariant():
        assert torch.equal(kernels.paged_attention(*args), unsplit)  # never split in batch-invariant mode


def test_input_validation():
    q, k, v = torch.zeros(1, 3, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="H % Hkv"):
        kernels.attention(q, k, v, 1.0)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        kernels.attention(torch.zeros(1, 2, 5, 16), k, v, 1.0)
    with pytest.raises(ValueError, match="kv_start"):
        kernels.attention(q[:, :2], k, v, 1.0, kv_start=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="bf16"):
        kernels.attention(q[:, :2].long(), k, v, 1.0)
    assert kernels.attention(q[:, :2, :0], k, v, 1.0).shape == (1, 2, 0, 16)  # nothing to launch
    cache = torch.zeros(4, 8, 2, 16)
    ctx = torch.ones(1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[B, H, 1, Dk\]"):
        kernels.paged_attention(q[:, :2], cache, cache, table, ctx, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        kernels.paged_attention(q[:, :2, :1], cache, cache, table, ctx.float(), 1.0)


# ---------------------------------------------------------------- GPU

# (H, Hkv, Dk, Dv): Qwen3-8B's attention, and MLA's per-head expanded 192/128 layout.
GPU_SHAPES = {"qwen3": (32, 8, 128, 128), "mla": (16, 16, 192, 128)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_bf16_matches_reference_gpu(shape):
    h, hkv, dk, dv = GPU_SHAPES[shape]
    tk, scale = 700, dk**-0.5
    kv_start = torch.tensor([0, 123, 650], device="cuda")
    q = _bhtd(3, tk, h, dk, seed=11, device="cuda", dtype=torch.bfloat16) * 2  # a sharper softmax
    k = _bhtd(3, tk, hkv, dk, seed=12, device="cuda", dtype=torch.bfloat16)
    v = _bhtd(3, tk, hkv, dv, seed=13, device="cuda", dtype=torch.bfloat16)
    _assert_close(kernels.attention(q, k, v, scale, kv_start), _reference(q, k, v, scale, kv_start), v)
    sub = slice(tk - 200, tk)  # Tq < Tk
    out = kernels.attention(q[:, :, sub], k, v, scale, kv_start)
    _assert_close(out, _reference(q[:, :, sub], k, v, scale, kv_start), v)
    lens = [700, 1, 333]
    k_cache, v_cache, table = _paged(k.contiguous(), v.contiguous(), lens, 16, num_blocks=128, seed=14)
    out = kernels.paged_attention(q[:, :, -1:], k_cache, v_cache, table, torch.tensor(lens, device="cuda"), scale)
    for b, n in enumerate(lens):
        ref = _reference(q[b : b + 1, :, -1:], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale)
        _assert_close(out[b : b + 1], ref, v)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_rows_are_bitwise_batch_invariant_gpu(shape):
    _check_rows_invariant(300, *GPU_SHAPES[shape], torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_paged_attention_cuda_graph_gpu():
    h, hkv, d = GPU_SHAPES["qwen3"][:3]
    lens, page, scale = [256, 3, 100, 177], 16, d**-0.5  # the captured context lengths
    k_seq = _randn(4, hkv, 256, d, seed=20, device="cuda", dtype=torch.bfloat16)
    v_seq = _randn(4, hkv, 256, d, seed=21, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache, table = _paged(k_seq, v_seq, [256] * 4, page, num_blocks=96, seed=22)  # all keys cached
    q = _bhtd(4, 1, h, d, seed=23, device="cuda", dtype=torch.bfloat16).contiguous()
    ctx = torch.tensor(lens, device="cuda")
    kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale)
    for seed, new_lens in ((24, [1, 3, 17, 200]), (25, [256, 2, 64, 65])):
        q.copy_(_bhtd(4, 1, h, d, seed=seed, device="cuda", dtype=torch.bfloat16))
        ctx.copy_(torch.tensor(new_lens))
        graph.replay()
        assert torch.equal(static_out, kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale))
        for b, n in enumerate(new_lens):
            ref = _reference(q[b : b + 1], k_seq[b : b + 1, :, :n], v_seq[b : b + 1, :, :n], scale)
            _assert_close(static_out[b : b + 1], ref, v_seq)


@pytest.mark.gpu
@needs_cuda
def test_split_paged_attention_cuda_graph_gpu():
    h, hkv, d = GPU_SHAPES["qwen3"][:3]
    n_max, page, scale = 4 * CHUNK, 16, d**-0.5  # the block table's width: 4 chunks per row
    k_seq = _randn(3, hkv, n_max, d, seed=30, device="cuda", dtype=torch.bfloat16)
    v_seq = _randn(3, hkv, n_max, d, seed=31, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache, table = _paged(k_seq, v_seq, [n_max] * 3, page, num_blocks=200, seed=32)
    q = _bhtd(3, 1, h, d, seed=33, device="cuda", dtype=torch.bfloat16).contiguous()
    ctx = torch.tensor([n_max, 3, CHUNK], device="cuda")  # the captured context lengths
    kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale, split=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale, split=True)
    for seed, new_lens in ((34, [0, CHUNK + 1, 1]), (35, [n_max, 700, CHUNK - 1])):
        q.copy_(_bhtd(3, 1, h, d, seed=seed, device="cuda", dtype=torch.bfloat16))
        ctx.copy_(torch.tensor(new_lens))
        graph.replay()
        assert torch.equal(static_out, kernels.paged_attention(q, k_cache, v_cache, table, ctx, scale, split=True))
        for b, n in enumerate(new_lens):
            if n == 0:
                assert torch.equal(static_out[b], torch.zeros_like(static_out[b]))
                continue
            ref = _reference(q[b : b + 1], k_seq[b : b + 1, :, :n], v_seq[b : b + 1, :, :n], scale)
            _assert_close(static_out[b : b + 1], ref, v_seq)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_equals_index_copy(dtype):
    # The one-launch cache write against the two index copies it replaces (incl. a conversion to the cache dtype
    # and strided k/v rows, as a transposed [B, Hkv, 1, d] view gives).
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.zeros(40, 2, 24, dtype=torch.float16), torch.zeros(40, 2, 20, dtype=torch.float16)
    k = torch.randn(5, 2, 24, generator=g).to(dtype)
    v = torch.randn(2, 5, 20, generator=g).to(dtype).transpose(0, 1)  # rows strided
    slots = torch.tensor([3, 17, 0, 39, 21])
    want_k, want_v = kc.clone().index_copy_(0, slots, k.half()), vc.clone().index_copy_(0, slots, v.half())
    kernels.kv_write(kc, vc, slots, k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(ValueError, match="slots"):
        kernels.kv_write(kc, vc, slots[:2], k, v)
