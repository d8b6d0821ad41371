import sys; sys.path.insert(0, "tests")
import torch, varlen_attn as va
from _models import chroma_inputs, step, tiny_chroma
from _testing import assert_model_close
torch.backends.cuda.enable_cudnn_sdp(False)
for enabled in (False, True):
    torch.compiler.reset()
    stock = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    model = tiny_chroma(dtype=torch.bfloat16, device="cuda")
    if enabled: va.enable_varlen(model)
    for b in [*model.transformer_blocks, *model.single_transformer_blocks]: b.compile(fullgraph=True, mode="reduce-overhead")
    for i, l in enumerate([(5,2,0),(7,1,3),(0,6,2)]):
        inputs = chroma_inputs(l, seed=i, dtype=torch.bfloat16, device="cuda")
        ref = step(stock, inputs); got = step(model, inputs)
        err = max((got[1][n].float()-ref[1][n].float()).abs().max().item() for n in ref[1])
        print("varlen" if enabled else "stock", "reduce-overhead step", i, "max grad diff vs eager stock", err, "out diff", (got[0].float()-ref[0].float()).abs().max().item())
