"""benchmarks/forward_host_time.py end to end on a 2-layer model: it reaches into varlen_attn's
internals (the walk, the hooks, the route lookup) to take one cost away at a time, so a rename
there must show here. The timings mean nothing and are not checked; that every variant ran is."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("diffusers")
pytest.importorskip("peft")


def test_every_variant_is_measured():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "forward_host_time.py"), "--layers", "2",
                           "--rounds", "2", "--lora", "2"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "2 attention calls a forward" in lines[0], lines
    names = [line.split(" p10 ")[0].strip() for line in lines[1:]]
    assert names == ["stock", "enable_varlen", "no walk", "no attention hooks", "no route"], lines
