"""GPU: tiny diffusers models in bf16 with enable_varlen on the best GPU backend vs stock, both
measured against a float64 CPU run of the same weights. Run with ``python -m pytest -m gpu``."""

import pytest
import torch

import varlen_attn as va

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none found)"),
]
diffusers = pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from test_integration import chroma_inputs, step, tiny_chroma  # noqa: E402


def _to(inputs, device, dtype):
    return {k: (v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else
                v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _err(a, ref):
    out_a, g_a = a
    out_r, g_r = ref
    return [(out_a.double().cpu() - out_r).abs().max().item()] + [
        (g_a[k].double().cpu() - g_r[k]).abs().max().item() / max(g_r[k].abs().max().item(), 1e-30) for k in g_r]


@pytest.mark.parametrize("lengths", [(5, 2, 0), (7, 7, 7), (1, 3, 6)])
def test_chroma_bf16_on_gpu_within_stock_error(lengths):
    torch.backends.cuda.enable_cudnn_sdp(False)  # CONTEXT.md: cuDNN SDPA failed inside diffusers models
    model = tiny_chroma()
    inputs = chroma_inputs(lengths)
    ref = step(model, inputs)  # float64, CPU
    model = model.to("cuda", torch.bfloat16)
    inputs = _to(inputs, "cuda", torch.bfloat16)
    stock = _err(step(model, inputs), ref)
    va.enable_varlen(model)
    va.reset_stats()
    ours = _err(step(model, inputs), ref)
    st = va.stats()
    va.disable_varlen(model)
    assert st["plan_builds"] == 1 and st["fallbacks"] == {}
    assert "sdpa" not in st["backends"]
    # Output: absolute error; gradients: error relative to each gradient's max. bf16 eps = 2^-8.
    for i, (o, s) in enumerate(zip(ours, stock)):
        assert o <= 2 * s + 2 * 2**-8, (i, o, s)
