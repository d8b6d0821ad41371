"""unpad_input / pad_input: flash_attn.bert_padding's contract, round trips, exact autograd."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import varlen_attn as va


_MASK_DTYPES = [torch.bool, torch.int32, torch.int64, torch.uint8, torch.float32, torch.float64, torch.bfloat16]


@st.composite
def padded(draw):
    b = draw(st.integers(1, 4))
    s = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    mask = torch.rand(b, s, generator=g) >= p  # valid tokens anywhere in the row
    dtype = draw(st.sampled_from(_MASK_DTYPES))
    # Nonzero values other than 1 (2, 0.5, -1, ...): each one still marks one valid token.
    value = draw(st.sampled_from([1, 1, 2, 7] + ([-1] if dtype not in (torch.bool, torch.uint8) else [])
                                 + ([0.5, 1e-3] if dtype.is_floating_point else [])))
    x = torch.randn(b, s, 3, 5, generator=g, dtype=torch.float64)
    return x, (mask if dtype == torch.bool else (mask * value).to(dtype)), g


def reference_unpad(x, attention_mask, unused_mask=None):
    """unpad_input written out element by element in Python, nonzero = valid: the indices of
    the valid (or unused) tokens in row-major order, per-row counts of them, and the rows."""
    batch, seqlen = attention_mask.shape
    a = attention_mask.tolist()
    u = unused_mask.tolist() if unused_mask is not None else [[0] * seqlen for _ in range(batch)]
    indices, lens, used = [], [], []
    for i in range(batch):
        row = [j for j in range(seqlen) if a[i][j] != 0 or u[i][j] != 0]
        indices += [i * seqlen + j for j in row]
        lens.append(len(row))
        used.append(sum(1 for j in range(seqlen) if a[i][j] != 0))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    rows = torch.stack([x[k // seqlen, k % seqlen] for k in indices]) if indices else x.flatten(0, 1)[:0]
    return rows, indices, cu, max(lens), used


def flash_attn_unpad_formulas(attention_mask, unused_mask=None):
    """flash_attn.bert_padding.unpad_input's own formulas (flash-attn >= 2.7, verbatim), for comparison."""
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, seqlens.max().item(), used


@given(data=padded())
def test_unpad_matches_flash_attn_contract(data):
    x, mask, _ = data
    out, indices, cu, max_len, used = va.unpad_input(x, mask)
    m = mask.bool()
    lens = m.sum(-1)
    # flash_attn.bert_padding.unpad_input's documented results, computed independently:
    assert indices.dtype == torch.int64 and torch.equal(indices, m.flatten().nonzero()[:, 0])
    assert cu.dtype == torch.int32 and cu.tolist() == [0] + lens.cumsum(0).tolist()
    assert isinstance(max_len, int) and max_len == int(lens.max())
    assert used.dtype == torch.int32 and torch.equal(used, lens.to(torch.int32))
    assert torch.equal(out, x.flatten(0, 1)[m.flatten()])


@given(data=padded())
def test_pad_unpad_round_trip_and_gradients(data):
    x, mask, g = data
    x = x.requires_grad_()
    packed, indices, _, _, _ = va.unpad_input(x, mask)
    back = va.pad_input(packed, indices, x.shape[0], x.shape[1])
    m = mask.bool()[..., None, None]
    assert torch.equal(back, torch.where(m, x, 0.0))
    w = torch.randn(back.shape, generator=g, dtype=torch.float64)
    (back * w).sum().backward()
    assert torch.equal(x.grad, torch.where(m, w, 0.0))  # exact: copies, no accumulation


def test_unused_mask_as_in_flash_attn():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    x = torch.arange(8.0).view(2, 4, 1)
    out, indices, cu, max_len, used = va.unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.tolist() == [0, 3, 6] and max_len == 3 and used.tolist() == [2, 1]
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]


@given(data=padded())
def test_unpad_matches_reference_and_flash_attn_on_0_1_masks(data):
    """Every mask dtype flash-attn accepts (bool, integer, floating), nonzero = valid; for 0/1
    masks the results equal flash-attn's own formulas exactly."""
    x, mask, _ = data
    out, indices, cu, max_len, used = va.unpad_input(x, mask)
    rows, ref_indices, ref_cu, ref_max, ref_used = reference_unpad(x, mask)
    assert indices.dtype == torch.int64 and indices.tolist() == ref_indices
    assert cu.dtype == torch.int32 and cu.tolist() == ref_cu
    assert max_len == ref_max and used.tolist() == ref_used
    assert torch.equal(out, rows)
    assert cu[-1].item() == indices.numel() == out.shape[0]  # never disagree
    if ((mask == 0) | (mask == 1)).all():
        fa_indices, fa_cu, fa_max, fa_used = flash_attn_unpad_formulas(mask)
        assert torch.equal(indices, fa_indices) and torch.equal(cu, fa_cu)
        assert max_len == fa_max and torch.equal(used, fa_used)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float16])
def test_mask_values_above_one_count_once(dtype):
    """flash-attn sums the mask for the lengths and takes nonzero for the indices, so a 2
    gives cu_seqlens that run past the indices (padding rows in the packed batch); here every
    nonzero entry is one token and the two always agree."""
    x = torch.arange(8.0).view(2, 4, 1)
    mask = torch.tensor([[2, 0, 1, 0], [0, 3, 0, 1]], dtype=dtype)
    out, indices, cu, max_len, used = va.unpad_input(x, mask)
    assert indices.tolist() == [0, 2, 5, 7] and cu.tolist() == [0, 2, 4]
    assert max_len == 2 and used.tolist() == [2, 2] and out[:, 0].tolist() == [0.0, 2.0, 5.0, 7.0]
    fa_indices, fa_cu, _, _ = flash_attn_unpad_formulas(mask)
    assert torch.equal(fa_indices, indices) and fa_cu.tolist() == [0, 3, 7]  # flash-attn's disagree


def test_float_mask_nonzero_is_valid():
    x = torch.arange(8.0).view(2, 4, 1)
    mask = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, -2.0, 1.0]])
    out, indices, cu, max_len, used = va.unpad_input(x, mask)
    assert indices.tolist() == [0, 2, 6, 7] and cu.tolist() == [0, 2, 4] and used.tolist() == [2, 2]
    bool_result = va.unpad_input(x, mask != 0)
    for a, b in zip((out, indices, cu, max_len, used), bool_result):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_unused_mask_other_dtypes_and_overlap(dtype):
    """Integer/float masks that overlap (flash-attn adds them: a 2 where both are set) count a
    token once, in cu_seqlens and in seqused; the result equals the bool masks' result."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]])  # [0, 1] is in both
    x = torch.arange(8.0).view(2, 4, 1)
    got = va.unpad_input(x, mask.to(dtype), unused.to(dtype))
    want = va.unpad_input(x, mask.bool(), unused.bool())
    rows, ref_indices, ref_cu, ref_max, ref_used = reference_unpad(x, mask, unused)
    assert got[1].tolist() == want[1].tolist() == ref_indices == [0, 1, 2, 4, 5, 6]
    assert got[2].tolist() == want[2].tolist() == ref_cu == [0, 3, 6]
    assert got[3] == want[3] == ref_max == 3
    assert got[4].tolist() == want[4].tolist() == ref_used == [2, 1]
    assert torch.equal(got[0], rows)


@given(data=padded(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_pad_input_matches_reference_for_int32_and_int64_indices(data, index_dtype):
    """pad_input takes int32 indices as flash-attn's ``output[indices] = values`` does; same
    result and gradients as int64."""
    x, mask, g = data
    packed, indices, _, _, _ = va.unpad_input(x, mask)
    packed = packed.detach().requires_grad_()
    back = va.pad_input(packed, indices.to(index_dtype), x.shape[0], x.shape[1])
    want = torch.zeros(x.shape[0] * x.shape[1], *x.shape[2:], dtype=x.dtype)
    for row, k in enumerate(indices.tolist()):  # written out, one token at a time
        want[k] = packed[row].detach()
    assert torch.equal(back, want.view(x.shape))
    w = torch.randn(back.shape, generator=g, dtype=torch.float64)
    (back * w).sum().backward()
    assert torch.equal(packed.grad, w.flatten(0, 1)[indices])


def test_pad_input_sizes_accept_integer_like():
    packed = torch.ones(2, 1)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    want = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    for batch in (2, torch.tensor(2)):
        assert torch.equal(va.pad_input(packed, idx, batch, 2)[..., 0], want)


def test_pack_unpack_with_plan_is_sync_free_and_exact():
    keep = torch.tensor([[False, True, True, False, True], [True, True, True, True, True]])
    plan = va.build_plan(keep)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    packed = va.pack(x, plan, "k")
    assert torch.equal(packed, x.detach()[keep])
    back = va.unpack(packed, plan, "k")
    assert torch.equal(back, torch.where(keep[..., None], x, 0.0))
    back.sum().backward()
    assert torch.equal(x.grad, keep[..., None].double().expand(2, 5, 4))
    assert torch.autograd.gradcheck(lambda t: va.unpack(va.pack(t, plan, "k") * 2, plan, "k"),
                                    (torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True),))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: va.unpad_input(torch.randn(2, 3, 4), torch.ones(2, 4, dtype=torch.bool)), r"attention_mask must be \[B, S\]"),
        (lambda: va.unpad_input(torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.complex64)),
         r"attention_mask must be bool, integer or floating \(nonzero = valid\), got dtype torch.complex64"),
        (lambda: va.unpad_input(torch.randn(2, 3, 4), [[1, 1, 1], [1, 1, 1]]), r"attention_mask must be a \[B, S\] tensor, got list"),
        (lambda: va.unpad_input(torch.randn(2, 3, 4), torch.ones(2, 3), torch.ones(3, 2)), r"unused_mask must be \[B, S\]"),
        (lambda: va.unpad_input(torch.randn(3), torch.ones(3, dtype=torch.bool)), "hidden_states must be"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3.0), 1, 3), r"indices must be a 1-D int64 or int32 tensor, got .*float32"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3, dtype=torch.int16), 1, 3), r"indices must be a 1-D int64 or int32 tensor, got .*int16"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3).view(3, 1), 1, 3), r"indices must be a 1-D int64 or int32 tensor, got .*\(3, 1\)"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(2), 1, 3), "one entry per packed token"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3), 1.0, 3), "batch must be an int, got float 1.0"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3), 1, -3), "seqlen must be >= 0, got -3"),
    ],
)
def test_padding_errors_name_the_argument(call, match):
    with pytest.raises(va.VarlenAttnError, match=match):
        call()


def test_unpack_and_pack_backward_equal_a_scatter_into_zeros():
    """unpack (a gather through the plan's inverse index plus a fill of the padding rows) and
    pack's backward are bit-identical to the plain definition: zeros, then index_copy_."""
    keep = torch.rand(3, 17, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[2] = False
    plan = va.build_plan(keep[:, None, :, None] & keep[:, None, None, :], convention="torch")
    x = torch.randn(3, 17, 2, 5, dtype=torch.float64, requires_grad=True)
    packed = va.pack(x, plan, "q")
    out = va.unpack(packed * 3, plan, "q")
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out.backward(g)
    flat_rows = 3 * 17
    want = torch.zeros(flat_rows, 2, 5, dtype=torch.float64).index_copy_(0, plan.indices_q, 3 * packed.detach())
    assert torch.equal(out.detach(), want.view(3, 17, 2, 5))
    want_grad = torch.zeros(flat_rows, 2, 5, dtype=torch.float64).index_copy_(
        0, plan.indices_q, 3 * g.flatten(0, 1)[plan.indices_q])
    assert torch.equal(x.grad, want_grad.view(3, 17, 2, 5))
    valid = (keep & keep.any(-1, keepdim=True))[..., None, None]
    assert torch.equal(out.detach(), torch.where(valid, 3 * x.detach(), 0.0))


@pytest.mark.parametrize("kind", ["outer", "key_padding"])
def test_pack_qkv_equals_three_packs(kind):
    """pack_qkv's one-node gather gives the same tensors and q/k/v gradients as three packs."""
    from varlen_attn.pack import pack_qkv

    g = torch.Generator().manual_seed(5)
    keep = torch.rand(3, 11, generator=g) > 0.3
    mask = keep[:, None, :, None] & keep[:, None, None, :] if kind == "outer" else keep[:, None, None, :]
    plan = va.build_plan(mask, convention="torch")
    q, k, v = (torch.randn(3, 11, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    w = [torch.randn(n, 2, 8, dtype=torch.float64, generator=g) for n in (plan.total_q, plan.total_k, plan.total_k)]
    results = []
    for fn in (lambda a, b, c: pack_qkv(a, b, c, plan),
               lambda a, b, c: (va.pack(a, plan, "q"), va.pack(b, plan, "k"), va.pack(c, plan, "k"))):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        outs = fn(qq, kk, vv)
        sum((o * wi).sum() for o, wi in zip(outs, w)).backward()
        results.append([o.detach() for o in outs] + [qq.grad, kk.grad, vv.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)
