import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One intra-op thread per test process. The tensors here are tiny, so threads buy nothing, and on
# a 2-core machine shared with another process (xdist's second worker, a build) OpenMP threads
# spin against each other: a HunyuanVideo test file took 60.6 s with the default threads and
# 4.2 s with one, on the same loaded machine.
torch.set_num_threads(1)

# "ci" keeps the CPU suite well under its 10-minute budget on 2 cores; "thorough" for local runs.
settings.register_profile("ci", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fresh_dynamo():
    """A clean torch.compile state (no cached graphs, dynamo's counters at zero) around a test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Backend selection is cached by what it reads of a call (varlen_attn.execution._selected):
    right while the backends' declarations and auto's priority stay as they are, which tests
    monkeypatch. Plans are cached by mask value (varlen_attn.clear_plan_cache), which tests count.
    Each test starts with neither cached."""
    import varlen_attn
    import varlen_attn.execution

    varlen_attn.execution._selected.clear()
    varlen_attn.clear_plan_cache()
    varlen_attn.costs.clear()
    yield
    varlen_attn.execution._selected.clear()
    varlen_attn.clear_plan_cache()
    varlen_attn.costs.clear()


@pytest.fixture
def no_cost_table():
    """No cost table applies (varlen_attn.costs): auto packs every packable call, as tests of the
    packed path at tiny sizes need (on an H100/H200 the packaged table would leave them to stock)."""
    import varlen_attn.costs

    varlen_attn.costs.use([])
    yield
    varlen_attn.costs.use(None)


@pytest.fixture
def cpu_costs(monkeypatch):
    """``cpu_costs(kernel, stock_cheaper=True)``: stock's SDPA runs on ``kernel`` here (as
    ``costs.stock_kernel`` says, e.g. ``"cudnn"`` as on an H100/H200) and a CPU float64
    key-padding table weighs it cheaper than packing (``split_sdpa``) at every length, or dearer;
    the table goes when the test ends."""
    import varlen_attn.costs as costs

    def use(kernel: str, stock_cheaper: bool = True) -> None:
        monkeypatch.setattr(costs, "stock_kernel", lambda device, dtype: kernel)
        stock = [1.0, 10.0] if stock_cheaper else [4.0, 40.0]
        lay = {"tokens": [1, 256], "routes": {f"sdpa:{kernel}": {"cost": stock}, "split_sdpa": {"cost": [2.0, 20.0]}}}
        costs.use([{"gpu": "cpu", "capability": None, "dtype": "float64", "layouts": {"key_padding": lay}}])

    yield use
    costs.use(None)
