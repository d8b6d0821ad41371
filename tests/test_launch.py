"""``python -m varlen_attn script.py ARGS`` (varlen_attn.launch): an unmodified training script
runs with every diffusers transformer it builds enabled, and trains as it does without it.

Two tests run real processes (a tiny Qwen-Image training script run both ways, and a script's
exit code); the rest call ``launch.main`` in this process, which restores what it changed.
"""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import varlen_attn.launch as launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "scripts" / "train_tiny.py"
QWEN_ATTN_LAYERS = 2  # the script's transformer: two double-stream blocks, one attention each
F32_EPS = 2.0 ** -23


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARLEN_ATTN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _summary(stderr: str) -> tuple[str, dict]:
    """``(what the summary says of the models, its stats)`` from the one summary line."""
    lines = [line for line in stderr.splitlines() if line.startswith("varlen_attn: ")]
    assert len(lines) == 1, stderr
    models, _, stats = lines[0][len("varlen_attn: "):].rpartition("; stats ")
    return models, json.loads(stats)


def _numbers(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", stdout)]


def _script(tmp_path, body: str, name="script.py") -> pathlib.Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def test_an_unmodified_training_script_trains_the_same_and_runs_varlen_attn(tmp_path):
    """The script builds a transformer, reloads it with from_pretrained, trains it on padded
    prompts in float32 and reloads the saved one for its final validation: run with
    ``python -m varlen_attn`` every loss is stock's, and the summary shows each masked attention
    call of the three models answered by varlen_attn."""
    imported = {a.name.split(".")[0] for node in ast.walk(ast.parse(TRAIN.read_text()))
                for a in getattr(node, "names", ()) if isinstance(node, (ast.Import, ast.ImportFrom))}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(TRAIN.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "varlen_attn" not in imported, "the training script must not know varlen_attn"
    runs = {}
    for name, prefix in (("stock", []), ("varlen", ["-m", "varlen_attn"])):
        out = tmp_path / name
        runs[name] = subprocess.Popen(
            [sys.executable, *prefix, str(TRAIN), "--output_dir", str(out), "--max_train_steps", "3"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {name: (p, *p.communicate(timeout=240)) for name, p in runs.items()}
    for name, (p, out, err) in done.items():
        assert p.returncode == 0, f"{name}:\n{err}"
    stock_out, varlen_out = done["stock"][1], done["varlen"][1]
    assert not any(line.startswith("varlen_attn") for line in done["stock"][2].splitlines())

    # stdout is the script's own: the same lines with the same labels, nothing added.
    def labels(text):
        return [re.sub(r"-?\d+\.\d+(?:e-?\d+)?", "#", line) for line in text.splitlines()]
    assert labels(varlen_out) == labels(stock_out) and len(labels(stock_out)) == 5, varlen_out

    stock, varlen = _numbers(stock_out), _numbers(varlen_out)
    # float32 rounding of a few steps; far below what the prompt mask changes (checked next).
    tol = [128 * F32_EPS * abs(x) for x in stock]
    assert all(abs(a - b) <= t for a, b, t in zip(varlen, stock, tol)), (varlen, stock)
    for line in stock_out.splitlines():
        if line.startswith("validation"):
            masked, unmasked = _numbers(line)
            assert abs(masked - unmasked) > 100 * 128 * F32_EPS * abs(masked), line

    models, stats = _summary(done["varlen"][2])
    # one model built by its constructor, two by from_pretrained
    assert models == "enabled 3 models: QwenImageTransformer2DModel x3", models
    masked_forwards = len(stock_out.splitlines())  # one per line: each step, each validation
    assert sum(stats["backends"].values()) == QWEN_ATTN_LAYERS * masked_forwards, stats
    assert "sdpa" not in stats["backends"] and not stats["fallbacks"], stats
    assert stats["plan_builds"] == QWEN_ATTN_LAYERS * masked_forwards and stats["host_syncs"] == 0, stats


def test_the_exit_code_passes_through_and_diffusers_is_not_imported_before_the_script(tmp_path):
    script = _script(tmp_path, """
        import sys
        print("diffusers imported:", "diffusers" in sys.modules)
        sys.exit(3)
    """)
    p = subprocess.run([sys.executable, "-m", "varlen_attn", str(script)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "diffusers imported: False\n"
    models, stats = _summary(p.stderr)
    assert models == "no model enabled (the script built no diffusers transformer)", models
    assert stats == {"backends": {}, "fallbacks": {}, "routes": {}, "plan_builds": 0, "host_syncs": 0,
                     "text_trims": 0, "trimmed_tokens": 0}


# -- in this process ---------------------------------------------------------------------------

def test_the_script_runs_as_main_with_its_own_argv_and_directory(tmp_path, capsys):
    """As ``python script.py``: ``__name__`` is ``__main__``, ``sys.argv`` the script's command
    line (``--`` and options named like ours included), ``sys.path[0]`` its directory (a sibling
    module imports); afterwards ``sys.argv`` and ``sys.path`` are ours again."""
    _script(tmp_path / "sub", "VALUE = 42\n", name="sibling.py")
    script = _script(tmp_path / "sub", """
        import json, sys
        import sibling
        print(json.dumps({"name": __name__, "argv": sys.argv[1:], "path0": sys.path[0],
                          "file": __file__, "sibling": sibling.VALUE}))
    """)
    argv, path = list(sys.argv), list(sys.path)
    launch.main(["--backend", "sdpa", str(script), "--backend", "x", "--", "-m", "y"])
    out, err = capsys.readouterr()
    assert json.loads(out) == {"name": "__main__", "argv": ["--backend", "x", "--", "-m", "y"],
                               "path0": str(script.parent.resolve()), "file": str(script), "sibling": 42}
    assert sys.argv == argv and sys.path == path
    assert err.startswith("varlen_attn: ") and err.count("\n") == 1, err


def test_a_module_runs_with_dash_m(tmp_path, capsys, monkeypatch):
    _script(tmp_path, "import sys\nprint(__name__, sys.argv[1:])\n", name="tiny_mod_for_launch.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    launch.main(["-m", "tiny_mod_for_launch", "a", "--strict"])
    assert capsys.readouterr().out == "__main__ ['a', '--strict']\n"


def test_an_exception_passes_through_unchanged_with_the_summary(tmp_path, capsys):
    script = _script(tmp_path, """
        class TrainingFailed(Exception):
            pass
        raise TrainingFailed("step 7 diverged")
    """)
    with pytest.raises(Exception, match="step 7 diverged") as info:
        launch.main([str(script)])
    assert type(info.value).__name__ == "TrainingFailed"
    assert capsys.readouterr().err.startswith("varlen_attn: ")


def test_under_several_processes_each_summary_names_its_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    launch.main([str(_script(tmp_path, ""))])
    assert capsys.readouterr().err.startswith("varlen_attn (rank 1): no model enabled")


def test_without_diffusers_the_script_runs_and_the_summary_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers raises, as if not installed
    script = _script(tmp_path, """
        try:
            import diffusers
        except ImportError:
            print("no diffusers")
    """)
    launch.main([str(script)])
    out, err = capsys.readouterr()
    assert out == "no diffusers\n"
    assert _summary(err)[0] == "diffusers is not installed, so no model could be enabled", err


# -- which models ---------------------------------------------------------------------------

_MODELS = """
    import sys
    import torch
    from diffusers import AutoencoderKL, QwenImageTransformer2DModel
    from diffusers.models.modeling_utils import ModelMixin
    from safetensors.torch import save_file

    CONFIG = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))

    class MyQwen(QwenImageTransformer2DModel):  # a subclass defined after the launcher started
        pass

    class Wrapper(ModelMixin):  # not a transformer: neither it nor the transformer built inside it
        def __init__(self):
            super().__init__()
            self.inner = QwenImageTransformer2DModel(**CONFIG)

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel.from_config(CONFIG)
    MyQwen(**CONFIG)
    Wrapper()
    AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=2, layers_per_block=1)
    model.save_pretrained(sys.argv[1])
    reloaded, info = QwenImageTransformer2DModel.from_pretrained(sys.argv[1], output_loading_info=True)
    save_file(model.state_dict(), sys.argv[1] + ".safetensors")
    QwenImageTransformer2DModel.from_single_file(sys.argv[1] + ".safetensors", config=sys.argv[1])
    mask = torch.arange(7)[None, :] < torch.tensor([[5], [0]])
    out = model(hidden_states=torch.randn(2, 20, 4), encoder_hidden_states=torch.randn(2, 7, 32),
                encoder_hidden_states_mask=mask, timestep=torch.rand(2), img_shapes=[(1, 4, 5)] * 2)
"""


def test_transformers_built_by_from_config_and_constructors_are_enabled_and_nothing_else(
        tmp_path, capsys, monkeypatch):
    """from_config, a subclass's constructor, from_pretrained (returning loading info too) and
    from_single_file count, each model once; a ModelMixin that is no transformer (and the
    transformer built inside it) and a VAE do not; the options reach enable_varlen (the backend
    from the environment); afterwards diffusers' classes are as they were."""
    pytest.importorskip("diffusers")
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.modeling_utils import ModelMixin

    before = (ModelMixin.__dict__["from_pretrained"], QwenImageTransformer2DModel.__dict__["__init__"],
              list(sys.meta_path))
    monkeypatch.setenv("VARLEN_ATTN_BACKEND", "reference")
    launch.main([str(_script(tmp_path, _MODELS)), str(tmp_path / "saved")])
    models, stats = _summary(capsys.readouterr().err)
    assert models == "enabled 4 models: QwenImageTransformer2DModel x3, MyQwen", models
    assert stats["backends"] == {"reference": QWEN_ATTN_LAYERS}, stats
    after = (ModelMixin.__dict__["from_pretrained"], QwenImageTransformer2DModel.__dict__["__init__"],
             list(sys.meta_path))
    assert after == before and "__init_subclass__" not in ModelMixin.__dict__


# -- options ----------------------------------------------------------------------------------

def test_options_come_from_the_command_line_then_the_environment(tmp_path, monkeypatch):
    script = str(_script(tmp_path, ""))
    defaults = {"backend": None, "float_mask": "bool", "strict": False, "restore_checkpoint_mask": True,
                "in_graph": True, "trim_text": True}
    assert launch.parse([script]) == (defaults, script, None, [])
    for name in ("BACKEND", "FLOAT_MASK", "STRICT", "RESTORE_CHECKPOINT_MASK", "IN_GRAPH", "TRIM_TEXT"):
        monkeypatch.delenv(f"VARLEN_ATTN_{name}", raising=False)
    monkeypatch.setenv("VARLEN_ATTN_FLOAT_MASK", "error")
    monkeypatch.setenv("VARLEN_ATTN_STRICT", "yes")
    monkeypatch.setenv("VARLEN_ATTN_IN_GRAPH", "0")
    monkeypatch.setenv("VARLEN_ATTN_TRIM_TEXT", "off")
    monkeypatch.setenv("VARLEN_ATTN_BACKEND", "sdpa")  # left to enable_varlen, which reads it per forward
    assert launch.parse([script, "x"])[0] == {**defaults, "float_mask": "error", "strict": True, "in_graph": False,
                                              "trim_text": False}
    options = launch.parse(["--float-mask", "bias", "--no-strict", "--backend=reference", "--in-graph",
                            "--no-restore-checkpoint-mask", "--trim-text", script])[0]
    assert options == {"backend": "reference", "float_mask": "bias", "strict": False,
                       "restore_checkpoint_mask": False, "in_graph": True, "trim_text": True}


@pytest.mark.parametrize("argv, env, expected", [
    (["--backend", "fa9", "{script}"], {}, ["--backend must be one of auto, sdpa, ", "got 'fa9'"]),
    (["--float-mask", "maybe", "{script}"], {},
     ["--float-mask must be one of bool, bias, error, got 'maybe'"]),
    (["{script}"], {"VARLEN_ATTN_BACKEND": "fa9"}, ["VARLEN_ATTN_BACKEND must be one of auto, sdpa, ", "got 'fa9'"]),
    (["{script}"], {"VARLEN_ATTN_FLOAT_MASK": "maybe"},
     ["VARLEN_ATTN_FLOAT_MASK must be one of bool, bias, error, got 'maybe'"]),
    (["{script}"], {"VARLEN_ATTN_STRICT": "maybe"},
     ["VARLEN_ATTN_STRICT must be one of 1, true, yes, on, 0, false, no, off, got 'maybe'"]),
    (["--backend"], {}, ["argument --backend: expected one argument"]),
    (["--bogus", "{script}"], {}, ["unrecognized arguments: --bogus"]),
    ([], {}, ["expected a script to run (or -m module), got none"]),
    (["missing.py"], {}, ["can't open file", "missing.py", "no such file"]),
])
def test_a_bad_option_exits_with_2_naming_it_what_was_expected_and_what_was_received(
        tmp_path, capsys, monkeypatch, argv, env, expected):
    script = _script(tmp_path, "print('ran')\n")
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        launch.main([a.format(script=script) for a in argv])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "", out
    assert err.startswith("usage: python -m varlen_attn"), err
    for text in expected:
        assert text in err, err


def test_help_documents_every_option_and_its_environment_variable(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for text in ("--backend", "--float-mask", "--strict", "--no-restore-checkpoint-mask", "--no-in-graph",
                 "-m module", "VARLEN_ATTN_BACKEND", "VARLEN_ATTN_FLOAT_MASK", "VARLEN_ATTN_STRICT",
                 "VARLEN_ATTN_RESTORE_CHECKPOINT_MASK", "VARLEN_ATTN_IN_GRAPH",
                 "accelerate launch -m varlen_attn", "diffusers.models.transformers", "stderr"):
        assert text in out, text
