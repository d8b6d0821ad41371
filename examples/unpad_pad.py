"""The standalone utilities on a custom attention module: pack once, run any varlen kernel, unpack.

``varlen_attn.unpad_input`` / ``pad_input`` are drop-ins for ``flash_attn.bert_padding`` (same
arguments, same returns) that need no flash-attn install. With a plan built once per batch,
``pack`` / ``unpack`` do the same per layer with no host sync at all.

    python examples/unpad_pad.py
"""

import torch
import torch.nn.functional as F

import varlen_attn_ref  # the pure-PyTorch flash_attn_varlen_func; use flash_attn's on a GPU
import varlen_attn as va


class CrossAttention(torch.nn.Module):
    """Image queries attend to padded text keys, computed on packed tokens."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * dim)

    def forward(self, image, text, q_plan_args, kv_plan_args):
        b, n, d = image.shape
        h = self.heads
        # Pack queries (all valid here) and text keys/values (padding dropped).
        q = self.q(image).view(b, n, h, d // h)
        k, v = self.kv(text).view(b, text.shape[1], 2, h, d // h).unbind(2)
        (idx_q, cu_q, max_q), (idx_k, cu_k, max_k) = q_plan_args, kv_plan_args
        q_p = q.flatten(0, 1)[idx_q]
        k_p, v_p = k.flatten(0, 1)[idx_k], v.flatten(0, 1)[idx_k]
        out = varlen_attn_ref.flash_attn_varlen_func(q_p, k_p, v_p, cu_q, cu_k, max_q, max_k)
        return va.pad_input(out.flatten(1), idx_q, b, n)


def main():
    torch.manual_seed(0)
    b, n, t, d = 3, 16, 10, 32
    image, text = torch.randn(b, n, d), torch.randn(b, t, d)
    text_mask = torch.arange(t)[None] < torch.tensor([7, 3, 0])[:, None]  # third prompt dropped

    # flash_attn.bert_padding-compatible calls: one host sync each (flash-attn's need two).
    _, idx_k, cu_k, max_k, used_k = va.unpad_input(text, text_mask)
    queries_valid = text_mask.any(-1, keepdim=True).expand(b, n)  # an empty prompt: zero output rows
    _, idx_q, cu_q, max_q, _ = va.unpad_input(image, queries_valid)
    print(f"text: cu_seqlens {cu_k.tolist()}, max_seqlen {max_k}, seqused {used_k.tolist()}")

    attn = CrossAttention(d)
    out = attn(image, text, (idx_q, cu_q, max_q), (idx_k, cu_k, max_k))

    # The same with masked SDPA, for comparison.
    h = attn.heads
    q = attn.q(image).view(b, n, h, d // h).transpose(1, 2)
    k, v = (x.transpose(1, 2) for x in attn.kv(text).view(b, t, 2, h, d // h).unbind(2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=text_mask[:, None, None, :])
    ref = ref.transpose(1, 2).flatten(2)
    print(f"max |packed - masked SDPA| = {(out - ref).abs().max().item():.2e}")

    # With a plan: built once per batch (one sync), then pack/unpack cost no sync in any layer.
    plan = va.build_plan(text_mask, seqlen_q=n)  # cross-attention: queries [B, n], keys [B, t]
    packed_text = va.pack(text, plan, "k")
    print(f"plan: {plan}; packed text {tuple(packed_text.shape)}; "
          f"round trip exact: {torch.equal(va.unpack(packed_text, plan, 'k'), text * text_mask[..., None])}")


if __name__ == "__main__":
    main()
