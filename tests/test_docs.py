"""Every code sample of the documentation runs, or is checked, so that the docs cannot drift.

Each ```python block of every page in docs/ (but ``SKIP_PAGES``) is treated according to
the HTML comment on the line just before it (invisible on the rendered page):

* no comment: a complete script. It runs in a fresh interpreter and must exit 0.
* ``<!-- docs-test: ranks N -->``: a complete script for one rank, started N times the way
  torchrun starts it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a
  ``TCPStore(port=0)`` hosted by this test, the agent-store flag). Every rank must exit 0.
* ``<!-- docs-test: signature -->``: one or more signatures, ``rd.name(params) -> type``
  (``with rd.name(params):`` for a context manager). Each one's parameter names, kinds
  and defaults must be those of the real object (``inspect.signature``).
* ``<!-- docs-test: doctest -->``: ``>>>`` lines, run by doctest (``...`` matches
  anything), with the variables that the ``export`` lines of the nearest ```bash block
  above it set.
* ``<!-- docs-test: skip REASON -->``: a fragment that cannot run alone (names defined
  elsewhere, a GPU, torchrun). It must compile, and every ``rd.<name>`` it uses must exist.

Other pages' facts are checked against the code too: the configuration page lists every
config field with its environment variable, the errors page draws the real exception
tree, and the API page has an entry for every public name.
"""

from __future__ import annotations

import ast
import doctest
import inspect
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import resilient_ddp as rd

DOCS = Path(__file__).resolve().parent.parent / "docs"
# elastic.md documents a feature that is being written; its samples join when it lands.
SKIP_PAGES: frozenset[str] = frozenset()
SCRIPT_TIMEOUT_S = 120

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
    re.DOTALL | re.MULTILINE,
)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->")
KINDS = frozenset({"run", "ranks", "signature", "doctest", "skip"})


@dataclass(frozen=True)
class Sample:
    page: str
    index: int  # 1-based among the page's python blocks
    line: int  # where the block starts in the page
    code: str
    kind: str
    arg: str
    preceding_bash: str  # the nearest ```bash block above, for doctest's environment

    @property
    def name(self) -> str:
        return f"{self.page}#{self.index}"


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name not in SKIP_PAGES)


def _samples() -> list[Sample]:
    found = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        k = 0
        bash = ""
        for m in _FENCE.finditer(text):
            indent = len(m.group("indent"))
            code = "\n".join(line[indent:] for line in m.group("code").splitlines()) + "\n"
            lang = m.group("lang")
            if lang in ("bash", "sh", "shell", "console"):
                bash = code
                continue
            if lang not in ("python", "py"):
                continue
            k += 1
            before = text[: m.start()].rstrip().splitlines()
            marker = _MARKER.fullmatch(before[-1].strip()) if before else None
            kind, arg = (marker["kind"], marker["arg"]) if marker else ("run", "")
            line = text.count("\n", 0, m.start()) + 1
            found.append(Sample(page.name, k, line, code, kind, arg, bash))
    return found


SAMPLES = _samples()


def _of(*kinds: str) -> list[Sample]:
    return [s for s in SAMPLES if s.kind in kinds]


def _ids(samples: list[Sample]) -> list[str]:
    return [s.name for s in samples]


# -- the blocks and their markers -----------------------------------------------------------
def test_samples_found() -> None:
    pages = {s.page for s in SAMPLES}
    assert {"quickstart.md", "inference.md", "api.md", "configuration.md"} <= pages
    assert _of("run", "ranks"), "no runnable sample found: is the fence pattern broken?"


def test_markers_are_known_and_placed() -> None:
    """A misspelt marker, or one that is not right above a python block, would be ignored."""
    problems = [f"{s.name}: unknown kind {s.kind!r}" for s in SAMPLES if s.kind not in KINDS]
    problems += [
        f"{s.name}: `skip` needs a reason" for s in SAMPLES if s.kind == "skip" and not s.arg
    ]
    marked = {(s.page, s.line) for s in SAMPLES if s.kind != "run"}
    for page in _pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines, start=1):
            if _MARKER.search(line) and (page.name, i + 1) not in marked:
                problems.append(f"{page.name}:{i}: marker not directly above a ```python block")
    assert not problems, "\n".join(problems)


# -- running ------------------------------------------------------------------------------
# The samples are separate processes and spend much of their time importing torch or
# waiting for peers, so while one sample's test waits for it, the next selected sample
# already runs: at most two at a time, which keeps the module near a minute on 2 cores.
_IN_FLIGHT = 2


class _Job:
    """The processes of one sample: one script, or N ranks around a store of our own."""

    def __init__(self, sample: Sample, workdir: Path) -> None:
        self.sample = sample
        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / "sample.py"
        script.write_text(sample.code, encoding="utf-8")
        self.store: Any = None
        envs = [dict(os.environ)]
        if sample.kind == "ranks":
            world = int(sample.arg)
            # The store outlives every rank, as torchrun's agent store does.
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            base = {
                **os.environ,
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "GROUP_RANK": "0",
            }
            envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]
        self.outputs = [
            (workdir / f"out{r}.txt", workdir / f"err{r}.txt") for r in range(len(envs))
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        for env, (out, err) in zip(envs, self.outputs, strict=True):
            with out.open("wb") as fo, err.open("wb") as fe:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script)], cwd=workdir, env=env, stdout=fo, stderr=fe
                    )
                )
        self.deadline = time.monotonic() + SCRIPT_TIMEOUT_S

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self) -> list[tuple[int | None, str, str]]:
        """Every process's (exit code, stdout, stderr); killed at the deadline (code None)."""
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            killed = self.kill()
        results: list[tuple[int | None, str, str]] = []
        for p, (out, err) in zip(self.procs, self.outputs, strict=True):
            code = None if p in killed else p.returncode
            results.append((code, _read(out), _read(err)))
        return results

    def kill(self) -> list[subprocess.Popen[bytes]]:
        """Kill what still runs and wait for every process; return those killed."""
        killed = [p for p in self.procs if p.poll() is None]
        for p in killed:
            p.kill()
        for p in self.procs:
            p.wait()
        self.store = None
        return killed


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


class _Runner:
    """Starts the selected samples in test order, ``_IN_FLIGHT`` at a time."""

    def __init__(self, order: list[Sample], root: Path) -> None:
        self.order = order
        self.root = root
        self.jobs: dict[str, _Job] = {}

    def _start(self, sample: Sample) -> None:
        if sample.name not in self.jobs:
            self.jobs[sample.name] = _Job(sample, self.root / sample.name.replace("#", "_"))

    def result(self, sample: Sample) -> list[tuple[int | None, str, str]]:
        self._start(sample)
        i = next((k for k, s in enumerate(self.order) if s.name == sample.name), len(self.order))
        for nxt in self.order[i + 1 :]:
            if sum(j.running() for j in self.jobs.values()) >= _IN_FLIGHT:
                break
            self._start(nxt)
        return self.jobs[sample.name].wait()

    def close(self) -> None:
        for job in self.jobs.values():
            job.kill()


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    order = [
        item.callspec.params["sample"]
        for item in request.session.items
        if item.module is sys.modules[__name__]
        and getattr(item, "originalname", "") in ("test_sample_runs", "test_sample_runs_on_ranks")
    ]
    run = _Runner(order, tmp_path_factory.mktemp("samples"))
    yield run
    run.close()


def _failures(results: list[tuple[int | None, str, str]]) -> list[str]:
    return [
        f"--- process {r}: "
        + (f"killed after {SCRIPT_TIMEOUT_S} s" if rc is None else f"exit {rc}")
        + f"\n--- stdout\n{out}\n--- stderr\n{err}"
        for r, (rc, out, err) in enumerate(results)
        if rc != 0
    ]


@pytest.mark.parametrize("sample", _of("run"), ids=_ids(_of("run")))
def test_sample_runs(sample: Sample, runner: _Runner) -> None:
    failed = _failures(runner.result(sample))
    assert not failed, f"{sample.name} ({sample.page}, line {sample.line}):\n" + "\n".join(failed)


@pytest.mark.parametrize("sample", _of("ranks"), ids=_ids(_of("ranks")))
def test_sample_runs_on_ranks(sample: Sample, runner: _Runner) -> None:
    failed = _failures(runner.result(sample))
    assert not failed, f"{sample.name} ({sample.page}, line {sample.line}):\n" + "\n".join(failed)


@pytest.mark.parametrize("sample", _of("doctest"), ids=_ids(_of("doctest")))
def test_sample_doctest(sample: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in re.findall(r"^export (\w+)=(\S*)$", sample.preceding_bash, re.MULTILINE):
        monkeypatch.setenv(key, value)
    test = doctest.DocTestParser().get_doctest(
        sample.code, {"rd": rd, "timedelta": timedelta}, sample.name, sample.page, sample.line
    )
    assert test.examples, f"{sample.name}: no >>> example in a doctest block"
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)


# -- fragments ------------------------------------------------------------------------------
def _rd_names(tree: ast.AST) -> set[str]:
    """Every dotted name ``rd.a.b`` the code uses (the longest chain of each use)."""
    names = set()
    for top in ast.walk(tree):
        chain = []
        node = top
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "rd" and chain:
            names.add(".".join(reversed(chain)))
    return names


def _resolve(dotted: str) -> Any:
    obj: Any = rd
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("sample", _of("skip"), ids=_ids(_of("skip")))
def test_fragment_compiles_and_uses_real_names(sample: Sample) -> None:
    tree = ast.parse(sample.code, filename=sample.name)
    compile(tree, sample.name, "exec")
    missing = []
    for dotted in sorted(_rd_names(tree)):
        # rd.X must exist; rd.X.y is checked where X is a class (y: an attribute of it).
        head = dotted.split(".")[0]
        if not hasattr(rd, head):
            missing.append(dotted)
        elif "." in dotted and inspect.isclass(getattr(rd, head)):
            try:
                _resolve(".".join(dotted.split(".")[:2]))
            except AttributeError:
                missing.append(dotted)
    assert not missing, f"{sample.name} uses names resilient_ddp does not have: {missing}"


# -- signatures -----------------------------------------------------------------------------
def _signatures(code: str) -> list[tuple[str, str]]:
    """Split a block into ``(dotted name, "def stub(...) -> ...: ...")`` pairs."""
    out = []
    lines = [ln for ln in code.splitlines() if ln.strip() and ln.strip() != "..."]
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        m = re.match(r"^(?:with\s+)?(?:rd\.)?([\w.]+)\(", text)
        assert m, f"not a signature line: {text!r}"
        depth = text.count("(") - text.count(")")
        while depth > 0:
            i += 1
            nxt = re.sub(r"#.*$", "", lines[i])
            text += "\n" + nxt
            depth += nxt.count("(") - nxt.count(")")
        i += 1
        head = text[m.end() - 1 :]  # "(params) -> ret" or "(params):"
        head = head.rstrip().removesuffix(":")
        out.append((m.group(1), f"def _stub{head}: ..."))
    return out


def _doc_params(stub: str) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) of each parameter of a stub, in order."""
    fn = ast.parse(stub).body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    params: list[tuple[str, str, str | None]] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    for arg, d in zip(positional, defaults, strict=True):
        params.append((arg.arg, "POSITIONAL_OR_KEYWORD", ast.unparse(d) if d else None))
    if a.vararg:
        params.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append((arg.arg, "KEYWORD_ONLY", ast.unparse(d) if d else None))
    if a.kwarg:
        params.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return params


_DEFAULT_NS = {
    "timedelta": timedelta,
    "rd": rd,
    "torch": torch,
    "ReduceOp": dist.ReduceOp,
    "RetryPolicy": rd.RetryPolicy,
}


def _same_default(doc: str, real: Any) -> bool:
    if doc in ("...",):  # "documented elsewhere"
        return True
    try:
        value = eval(doc, dict(_DEFAULT_NS))  # our own docs' default expressions
    except Exception:  # noqa: BLE001 - e.g. a name the stub only describes
        return True
    if isinstance(real, timedelta) and isinstance(value, (int, float)):
        value = timedelta(seconds=value)
    return bool(value == real)


@pytest.mark.parametrize("sample", _of("signature"), ids=_ids(_of("signature")))
def test_signature_matches_code(sample: Sample) -> None:
    problems = []
    for dotted, stub in _signatures(sample.code):
        try:
            obj = _resolve(dotted)
        except AttributeError:
            problems.append(f"{dotted}: no such name in resilient_ddp")
            continue
        real = inspect.signature(obj)
        real_params = [
            (p.name, p.kind.name, p.default)
            for p in real.parameters.values()
            if not (p.name in ("self", "cls") and p.kind.name == "POSITIONAL_OR_KEYWORD")
        ]
        doc_params = _doc_params(stub)
        doc_names = [(n, k) for n, k, _ in doc_params]
        real_names = [(n, k) for n, k, _ in real_params]
        if doc_names != real_names:
            problems.append(f"{dotted}: documented {doc_names}\n    but the code has {real_names}")
            continue
        for (name, _, doc_default), (_, _, real_default) in zip(
            doc_params, real_params, strict=True
        ):
            has_default = real_default is not inspect.Parameter.empty
            if (doc_default is not None) != has_default:
                problems.append(f"{dotted}({name}): default documented as {doc_default!r}")
            elif doc_default is not None and not _same_default(doc_default, real_default):
                problems.append(
                    f"{dotted}({name}): documented default {doc_default}, "
                    f"the code's is {real_default!r}"
                )
    assert not problems, f"{sample.name} ({sample.page}, line {sample.line}):\n" + "\n".join(
        problems
    )


# -- facts of particular pages ----------------------------------------------------------------
def _table_rows(page: str, first_cell: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return [ln for ln in text.splitlines() if ln.startswith(f"| {first_cell}")]


@pytest.mark.parametrize("model", [rd.ResilienceConfig, rd.RetryPolicy], ids=lambda m: m.__name__)
def test_configuration_page_lists_every_field(model: Any) -> None:
    """Each field has a row in configuration.md naming its environment variable."""
    problems = []
    for name, info in model.model_fields.items():
        rows = _table_rows("configuration.md", f"`{name}`")
        if not rows:
            problems.append(f"{model.__name__}.{name}: no row in configuration.md")
            continue
        if name == "retry":
            continue
        env_name = (info.alias or name).upper()
        if model is rd.RetryPolicy:
            env_name = f"RETRY_{env_name}"
        if f"`RESILIENT_DDP_{env_name}`" not in rows[0]:
            problems.append(f"{model.__name__}.{name}: its row lacks RESILIENT_DDP_{env_name}")
    assert not problems, "\n".join(problems)


def _doc_tree() -> dict[str, tuple[str | None, set[str]]]:
    """errors.md's tree: class name -> (parent in the tree, extra bases in parentheses)."""
    text = (DOCS / "errors.md").read_text(encoding="utf-8")
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    tree: dict[str, tuple[str | None, set[str]]] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        m = re.match(r"^([│├└─\s]*)(\w+)(?:\s+\(([\w, ]+)\))?", line)
        if not m or not m.group(2):
            continue
        depth = len(m.group(1))
        name = m.group(2)
        extra = {b.strip() for b in m.group(3).split(",")} if m.group(3) else set()
        while stack and stack[-1][0] >= depth:
            stack.pop()
        tree[name] = (stack[-1][1] if stack else None, extra)
        stack.append((depth, name))
    return tree


def test_errors_page_draws_the_real_tree() -> None:
    tree = _doc_tree()
    errors = [
        getattr(rd, n)
        for n in rd.__all__
        if inspect.isclass(getattr(rd, n)) and issubclass(getattr(rd, n), rd.ResilientDDPError)
    ]
    problems = [f"{e.__name__} is not in the tree" for e in errors if e.__name__ not in tree]
    for e in errors:
        if e.__name__ not in tree or e is rd.ResilientDDPError:
            continue
        parent, extra = tree[e.__name__]
        ours = [b for b in e.__bases__ if issubclass(b, rd.ResilientDDPError)]
        others = {b.__name__ for b in e.__bases__ if not issubclass(b, rd.ResilientDDPError)}
        if [parent] != [b.__name__ for b in ours]:
            problems.append(f"{e.__name__}: drawn under {parent}, its bases are {e.__bases__}")
        if extra != others:
            problems.append(f"{e.__name__}: drawn with ({extra}), other bases {others}")
    for name in tree:
        if not hasattr(rd, name):
            problems.append(f"{name} is drawn but resilient_ddp has no such name")
    assert not problems, "\n".join(problems)


def test_api_page_covers_every_public_name() -> None:
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [
        n
        for n in rd.__all__
        if n != "__version__" and f"### {n}" not in text and f"`{n}`" not in text
    ]
    assert not missing, f"api.md has no entry for: {missing}"
