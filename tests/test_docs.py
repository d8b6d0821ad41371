"""The documentation works as written: README.md and docs/*.md, read with markdown-it (or, where
markdown-it-py is not installed, a plain parser checked to read these documents the same way).

* Every relative link resolves to a file of this repository, and an anchor (``#...``) to a
  heading of the target (GitHub's heading ids). External links are not fetched. A section named
  in prose after a link or a file (``[api.md](api.md), "Diagnostics"``, ``README, "Install"``,
  ```benchmarks/NOTES.md`, "Backends"``) is a heading of that file.
* Every ```python block runs on the CPU, each in a fresh namespace that holds the names the docs
  use for the reader's own objects: ``transformer`` and ``model`` (one tiny diffusers Chroma,
  float32, 4 attention layers, ``tests/_models.py``) and ``batch`` (its inputs: three prompts
  padded to 7 tokens, one of them empty, and their boolean mask). Conventions, HTML comments
  right before a block (invisible on GitHub):
  ``<!-- no-run: REASON -->`` skips a python block; REASON must say it needs a GPU (or GPUs), the
  only reason allowed. ``<!-- output of the block above -->`` before a ```text block makes it
  the exact standard output of the python block before it. Each block starts with varlen_attn's
  plan cache empty, as a new process does, so the plan counts it prints are a reader's.
* ``<!-- stderr of: COMMAND -->`` before a ```text block: each of its lines is a line of the
  standard error of ``COMMAND``, run from the repository's root on the CPU (``python`` is this
  interpreter, ``OUT`` a fresh temporary folder): the summary ``python -m varlen_attn`` prints.
* Shell blocks (```bash, sh, shell, console) are not run. The python scripts they name under
  this repository's directories exist; every ``-m MODULE`` they name can be found, and
  ``python -m varlen_attn... --help`` exits 0; every extra of ``pip install ...[extras]`` is
  declared in pyproject.toml.
* The README's test command is the one CI runs (``.ci/run``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

try:
    import markdown_it
except ImportError:  # not in the test extra: the plain parser below reads the same documents
    markdown_it = None

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->", re.S)
OUTPUT = re.compile(r"<!--\s*output of the block above\s*-->")
STDERR = re.compile(r"<!--\s*stderr of:\s*(.*?)\s*-->", re.S)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- reading a document --------------------------------------------------------------------------

@dataclass
class Parsed:
    fences: list  # (line of the opening fence, info string, code, HTML comment right before or "")
    links: list  # (line, target) of every link and image
    headings: list  # each heading's text as rendered (markup removed)


def _parse_markdown_it(text: str) -> Parsed:
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(text)
    lines = text.splitlines()
    out = Parsed([], [], [])
    for i, tok in enumerate(tokens):
        if tok.type == "fence":
            prev = tokens[i - 1] if i else None
            comment = prev.content.strip() if prev is not None and prev.type == "html_block" else ""
            out.fences.append((tok.map[0] + 1, tok.info.strip(), tok.content, comment))
        elif tok.type == "heading_open":
            out.headings.append("".join(c.content for c in tokens[i + 1].children
                                        if c.type in ("text", "code_inline")))
        for child in tok.children or []:
            href = child.attrGet("href") if child.type == "link_open" else (
                child.attrGet("src") if child.type == "image" else None)
            if href is not None:  # the line of the paragraph (or table, item) that holds "(target"
                start, end = tok.map
                line = next((n for n in range(start, end) if f"({href}" in lines[n]), start)
                out.links.append((line + 1, href))
    return out


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")


def _heading_text(src: str) -> str:
    """A heading's rendered text: code spans as their content; elsewhere links as their text, and
    emphasis markers and inline HTML tags removed."""
    parts = re.split(r"(`+)(.+?)\1", src)  # [text, ticks, code, text, ticks, code, ..., text]
    out = []
    for i in range(0, len(parts), 3):
        t = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", parts[i])
        out.append(re.sub(r"</?[A-Za-z][^>]*>", "", t).replace("*", ""))
        if i + 2 < len(parts):
            out.append(parts[i + 2])
    return "".join(out)


def _parse_plain(text: str) -> Parsed:
    """What :func:`_parse_markdown_it` reads, for the constructs these documents use: fenced code,
    ATX headings, inline links (code spans stripped first); HTML comments before fences."""
    out = Parsed([], [], [])
    lines = text.splitlines()
    fence = None  # (marker, start line, info, comment, body)
    comment, in_comment = "", None
    for n, line in enumerate(lines, 1):
        if fence:
            marker, start, info, before, body = fence
            if re.fullmatch(rf" {{0,3}}{marker[0]}{{{len(marker)},}}\s*", line):
                out.fences.append((start, info, "".join(body), before))
                fence = None
            else:
                body.append(line + "\n")
            continue
        if in_comment is not None:
            in_comment.append(line)
            if "-->" in line:
                comment, in_comment = "\n".join(in_comment).strip(), None
            continue
        if m := _FENCE.match(line):
            fence = (m[1], n, m[2].strip(), comment, [])
            comment = ""
            continue
        if line.lstrip().startswith("<!--"):
            if "-->" in line:
                comment = line.strip()
            else:
                in_comment = [line]
            continue
        if line.strip():
            comment = ""
        if m := _HEADING.match(line):
            out.headings.append(_heading_text(m[1]))
        code_free = re.sub(r"(`+).+?\1", "", line)
        out.links.extend((n, m[1]) for m in _LINK.finditer(code_free))
    return out


@cache
def _parse(path: Path) -> Parsed:
    text = path.read_text(encoding="utf-8")
    return _parse_markdown_it(text) if markdown_it is not None else _parse_plain(text)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    comment: str  # the HTML comment right before the fence, or ""
    output: str | None = None  # for python: the expected stdout (a marked ```text block after it)

    @property
    def id(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    for line, info, code, comment in _parse(path).fences:
        block = Block(path, line, (info.split() or [""])[0].lower(), code, comment)
        if block.lang == "text" and OUTPUT.fullmatch(comment):
            assert out and out[-1].lang == "python", f"{block.id}: an output block must follow a python block"
            out[-1].output = block.code
        out.append(block)
    return out


ALL_BLOCKS = [b for path in DOCS for b in _blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


@pytest.mark.skipif(markdown_it is None, reason="markdown-it-py is not installed: nothing to compare with")
@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_plain_parser_reads_what_markdown_it_reads(path):
    """Without markdown-it-py the checks read the documents with the plain parser; on these
    documents it finds the same fences, links and headings."""
    text = path.read_text(encoding="utf-8")
    ours, theirs = _parse_plain(text), _parse_markdown_it(text)
    assert ours.fences == theirs.fences
    assert sorted(ours.links) == sorted(theirs.links)
    assert ours.headings == theirs.headings


# -- links ---------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    """GitHub's heading id: lower case, punctuation other than ``-`` and ``_`` removed, each space
    a ``-``."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for text in _parse(path).headings:
        base = _slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_relative_links_resolve(path):
    """Every relative link of the file names an existing file (or folder) of the repository, and
    its anchor a heading of the target."""
    bad = []
    for line, href in _parse(path).links:
        if re.match(r"[a-z][a-z0-9+.-]*:", href, re.I):
            continue  # http(s), mailto: not fetched
        target, _, anchor = href.partition("#")
        file = (path.parent / target).resolve() if target else path
        where = f"{_rel(path)}:{line}: {href!r}"
        if not file.is_relative_to(ROOT):
            bad.append(f"{where}: points outside the repository")
        elif not file.exists():
            bad.append(f"{where}: no file {file.relative_to(ROOT).as_posix()}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            bad.append(f"{where}: no heading with id {anchor!r} in {_rel(file)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slugs_follow_github():
    """The heading ids the link check expects, on headings of the forms the docs use."""
    assert _slug("Is it active?") == "is-it-active"
    assert _slug("`enable_varlen(model, backend=None, *, strict=False)`") == "enable_varlenmodel-backendnone--strictfalse"
    assert _slug("Results that differ from stock on purpose") == "results-that-differ-from-stock-on-purpose"
    assert _slug("Ulysses context parallelism: `va.ulysses_attention`") == "ulysses-context-parallelism-vaulysses_attention"


# A section named in prose after a link to a markdown file, after "README", or after a markdown
# file's path in backticks: [api.md](api.md), "Diagnostics" / README, "Install" /
# `benchmarks/NOTES.md`, "Backends" (whitespace, line breaks included, read as one space).
_SECTION_REF = re.compile(
    r'(?:\[[^\]]*\]\((?P<link>[^)#\s]+\.md)\)|(?P<readme>\bREADME\b)|`(?P<path>[\w./-]+\.md)`)'
    r'\s*,\s*"(?P<heading>[^"]+)"')


def _section_refs(path: Path) -> list[tuple[Path, str, str]]:
    """``(target file, quoted section name, where)`` of every section the file names in prose."""
    text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
    out = []
    for m in _SECTION_REF.finditer(text):
        if m["link"]:
            target = (path.parent / m["link"]).resolve()
        elif m["readme"]:
            target = ROOT / "README.md"
        else:
            target = ROOT / m["path"]
        out.append((target, m["heading"], f"{_rel(path)}: {m[0]!r}"))
    return out


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_sections_named_in_prose_exist(path):
    """Every section the file names in prose after a link or a file (``[design.md](design.md),
    "Under torch.compile"``, ``README, "Install"``) is a heading of that file: the reference a
    reader follows by hand resolves as a link does."""
    bad = []
    for target, heading, where in _section_refs(path):
        if not target.is_file():
            bad.append(f"{where}: no file {target}")
        elif _slug(_heading_text(heading)) not in _anchors(target):
            bad.append(f"{where}: no heading {heading!r} in {target.relative_to(ROOT).as_posix()}")
    assert not bad, "sections named but missing:\n" + "\n".join(bad)


def test_section_references_are_found():
    """The check above reads the forms the docs use and a file's path in backticks, across line
    breaks, and catches a heading that does not exist."""
    refs = {(t.name, h) for p in DOCS for t, h, _ in _section_refs(p)}
    assert ("troubleshooting.md", "Chroma (outer-product masks): host reads per layer") in refs
    assert ("README.md", "Models and backends") in refs
    found = _SECTION_REF.search('as measured (`benchmarks/NOTES.md`,\n  "Backends")')
    assert (found["path"], found["heading"]) == ("benchmarks/NOTES.md", "Backends")
    assert _slug(_heading_text("The `flex` backend")) not in _anchors(ROOT / "README.md")


# -- python blocks -------------------------------------------------------------------------------

def _reader_objects() -> dict:
    """The reader's own objects the docs name: a tiny Chroma and a padded batch for it."""
    from _models import chroma_inputs, tiny_chroma

    model = tiny_chroma(dtype=torch.float32)
    batch = chroma_inputs(dtype=torch.float32)
    batch.pop("return_dict", None)
    return {"transformer": model, "model": model, "batch": batch}


def _reset_accelerate():
    """accelerate keeps one state per process; a block's ``Accelerator()`` must not meet another
    test's settings."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block, monkeypatch):
    """The block runs on the CPU without error (and prints its marked output exactly)."""
    import varlen_attn as va

    reason = NO_RUN.fullmatch(block.comment)
    if reason:
        assert re.search(r"\bGPUs?\b", reason[1]), (
            f"{block.id}: no-run is for code that needs a GPU; reason given: {reason[1]!r}")
        pytest.skip(f"{block.id}: {reason[1]}")
    monkeypatch.delenv("VARLEN_ATTN_BACKEND", raising=False)
    names = {"__name__": "__doc_block__", **_reader_objects()}
    va.clear_plan_cache()  # a reader's fresh process: the counts printed include the first plan builds
    va.reset_stats()
    _reset_accelerate()
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            exec(compile(block.code, block.id, "exec"), names)
    finally:
        _reset_accelerate()
        va.disable_varlen(names["model"])
    if block.output is not None:
        assert stdout.getvalue().strip() == block.output.strip(), (
            f"{block.id} printed\n{stdout.getvalue()}\nwhere the docs say\n{block.output}")


# -- what a command prints ----------------------------------------------------------------------

STDERR_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "text" and STDERR.fullmatch(b.comment)]


@pytest.mark.parametrize("block", STDERR_BLOCKS, ids=lambda b: b.id)
def test_stderr_block_is_what_the_command_prints(block, tmp_path):
    """Each line of the block is a line the named command writes to standard error (run on the
    CPU from the repository's root, varlen_attn's environment variables unset)."""
    command = STDERR.fullmatch(block.comment)[1]
    args = [sys.executable if a == "python" else str(tmp_path / "out") if a == "OUT" else a
            for a in shlex.split(command)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARLEN_ATTN_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.id}: {command} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    printed = proc.stderr.splitlines()
    missing = [line for line in block.code.splitlines() if line.strip() and line not in printed]
    relevant = "\n".join(line for line in printed if line.startswith("varlen_attn"))
    assert not missing, f"{block.id}: {command} did not print\n" + "\n".join(missing) + f"\nit printed\n{relevant}"


# -- shell blocks --------------------------------------------------------------------------------

REPO_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".git")}


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists: ``$ `` prompts dropped, ``\\``
    continuations joined, split at ``&&``, ``||``, ``;`` and ``|``, comments removed."""
    text = re.sub(r"\\\n", " ", code)
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        for part in re.split(r"&&|\|\||;|\|", line):
            args = shlex.split(part, comments=True)
            if args:
                out.append(args)
    return out


@cache
def _extras() -> frozenset[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return frozenset(tomllib.load(f)["project"]["optional-dependencies"])


@cache
def _module_help(module: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _module_problem(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as e:
        return f"cannot be found ({e})"
    if spec is None:
        return "cannot be found"
    if spec.submodule_search_locations is not None and importlib.util.find_spec(module + ".__main__") is None:
        return "is a package without __main__"
    if module.split(".")[0] == "varlen_attn":
        proc = _module_help(module)
        if proc.returncode != 0:
            return f"`python -m {module} --help` exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return None


def _shell_problems(block: Block) -> list[str]:
    problems = []
    for args in _commands(block.code):
        for i, arg in enumerate(args):
            # python scripts named under this repository's folders must exist
            if arg.endswith((".py", ".sh")) and arg.split("/")[0] in REPO_DIRS and not (ROOT / arg).is_file():
                problems.append(f"{block.id}: no script {arg}")
            if arg in ("-m", "--module") and i + 1 < len(args):
                why = _module_problem(args[i + 1])
                if why:
                    problems.append(f"{block.id}: module {args[i + 1]} {why}")
        if args[:2] == ["pip", "install"] or args[1:4] == ["-m", "pip", "install"]:
            for arg in args:
                m = re.fullmatch(r"(?:\.|varlen_attn)\[([\w,-]+)\]", arg)
                if m:
                    missing = set(m[1].split(",")) - _extras()
                    if missing:
                        problems.append(f"{block.id}: extras {sorted(missing)} not in pyproject.toml "
                                        f"(declared: {sorted(_extras())})")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_shell_blocks_name_what_exists(path):
    """The scripts, modules and extras that the file's shell blocks name exist."""
    problems = list(dict.fromkeys(p for b in _blocks(path) if b.lang in SHELLS for p in _shell_problems(b)))
    assert not problems, "\n".join(problems)


def test_readme_test_command_is_ci_s():
    """The README's test set-up and command are the ones .ci/run runs (``python3`` read as
    ``python``, pip's quiet flags aside)."""
    ci = [args for args in _commands((ROOT / ".ci" / "run").read_text()) if "-m" in args]
    readme = [args for b in _blocks(ROOT / "README.md") if b.lang in SHELLS for args in _commands(b.code)]

    def norm(args):
        args = ["python" if a == "python3" else a for a in args]
        if args[1:3] == ["-m", "pip"]:
            args = [a for a in ["pip", *args[3:]] if a not in ("-q", "--disable-pip-version-check")]
        return args

    readme = [norm(a) for a in readme]
    for args in ci:
        assert norm(args) in readme, f".ci/run runs {shlex.join(args)}, which the README does not show"


def test_doc_blocks_are_found():
    """The parser finds the blocks the checks above run on: the README's quickstart with its
    output, and shell blocks that name scripts."""
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md"]
    assert any(b.lang == "python" and "enable_varlen(transformer)" in b.code and b.output for b in readme)
    assert any(b.lang in SHELLS and "examples/train_chroma.py" in b.code for b in readme)
    # the printed counts the docs show are checked: troubleshooting's plan builds, the switch's summary
    trouble = [b for b in PYTHON_BLOCKS if b.path.name == "troubleshooting.md" and b.output]
    assert len(trouble) >= 2 and all("plan_builds" in b.output for b in trouble)
    assert any(b.path.name == "api.md" and "plan_builds" in b.code for b in STDERR_BLOCKS)
