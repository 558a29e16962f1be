"""Every store key the library writes is under one root, ``rd/``, and is spelled by the
control plane (issue 27): the other modules take their keys and prefixes from ``_control``.
No store, no process: the key functions, the attempt namespace, and a scan of the source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from resilient_ddp.control import _control as ctl
from resilient_ddp.control import _torchelastic

PKG = Path(__file__).resolve().parent.parent / "src" / "resilient_ddp"
# The modules that own a key table (docs/architecture.md): the control plane, and inference's
# keys inside a job's namespace.
KEY_TABLES = {"_control.py", "_work_pool.py"}


def test_every_key_outside_a_generation_is_under_the_root() -> None:
    preflight = ctl.PreflightKeys(2)
    names = [
        ctl.CURRENT_JOB_KEY,
        ctl.JOB_ID_KEY,
        ctl.PREFLIGHT_PREFIX,
        ctl.job_prefix("job"),
        ctl.job_prefix("job", b"k" * 32),
        ctl.attempt_prefix(3),
        ctl.attached_key("3"),
        preflight.prefix,
        preflight.arrived,
        preflight.done,
        preflight.facts(5),
        preflight.verdict(),
        preflight.verdict(3),
    ]
    assert all(n.startswith(f"{ctl.ROOT}/") for n in names), names
    assert ctl.ROOT == "rd"
    assert len(set(names)) == len(names)


def test_the_spellings() -> None:
    # What an operator finds in the store (docs/control-plane.md names them).
    assert ctl.CURRENT_JOB_KEY == "rd/current"
    assert ctl.JOB_ID_KEY == "rd/job_id"
    assert ctl.job_prefix("j") == "rd/j"
    assert ctl.job_prefix("j", b"k" * 32) == f"rd/j/{ctl.names_tag(b'k' * 32)}"
    assert ctl.attempt_prefix(1) == "rd/attempt1"
    assert ctl.attached_key(1) == "rd/torchelastic/attempt1/attached"
    assert ctl.generation_prefix(4) == "g4"
    assert ctl.group_prefix(4) == "g4/pg"  # inside the job's namespace
    keys = ctl.PreflightKeys(0)
    assert (keys.facts(1), keys.arrived, keys.done) == (
        "rd/preflight/0/1",
        "rd/preflight/0/n",
        "rd/preflight/0/done",
    )
    assert [keys.verdict(i) for i in range(3)] == [
        "rd/preflight/0/verdict",
        "rd/preflight/0/verdict/1",
        "rd/preflight/0/verdict/2",
    ]


def test_a_job_namespace_is_its_prefix() -> None:
    base = dist.HashStore()
    root = ctl.root_prefix(base, "job", "s" * 16)
    assert root.prefix == ctl.job_prefix("job", root.mac_key)
    root.set("x", "1")
    assert base.check([f"{root.prefix}/x"])


def test_the_attempt_namespace_is_under_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    base = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(_torchelastic, "_attempt_namespaced", False)
    _torchelastic.attempt_namespace(base).set(ctl.CURRENT_JOB_KEY, "job")
    assert base.get(f"rd/attempt2/{ctl.CURRENT_JOB_KEY}") == b"job"


def _spelled_keys(path: Path) -> list[str]:
    """Where ``path`` spells a store key itself: a string (not a docstring) or f-string
    that starts with the root or one of the old roots, or a ``PrefixStore`` whose prefix
    is written out."""
    tree = ast.parse(path.read_text())
    skipped = set()  # docstrings, and the pieces of an f-string (judged whole)
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skipped.add(id(node.value))
        elif isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in node.values)
    key = re.compile(rf"^({ctl.ROOT}/|resilient_ddp/|resilient_ddp\.torchelastic|attempt(\d|$))")
    found = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped:
                text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                text = first.value
        if text is not None and key.match(text) and " " not in text:
            found.append(f"{path.name}:{node.lineno}: {text!r}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "PrefixStore"
            and node.args
            and isinstance(node.args[0], ast.Constant | ast.JoinedStr)
        ):
            found.append(f"{path.name}:{node.lineno}: PrefixStore({ast.unparse(node.args[0])})")
    return found


def test_no_module_but_the_control_plane_spells_a_key_of_the_root() -> None:
    spelled = [
        hit
        for path in sorted(PKG.rglob("*.py"))
        if path.name not in KEY_TABLES
        for hit in _spelled_keys(path)
    ]
    assert not spelled, spelled


def test_the_scan_finds_a_spelled_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""rd/<job>/ in a docstring is fine."""\n'
        'KEY = "rd/preflight"\n'
        'def f(n, s):\n    return dist.PrefixStore(f"g{n}/pg", s), f"attempt{n}"\n'
    )
    assert len(_spelled_keys(bad)) == 3
