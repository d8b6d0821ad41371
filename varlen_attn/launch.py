"""``python -m varlen_attn [options] script.py ARGS``: run an unmodified training script with
every diffusers transformer it builds enabled (:func:`varlen_attn.enable_varlen`).

Which models: diffusers ``ModelMixin`` classes defined under ``diffusers.models.transformers``
(or subclasses), enabled once when the outermost build (``from_pretrained``, ``from_single_file``,
``from_config`` or the constructor) on the thread ends. How: an import hook wraps ``ModelMixin``'s
builders when the script imports diffusers; nothing runs at forward time. docs/api.md ("Zero-code
switch") has the full story.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys
import threading

from ._stats import reset_stats, stats
from .kernels import BACKENDS, ENV_VAR, SDPA
from .model import enable_varlen
from .policy import FLOAT_POLICIES

PROG = "python -m varlen_attn"
TRANSFORMERS = "diffusers.models.transformers."
_MODELING = "diffusers.models.modeling_utils"
_SINGLE_FILE = "diffusers.loaders.single_file_model"

# option (enable_varlen's keyword) -> its environment variable
_ENV = {
    "backend": ENV_VAR,
    "float_mask": "VARLEN_ATTN_FLOAT_MASK",
    "strict": "VARLEN_ATTN_STRICT",
    "restore_checkpoint_mask": "VARLEN_ATTN_RESTORE_CHECKPOINT_MASK",
    "in_graph": "VARLEN_ATTN_IN_GRAPH",
    "trim_text": "VARLEN_ATTN_TRIM_TEXT",
}
_DEFAULTS = {"backend": None, "float_mask": "bool", "strict": False, "restore_checkpoint_mask": True,
             "in_graph": True, "trim_text": True}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_BACKEND_NAMES = ["auto", SDPA, *sorted(BACKENDS)]

_DESCRIPTION = """\
Run a Python script (or, with -m, a module) as __main__, unmodified, with varlen_attn enabled
on every diffusers transformer it builds: varlen_attn.enable_varlen(model, ...) right after the
model is built by from_pretrained, from_single_file, from_config or its constructor (the model a
LoRA script reloads for its final inference included). Transformers are the diffusers models
defined under diffusers.models.transformers (or subclasses of them); VAEs, UNets, ControlNets
and text encoders are left alone. Nothing is added to the forward of any module beyond what
enable_varlen adds.

The script sees its own arguments (sys.argv), its directory as sys.path[0], and its exceptions
and exit code are passed on unchanged. At exit one summary line goes to stderr: the models
enabled and varlen_attn.stats(); varlen_attn writes nothing to stdout.

  python -m varlen_attn [options] train.py ARGS...
  accelerate launch -m varlen_attn [options] train.py ARGS..."""

_EPILOG = f"""\
Each option can also be set by an environment variable (the command line wins), so that
`accelerate launch -m varlen_attn` users can pass them:
  --backend                    {ENV_VAR} (read at every forward)
  --float-mask                 VARLEN_ATTN_FLOAT_MASK
  --[no-]strict                VARLEN_ATTN_STRICT                   (1/0, true/false, yes/no, on/off)
  --[no-]restore-checkpoint-mask VARLEN_ATTN_RESTORE_CHECKPOINT_MASK (as above)
  --[no-]in-graph              VARLEN_ATTN_IN_GRAPH                 (as above)
  --[no-]trim-text             VARLEN_ATTN_TRIM_TEXT                (as above)
The options mean what enable_varlen's arguments of the same names mean (docs/api.md).
Without diffusers installed the script still runs, and the summary says that no model could be
enabled."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage=f"{PROG} [options] (script.py | -m module) [args ...]")
    p.add_argument("--backend", metavar="NAME",
                   help=f"the attention backend: {', '.join(_BACKEND_NAMES)} (default: ${ENV_VAR} "
                        "read at every forward, else auto)")
    p.add_argument("--float-mask", metavar="{" + ",".join(FLOAT_POLICIES) + "}",
                   help="how a float 0/1 mask is read: as a keep-mask (bool, the default), as SDPA's "
                        "additive bias (bias), or refused (error)")
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="raise NotPackableError on a mask that cannot be packed instead of running "
                        "masked SDPA for it (default: off)")
    p.add_argument("--restore-checkpoint-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="give checkpointed blocks that diffusers calls without attention_mask "
                        "(Chroma's) the model's mask (default: on)")
    p.add_argument("--in-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="under torch.compile, run key-padding attention inside the compiled graph "
                        "(default: on)")
    p.add_argument("--trim-text", action=argparse.BooleanOptionalAction, default=None,
                   help="cut the trailing text columns every sample masks before the model's forward "
                        "(default: on)")
    p.add_argument("-m", dest="module", metavar="module",
                   help="run a module as __main__ (as python -m does) instead of a script")
    p.add_argument("script", nargs="?", help="the script to run; every argument after it is its own")
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(our options, [target, *its args])``: the first argument that is not one of our options
    (or the one after ``-m`` / ``--``) starts the script's command line, which is passed on
    exactly, ``--`` and options that look like ours included."""
    takes_value = {"--backend", "--float-mask"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg == "-m":
            return argv[:i + 2], argv[i + 2:]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mpackage.module
            return argv[:i + 1], argv[i + 1:]
        if not arg.startswith("-") or arg == "-":
            break
        i += 2 if arg in takes_value else 1
    return argv[:i], argv[i:]


def _from_env(parser, name: str, value):
    """The option's value: the command line's, else its environment variable's, else the default."""
    env = _ENV[name]
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return _DEFAULTS[name]
    if name == "float_mask":
        if raw not in FLOAT_POLICIES:
            parser.error(f"{env} must be one of {', '.join(FLOAT_POLICIES)}, got {raw!r}")
        return raw
    if name == "backend":
        return None  # enable_varlen reads the variable at every forward; checked below
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    parser.error(f"{env} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")


def parse(argv: list[str]):
    """``(enable_varlen keywords, script or None, module or None, the target's args)``; a bad
    option exits with status 2 and a message naming it, what was expected and what was received."""
    parser = _parser()
    ours, rest = _split(argv)
    ns = parser.parse_args(ours)  # never holds the script (_split): its positional is for --help
    module = ns.module
    if module is None and not rest:
        parser.error("expected a script to run (or -m module), got none")
    script = None if module is not None else rest[0]
    args = rest if module is not None else rest[1:]
    if ns.backend is not None and ns.backend not in _BACKEND_NAMES:
        parser.error(f"--backend must be one of {', '.join(_BACKEND_NAMES)}, got {ns.backend!r}")
    if ns.float_mask is not None and ns.float_mask not in FLOAT_POLICIES:
        parser.error(f"--float-mask must be one of {', '.join(FLOAT_POLICIES)}, got {ns.float_mask!r}")
    env_backend = os.environ.get(ENV_VAR)
    if ns.backend is None and env_backend and env_backend not in _BACKEND_NAMES:
        parser.error(f"{ENV_VAR} must be one of {', '.join(_BACKEND_NAMES)}, got {env_backend!r}")
    options = {name: _from_env(parser, name, getattr(ns, name)) for name in _ENV}
    if script is not None and not os.path.isfile(script) and not os.path.isdir(script):
        parser.error(f"can't open file {os.path.abspath(script)!r}: no such file or directory")
    return options, script, module, args


# -- enabling every transformer the script builds --------------------------------------------------

def is_transformer(cls: type) -> bool:
    """A diffusers model class defined under ``diffusers.models.transformers``, or a subclass of one."""
    return any(getattr(c, "__module__", "").startswith(TRANSFORMERS) for c in cls.__mro__)


class _Loader(importlib.abc.Loader):
    """A module's own loader, with ``then(module)`` run once the module has executed."""

    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules in ``hooks`` it asks the finders after it and gives
    their spec a :class:`_Loader` that runs the hook after the module executed."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, hook)
        return spec


class AutoEnable:
    """Enables every diffusers transformer built while installed (:meth:`install` ..
    :meth:`uninstall`, or ``with``), with ``options`` (enable_varlen's keywords)."""

    def __init__(self, options: dict):
        self.options = options
        self.enabled: list[str] = []  # class names, in the order the models were built
        self._local = threading.local()
        self._undo: list = []
        self._finder: _Finder | None = None
        self._model_mixin = None
        try:
            self.diffusers = importlib.util.find_spec("diffusers") is not None
        except (ImportError, ValueError):  # a module in sys.modules without a spec
            self.diffusers = sys.modules.get("diffusers") is not None

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        self.uninstall()
        return False

    def install(self) -> None:
        if not self.diffusers:
            return
        hooks = {_MODELING: self._patch_models, _SINGLE_FILE: self._patch_single_file}
        for name, hook in list(hooks.items()):
            if sys.modules.get(name) is not None:  # imported already (in this process, before us)
                hook(sys.modules[name])
                del hooks[name]
        if hooks:
            self._finder = _Finder(hooks)
            sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        while self._undo:
            self._undo.pop()()

    # -- patches ------------------------------------------------------------------------------

    def _set(self, cls: type, name: str, value) -> None:
        """``cls.name = value``, undone by :meth:`uninstall`."""
        if name in cls.__dict__:
            old = cls.__dict__[name]
            self._undo.append(lambda: setattr(cls, name, old))
        else:
            self._undo.append(lambda: delattr(cls, name))
        setattr(cls, name, value)

    def _patch_models(self, modeling_utils) -> None:
        mixin = self._model_mixin = modeling_utils.ModelMixin
        self._wrap_classmethod(mixin, "from_pretrained")
        prev = mixin.__dict__.get("__init_subclass__")
        auto = self

        def __init_subclass__(cls, **kwargs):
            if prev is not None:
                prev.__func__(cls, **kwargs)
            else:
                super(mixin, cls).__init_subclass__(**kwargs)
            auto._wrap_init(cls)

        self._set(mixin, "__init_subclass__", classmethod(__init_subclass__))
        todo = list(mixin.__subclasses__())
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            self._wrap_init(cls)

    def _patch_single_file(self, single_file_model) -> None:
        mixin = getattr(single_file_model, "FromOriginalModelMixin", None)
        if mixin is not None and isinstance(mixin.__dict__.get("from_single_file"), classmethod):
            self._wrap_classmethod(mixin, "from_single_file")

    def _wrap_classmethod(self, cls: type, name: str) -> None:
        func = cls.__dict__[name].__func__
        auto = self

        @functools.wraps(func)
        def build(owner, *args, **kwargs):
            result, outermost = auto._build(func, owner, args, kwargs)
            if outermost:  # output_loading_info=True returns (model, info)
                auto._enable(result[0] if isinstance(result, tuple) and result else result)
            return result

        build._varlen_build = True
        self._set(cls, name, classmethod(build))

    def _wrap_init(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_varlen_build", False):
            return
        auto = self

        @functools.wraps(init)
        def __init__(model, *args, **kwargs):
            if auto._build(init, model, args, kwargs)[1]:
                auto._enable(model)

        __init__._varlen_build = True
        self._set(cls, "__init__", __init__)

    def _build(self, fn, first, args, kwargs):
        """``(fn(first, *args, **kwargs), whether no other build was running on this thread)``."""
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            return fn(first, *args, **kwargs), depth == 0
        finally:
            local.depth = depth

    def _enable(self, model) -> None:
        """Enable ``model``, just built by the outermost build on its thread, if it is a
        transformer (and not enabled already)."""
        mixin = self._model_mixin
        if (mixin is not None and isinstance(model, mixin) and is_transformer(type(model))
                and model.__dict__.get("_varlen_state") is None):
            enable_varlen(model, **self.options)
            self.enabled.append(type(model).__name__)

    # -- the summary --------------------------------------------------------------------------

    def summary(self) -> str:
        """One line: the models enabled and :func:`varlen_attn.stats`."""
        if not self.diffusers:
            models = "diffusers is not installed, so no model could be enabled"
        elif not self.enabled:
            models = "no model enabled (the script built no diffusers transformer)"
        else:
            counts = collections.Counter(self.enabled)
            names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())
            models = f"enabled {len(self.enabled)} model{'s' if len(self.enabled) > 1 else ''}: {names}"
        rank = ""
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            rank = f" (rank {os.environ.get('RANK', '?')})"
        return f"varlen_attn{rank}: {models}; stats {json.dumps(stats())}"


def run(script: str | None, module: str | None, args: list[str]) -> None:
    """Run ``script`` (or ``module``) as ``__main__`` with ``sys.argv`` its own command line and,
    for a script, ``sys.path[0]`` its directory, as ``python script.py`` / ``python -m`` do;
    ``sys.argv`` and ``sys.path[0]`` are restored afterwards."""
    argv, path = sys.argv, list(sys.path)
    try:
        if module is not None:
            sys.argv = [module, *args]  # run_module puts the module's file in argv[0]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            if os.path.isfile(script):
                sys.path[0:1] = [os.path.dirname(os.path.realpath(script))]
            else:  # a directory or zip with __main__.py: run_path puts it first
                del sys.path[0:1]
            runpy.run_path(os.path.abspath(script), run_name="__main__")
    finally:
        sys.argv = argv
        sys.path[:] = path


def main(argv: list[str] | None = None) -> None:
    """The command line: ``python -m varlen_attn --help``."""
    options, script, module, args = parse(sys.argv[1:] if argv is None else list(argv))
    reset_stats()
    auto = AutoEnable(options)
    try:
        with auto:
            run(script, module, args)
    finally:
        print(auto.summary(), file=sys.stderr, flush=True)
