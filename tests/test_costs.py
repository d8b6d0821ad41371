"""auto's routing by measured cost (varlen_attn.costs): the table's format, the decision as a
pure function of the call's signature, and what a call routed to stock does (nothing of ours).

On the CPU no packaged table applies, so these tests give the router a table for the CPU whose
costs put stock first (or packing first) and check both routes."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import varlen_attn as va
from varlen_attn import costs

CPU = torch.device("cpu")


def table(stock_ms, packed_ms, tokens=(16, 256), kernel="split_sdpa", dtype="float64"):
    routes = {"sdpa:cpu": {"cost": list(stock_ms)}, kernel: {"cost": list(packed_ms)}}
    lay = {"tokens": list(tokens), "routes": routes}
    return [{"gpu": "cpu", "capability": None, "dtype": dtype, "layouts": {"key_padding": lay, "outer": lay}}]


STOCK_FIRST = table((1.0, 10.0), (2.0, 20.0))
PACK_FIRST = table((2.0, 20.0), (1.0, 10.0))


@pytest.fixture
def use_table():
    yield costs.use
    costs.use(None)


def inputs(b=3, h=2, s=20, d=8, lengths=(20, 7, 0), outer=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    mask = keep[:, None, :, None] & keep[:, None, None, :] if outer else keep[:, None, None, :]
    return q, k, v, mask


def test_the_packaged_table_loads_and_names_its_gpu():
    found = costs.load()
    assert found and all(t["gpu"] and t["layouts"] for t in found)
    for t in found:
        for lay in t["layouts"].values():
            assert any(r.startswith("sdpa:") for r in lay["routes"])


@pytest.mark.parametrize("broken, field", [
    ({"gpu": 3}, "'gpu'"),
    ({"dtype": "bf16"}, "'dtype'"),
    ({"layouts": {"diagonal": {"tokens": [1], "routes": {}}}}, "layout 'diagonal'"),
    ({"layouts": {"outer": {"tokens": [8, 4], "routes": {}}}}, "layouts.outer.tokens"),
    ({"layouts": {"outer": {"tokens": [4, 8], "routes": {"torch": {"cost": [1.0]}}}}}, "routes.torch.cost"),
    ({"layouts": {"outer": STOCK_FIRST[0]["layouts"]["outer"]}}, "must hold 'key_padding'"),
])
def test_a_malformed_table_is_refused_naming_the_field(tmp_path, broken, field):
    t = {**STOCK_FIRST[0], **broken}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": 1, "tables": [t]}))
    with pytest.raises(va.InputValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        costs.load(str(path))
    path.write_text(json.dumps({"tables": []}))
    with pytest.raises(va.InputValueError, match="format"):
        costs.load(str(path))


def test_the_environment_variable_points_the_router_at_a_file(tmp_path, monkeypatch, use_table):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"format": 1, "tables": STOCK_FIRST}))
    monkeypatch.setenv(costs.ENV_VAR, str(path))
    use_table(None)
    assert costs.decide(CPU, torch.float64, 2, 2, 8, 8, 20, 20, "key_padding").stock


def test_the_crossover_is_where_the_log_log_curves_meet_last():
    lay = {"tokens": [16, 64, 256], "routes": {"sdpa:cpu": {"cost": [1.0, 30.0, 400.0]},
                                              "k": {"cost": [2.0, 20.0, 200.0]}, "never": {"cost": [2, 40, 500]},
                                              "always": {"cost": [0.5, 20, 200]}, "twice": {"cost": [0.5, 40, 200]}}}
    w = math.log(2) / (math.log(2) - math.log(2 / 3))  # where log(k) - log(stock) crosses 0, 16 -> 64
    assert costs.crossover_tokens(lay, "k", "sdpa:cpu") == pytest.approx(16 * 4 ** w)
    assert costs.crossover_tokens(lay, "never", "sdpa:cpu") == math.inf
    assert costs.crossover_tokens(lay, "always", "sdpa:cpu") == 0.0
    assert 64 < costs.crossover_tokens(lay, "twice", "sdpa:cpu") < 256  # cheaper at 16 too: the last crossing
    assert costs.crossover_tokens(lay, "missing", "sdpa:cpu") is None


def test_the_route_is_a_function_of_the_signature(use_table):
    use_table(table((1.0, 30.0), (2.0, 20.0), tokens=(16, 64)))  # stock below ~38.4 tokens, packing above
    first = [costs.decide(CPU, torch.float64, 2, 2, 8, 8, s, s, "key_padding") for s in (38, 39)]
    for _ in range(50):
        again = [costs.decide(CPU, torch.float64, 2, 2, 8, 8, s, s, "key_padding") for s in (38, 39)]
        assert again == first
    assert first[0].stock and not first[1].stock
    assert "split_sdpa" in first[1].reason and "sdpa" in first[0].reason
    # Another dtype's element size has no table here: packing, as before routing by cost.
    assert not costs.decide(CPU, torch.float32, 2, 2, 8, 8, 20, 20, "key_padding").stock


def test_both_layouts_are_weighed_on_the_key_padding_curves(use_table, monkeypatch):
    """A call with rows costs what its keys' mask costs (costs.CURVES): the table's outer rows,
    here the opposite of key padding's, are not read; with rows, cuDNN's attention is never
    stock's route."""
    kernel = {"name": "cpu"}
    monkeypatch.setattr(costs, "stock_kernel", lambda device, dtype: kernel["name"])
    t = table((1.0, 10.0), (2.0, 20.0))
    t[0]["layouts"]["outer"] = PACK_FIRST[0]["layouts"]["outer"]
    for name in ("cpu", "cudnn"):
        t[0]["layouts"]["key_padding"]["routes"][f"sdpa:{name}"] = {"cost": [1.0, 10.0]}
    use_table(t)
    for name in ("cpu", "cudnn"):
        kernel["name"] = name
        costs.clear()
        for s in (20, 100, 300):
            keys = costs.decide(CPU, torch.float64, 2, 2, 8, 8, s, s, "key_padding")
            rows = costs.decide(CPU, torch.float64, 2, 2, 8, 8, s, s, "outer")
            assert keys.stock
            if name == "cpu":
                assert rows.stock, (s, rows)
            else:
                assert not rows.stock and "fails on masks with rows" in rows.reason, (s, rows)


@pytest.mark.parametrize("outer", [False, True])
def test_a_call_routed_to_stock_builds_no_plan_reads_nothing_and_is_stock(use_table, outer):
    use_table(STOCK_FIRST)
    q, k, v, mask = inputs(outer=outer)
    va.reset_stats()
    out = va.scaled_dot_product_attention(q, k, v, mask)
    out.sum().backward()
    st = va.stats()
    assert st["plan_builds"] == 0 and st["host_syncs"] == 0
    assert st["backends"] == {"sdpa": 1} and not st["fallbacks"]
    assert [r.split(":")[0] for r in st["routes"]] == ["sdpa"]
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    ref.sum().backward()
    assert torch.equal(out, ref) and all(torch.equal(a, b.grad) for a, b in zip(grads, (q2, k2, v2)))


def test_a_call_routed_to_packing_packs_and_says_why(use_table):
    use_table(PACK_FIRST)
    q, k, v, mask = inputs()
    va.reset_stats()
    out = va.scaled_dot_product_attention(q, k, v, mask)
    st = va.stats()
    assert st["backends"] == {"split_sdpa": 1} and st["plan_builds"] == 1
    assert list(st["routes"]) == [next(iter(st["routes"]))] and next(iter(st["routes"])).startswith("split_sdpa:")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_an_explicit_backend_still_packs_where_stock_is_cheaper(use_table):
    use_table(STOCK_FIRST)
    q, k, v, mask = inputs()
    va.reset_stats()
    va.scaled_dot_product_attention(q, k, v, mask, backend="split_sdpa")
    st = va.stats()
    assert st["backends"] == {"split_sdpa": 1} and st["plan_builds"] == 1 and not st["routes"]


def test_an_enabled_model_leaves_its_calls_to_stock_untouched(use_table):
    from _models import QF_B, QF_H, QF_T, QF_W, chroma_inputs, qwen_flux_inputs, qwen_model, step, tiny_chroma
    from _testing import assert_model_equal

    use_table(STOCK_FIRST)
    qwen = dict(qwen_flux_inputs(), img_shapes=[(1, QF_H, QF_W)] * QF_B,
                encoder_hidden_states_mask=torch.arange(QF_T)[None] < torch.tensor([QF_T, 3, 1])[:, None])
    qwen.pop("pooled_projections")
    for make, batch in ((qwen_model, qwen), (tiny_chroma, chroma_inputs())):
        stock, enabled = make(), make()
        va.enable_varlen(enabled, restore_checkpoint_mask=False)
        va.reset_stats()
        got = step(enabled, batch)
        st = va.stats()
        assert st["plan_builds"] == 0 and st["host_syncs"] == 0 and set(st["backends"]) == {"sdpa"}, st
        assert_model_equal(got, step(stock, batch), what=make.__name__)


def test_a_float_01_mask_routed_to_stock_is_read_as_boolean_on_the_device(use_table):
    use_table(STOCK_FIRST)
    q, k, v, mask = inputs()
    va.reset_stats()
    policy = va.policy.Policy("auto", float_mask="bool", model=True)
    from varlen_attn.functional import sdpa_with_policy

    out = sdpa_with_policy(q, k, v, mask.double(), policy=policy)
    assert va.stats()["plan_builds"] == 0 and va.stats()["host_syncs"] == 0
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_calls_are_routed_while_tracing_or_else_in_the_op(use_table, fresh_dynamo, dynamic):
    """Traced code: a call whose lengths are known to be below the crossover gets stock's SDPA
    traced into the graph (nothing of ours runs, nothing is counted). Where dynamo traced the
    lengths as symbols (dynamic=True) that is not known: the call reaches varlen_attn's custom
    op, which routes it at run time on its actual lengths, with no recompilation across lengths."""
    use_table(table((1.0, 30.0), (2.0, 20.0), tokens=(16, 64)))  # stock below ~38.4 tokens
    fn = torch.compile(lambda q, k, v, m: va.scaled_dot_product_attention(q, k, v, m), backend="aot_eager",
                       fullgraph=True, dynamic=dynamic)
    for s, stock in ((20, True), (24, True), (48, False)):
        q, k, v, mask = inputs(s=s, lengths=(s, 7, 0))
        va.reset_stats()
        out = fn(q, k, v, mask)
        expected = {"split_sdpa": 1} if not stock else {"sdpa": 1} if dynamic else {}
        assert va.stats()["backends"] == expected, (s, dynamic)
        assert va.stats()["plan_builds"] == (0 if stock else 1)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=1e-12)


def test_stock_kernel_follows_pytorchs_rule_off_the_gpu():
    assert costs.stock_kernel(CPU, torch.bfloat16) == "cpu"
    assert costs.layout_of((3, 1, 1, 20)) == "key_padding" and costs.layout_of((3, 1, 20, 20)) == "outer"
    assert costs.layout_of((20,)) == "key_padding"


@pytest.mark.parametrize("capability, cudnn, env, dtype, expected", [
    ((9, 0), 91900, None, torch.bfloat16, "cudnn"),
    ((10, 0), 90900, "1", torch.float16, "cudnn"),
    ((9, 0), 91900, "0", torch.bfloat16, "efficient"),  # TORCH_CUDNN_SDPA_PREFERRED=0
    ((9, 0), 90800, None, torch.bfloat16, "efficient"),  # cuDNN older than 9.9
    ((8, 0), 91900, None, torch.bfloat16, "efficient"),  # an A100
    ((12, 0), 91900, None, torch.bfloat16, "efficient"),  # an RTX 50
    ((9, 0), 91900, None, torch.float32, "efficient"),
])
def test_stock_kernel_follows_pytorchs_rule_on_a_gpu(monkeypatch, capability, cudnn, env, dtype, expected):
    """PyTorch's choice for a masked call (torch 2.11's sdp_utils.cpp), the GPU's facts faked (the
    variable and cuDNN's version are read once per device, so the cache is cleared around it)."""
    monkeypatch.setattr(costs, "_capability", lambda device: capability)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    if env is None:
        monkeypatch.delenv("TORCH_CUDNN_SDPA_PREFERRED", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDNN_SDPA_PREFERRED", env)
    costs._cudnn_first.cache_clear()
    gpu = torch.device("cuda", 0)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert costs.stock_kernel(gpu, dtype) == expected
        torch.backends.cuda.enable_cudnn_sdp(False)  # the switch a program flips: read at every call
        assert costs.stock_kernel(gpu, dtype) == "efficient"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        costs._cudnn_first.cache_clear()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_mask_with_rows_is_never_left_to_cudnn(use_table, monkeypatch, fresh_dynamo, compiled):
    """Where stock's kernel is cuDNN's attention, no mask with rows reaches it (costs.cudnn_rows_fail:
    cuDNN fails on such masks): an outer product runs as the key-padding call it is
    (execution.attend_outer; stock's SDPA sees its keys' mask), traced calls pack; key-padding
    masks still go to stock there, and outer ones where stock's kernel is another."""
    kernel = {"name": "cudnn"}
    monkeypatch.setattr(costs, "stock_kernel", lambda device, dtype: kernel["name"])
    seen = []
    sdpa = va.execution.TORCH_SDPA

    def spy(*args, **kwargs):
        seen.append(tuple(kwargs["attn_mask"].shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(va.execution, "TORCH_SDPA", spy)
    monkeypatch.setattr(va.hook, "_replaced", [lambda *a, **kw: spy(*a, **kw)])
    stock_first = table((1.0, 10.0), (2.0, 20.0), tokens=(16, 256))
    stock_first[0]["layouts"]["outer"]["routes"]["sdpa:cudnn"] = stock_first[0]["layouts"]["outer"]["routes"].pop("sdpa:cpu")
    fn = va.scaled_dot_product_attention
    if compiled:
        fn = torch.compile(lambda q, k, v, m: va.scaled_dot_product_attention(q, k, v, m), backend="aot_eager",
                           fullgraph=True, dynamic=False)
    stock_first[0]["layouts"]["key_padding"] = json.loads(json.dumps(stock_first[0]["layouts"]["outer"]))
    for lay in stock_first[0]["layouts"].values():  # calls of both layouts are weighed on key padding's
        lay["routes"]["sdpa:efficient"] = lay["routes"]["sdpa:cudnn"]
    use_table(stock_first)
    for s, outer, name, stock in ((64, True, "cudnn", not compiled), (60, True, "cudnn", not compiled),
                                  (64, False, "cudnn", True), (56, True, "efficient", True)):
        kernel["name"] = name
        q, k, v, mask = inputs(s=s, lengths=(s, 7, 0), outer=outer)
        va.reset_stats()
        seen.clear()
        out = fn(q, k, v, mask)
        ran = va.stats()["backends"]
        assert ran == ({} if compiled else {"sdpa": 1}) if stock else ran == {"split_sdpa": 1}, (s, outer, ran)
        if name == "cudnn":
            assert all(shape[-2] == 1 for shape in seen), (s, outer, seen)  # no rows reached cuDNN
        if outer and name == "cudnn":  # traced: packed, for that reason; eager: routed as key padding
            expected = ("split_sdpa: stock's cuDNN attention fails on masks with rows" if compiled else
                        "sdpa: cheaper than split_sdpa below inf tokens (key_padding mask, stock on cudnn, cpu's table)")
            assert list(va.stats()["routes"]) == [expected], va.stats()["routes"]
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=1e-12,
                                   equal_nan=True)
