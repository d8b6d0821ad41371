"""Which SDPA calls varlen_attn answers, and nothing else: an enabled model's (its forward, its
attention modules, their checkpoint recomputation), with the same route in every forward, beside
other models, other threads, another library's SDPA patch or TorchFunctionMode, and diffusers'
regional compilation. (varlen_attn.hook, varlen_attn.model)"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import varlen_attn as va
from _testing import assert_model_close

pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from _models import QF_B, QF_H, QF_W, QWEN_ATTN_LAYERS, prefix_keep, qwen_flux_inputs, qwen_model, step  # noqa: E402


def _qwen_pair():
    stock = qwen_model()
    enabled = va.enable_varlen(qwen_model())
    return stock, enabled


def _inputs(seed=0):
    """Qwen-Image's batch with a new ``encoder_hidden_states_mask`` tensor every call (text
    lengths 5, 2 and 0: caption dropout on the last)."""
    inputs = qwen_flux_inputs(seed=seed + 1)
    inputs.pop("pooled_projections")
    return {**inputs, "encoder_hidden_states_mask": prefix_keep([5, 2, 0]), "img_shapes": [(1, QF_H, QF_W)] * QF_B}


def test_a_forward_runs_no_python_of_ours_but_its_attention():
    """During an enabled forward no TorchFunctionMode of ours is active (every other torch
    function runs as stock), and an SDPA call outside every enabled forward is torch's."""
    stock, model = _qwen_pair()
    depths = []
    handle = model.transformer_blocks[0].img_mlp.register_forward_pre_hook(
        lambda *_: depths.append(torch._C._len_torch_function_stack()))
    va.reset_stats()
    assert_model_close(step(model, _inputs()), step(stock, _inputs()), what="qwen")
    handle.remove()
    assert depths == [0], depths
    assert va.stats()["plan_builds"] == QWEN_ATTN_LAYERS and va.stats()["host_syncs"] == 0, va.stats()
    q = k = v = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    va.reset_stats()
    F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))
    assert va.stats()["plan_builds"] == 0 and not va.stats()["backends"], "a stock call was answered"


def test_the_same_call_is_routed_the_same_way_in_the_1st_and_the_50th_forward():
    """What a forward does follows from its inputs and the options: nothing is learned from
    earlier forwards (each forward's counts are the first's, a new mask tensor every time)."""
    stock, model = _qwen_pair()
    seen = []
    for i in range(50):
        va.reset_stats()
        with torch.no_grad():
            model(**{"return_dict": False, **_inputs(seed=i % 3)})
        seen.append(va.stats())
    assert all(s == seen[0] for s in seen), [s for s in seen if s != seen[0]][:2]
    assert seen[0]["backends"] == {"split_sdpa": QWEN_ATTN_LAYERS} and seen[0]["host_syncs"] == 0, seen[0]
    assert_model_close(step(model, _inputs(seed=4)), step(stock, _inputs(seed=4)), what="after 50 forwards")


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_another_librarys_torch_function_mode_sees_the_forward_and_results_equal_stock():
    """A TorchFunctionMode of another library around an enabled forward still sees the model's
    functions (the forward runs under it) and the results equal stock's under the same mode."""
    stock, model = _qwen_pair()
    with _Counting() as theirs:
        got = step(model, _inputs())
    with _Counting() as around_stock:
        want = step(stock, _inputs())
    assert_model_close(got, want, what="under another mode")
    assert "linear" in theirs.names and "linear" in around_stock.names


def test_another_librarys_sdpa_patch_keeps_the_calls_outside_enabled_models():
    """A library that patched ``F.scaled_dot_product_attention`` before varlen_attn was enabled
    keeps every call outside enabled models (varlen_attn passes them on to it); inside an
    enabled model varlen_attn answers."""
    from varlen_attn import hook

    seen = []

    def theirs(*args, **kwargs):
        seen.append(1)
        return va.kernels.TORCH_SDPA(*args, **kwargs)

    replaced = hook._replaced[0]
    try:
        torch.nn.functional.scaled_dot_product_attention = theirs  # as if patched before varlen_attn
        stock, model = qwen_model(), va.enable_varlen(qwen_model())  # installs over theirs
        assert hook._replaced[0] is theirs
        va.reset_stats()
        got = step(model, _inputs())
        assert va.stats()["plan_builds"] == QWEN_ATTN_LAYERS and not seen, (va.stats(), len(seen))
        want = step(stock, _inputs())
        assert len(seen) == QWEN_ATTN_LAYERS  # the stock model's calls went through their patch
        assert_model_close(got, want, what="beside another patch")
    finally:
        hook._replaced[0] = replaced
        torch.nn.functional.scaled_dot_product_attention = hook._sdpa


def test_two_enabled_models_and_a_stock_one_in_three_threads():
    """Two enabled models (different backends) and a stock one run forwards at once in three
    threads: each equals its stock result, and the stock model's calls stay stock."""
    stock = qwen_model()
    models = {"split_sdpa": va.enable_varlen(qwen_model(), backend="split_sdpa"),
              "reference": va.enable_varlen(qwen_model(), backend="reference"), "stock": qwen_model()}
    want = step(stock, _inputs())
    results, errors = {}, []
    barrier = threading.Barrier(len(models))

    def run(name, model):
        try:
            barrier.wait()
            results[name] = [step(model, _inputs()) for _ in range(3)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    va.reset_stats()
    threads = [threading.Thread(target=run, args=item) for item in models.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, runs in results.items():
        for got in runs:
            assert_model_close(got, want, what=name)
    st = va.stats()
    assert st["backends"] == {"split_sdpa": 3 * QWEN_ATTN_LAYERS, "reference": 3 * QWEN_ATTN_LAYERS}, st


def test_regional_compilation_of_repeated_blocks_compiles_each_block_class_once():
    """diffusers' ``compile_repeated_blocks(fullgraph=True)`` on an enabled model: every instance
    of the block class shares one graph (a recompile per block would hit dynamo's limit), new
    masks recompile nothing, and the steps equal stock's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    stock, model = _qwen_pair()
    counter = CompileCounterWithBackend("eager")
    # The config's own patch: monkeypatch's undo deletes a config entry of torch's config modules.
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            model.compile_repeated_blocks(fullgraph=True, backend=counter)
            for seed in range(3):
                assert_model_close(step(model, _inputs(seed)), step(stock, _inputs(seed)), what=f"seed {seed}")
        assert counter.frame_count == 1, counter.frame_count
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_without_diffusers_attention_modules_checkpointed_by_the_caller(reentrant):
    """A plain module calling SDPA itself, its blocks checkpointed by the caller around the
    module call (``torch.utils.checkpoint(block, ...)``): every submodule of such a model routes
    its calls, so the recomputation, in backward and outside the forward, is routed as the
    forward was (a recomputation on stock SDPA stops a non-reentrant checkpoint: "A different
    number of tensors was saved"), and the step equals stock's."""
    import copy

    from _testing import CheckpointedModule
    from test_in_graph import _mask, _Model, _out_and_grads, _x

    stock = _Model(["keys", "padding"])
    model = copy.deepcopy(stock)
    for m in (stock, model):
        for i, block in enumerate(list(m.blocks)):
            m.blocks[i] = CheckpointedModule(block, reentrant)
    va.enable_varlen(model, backend="reference")
    va.reset_stats()
    got = _out_and_grads(model, _x(0), _mask((3, 0, 5)))
    # two blocks, each called in the forward and the recomputation: a plan per call (key padding,
    # and the outer product run as key padding), and a host read per call of the outer product
    # (its check, read in the call: this model's checks are not deferred to the forward's end)
    blocks, passes = 2, 2  # ("keys", "padding"); forward and recomputation
    assert va.stats()["plan_builds"] == blocks * passes and va.stats()["host_syncs"] == passes, va.stats()
    assert not va.stats()["fallbacks"], va.stats()
    assert_model_close(got, _out_and_grads(stock, _x(0), _mask((3, 0, 5))), what=f"reentrant={reentrant}")


def test_a_whole_model_compiled_runs_varlen_and_never_recompiles_its_hooks():
    """diffusers' own compile test (``error_on_recompile``): an enabled model compiled whole,
    called three times with new masks, recompiles nothing (dynamo traces the model's pre-hook as
    a frame of its own; a guard on state made at its first call recompiled the second) and
    routes every masked call to varlen_attn (a store into the thread's state that dynamo does
    not replay would run stock SDPA)."""
    torch._dynamo.reset()
    stock, model = _qwen_pair()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in range(3):
                va.reset_stats()
                got = step(compiled, _inputs(seed))
                assert va.stats()["backends"] == {"split_sdpa": QWEN_ATTN_LAYERS}, va.stats()
                assert_model_close((got[0], {n.replace("_orig_mod.", ""): g for n, g in got[1].items()}),
                                   step(stock, _inputs(seed)), what=f"seed {seed}")
    finally:
        torch._dynamo.reset()
