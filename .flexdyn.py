# scratch (not committed): does inductor lower flex_attention's backward with symbolic Sq != Sk?
import torch
from varlen_attn.kernels import flex
import varlen_attn as va
from torch.nn.attention.flex_attention import flex_attention
fn = torch.compile(flex_attention)  # the old way: one function, automatic dynamic shapes
def run(b, sq, sk, hq=2, hk=1, d=16, dtype=torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    kq = torch.rand(b, sq, device="cuda", generator=g) > 0.2
    kk = torch.rand(b, sk, device="cuda", generator=g) > 0.2
    mask = kq[:, None, :, None] & kk[:, None, None, :]
    plan = va.build_plan(mask)
    bm, rows = flex._mask_of(plan)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    fn(q, k, v, block_mask=bm, scale=0.25, enable_gqa=True).float().sum().backward()
    torch.cuda.synchronize()
for shape in [(1, 40, 60), (1, 57, 90), (1, 33, 33), (1, 70, 70)]:
    try:
        run(*shape); print("ok", shape)
    except Exception as e:
        print("FAIL", shape, type(e).__name__, str(e)[:600].replace("\n", " | "))
