"""unpad_input / pad_input: flash_attn.bert_padding's contract, round trips, exact autograd."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import varlen_attn as va


@st.composite
def padded(draw):
    b = draw(st.integers(1, 4))
    s = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    mask = torch.rand(b, s, generator=g) >= p  # valid tokens anywhere in the row
    as_int = draw(st.booleans())
    x = torch.randn(b, s, 3, 5, generator=g, dtype=torch.float64)
    return x, (mask.to(torch.int32) if as_int else mask), g


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
        (lambda: va.unpad_input(torch.randn(2, 3, 4), torch.ones(2, 3)), "attention_mask must be bool or integer"),
        (lambda: va.unpad_input(torch.randn(3), torch.ones(3, dtype=torch.bool)), "hidden_states must be"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(3, dtype=torch.int32), 1, 3), "indices must be a 1-D int64"),
        (lambda: va.pad_input(torch.randn(3, 2), torch.arange(2), 1, 3), "one entry per packed token"),
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
