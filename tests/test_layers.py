"""The package's layers: every import of a module of ``resilient_ddp`` goes down (or
sideways, within a layer), deferred imports (inside functions) included; imports under
``if TYPE_CHECKING:`` never run and are not counted.

Known upward imports would be listed in ``KNOWN_UPWARD`` (the debt issue 27 paid off: none
is left): a new one fails this test, and so does one listed there that is gone.
``docs/architecture.md`` draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "resilient_ddp"

#: Layer of each module, from the ground up (a module may import its own layer and those
#: below). A new module must be placed here.
LAYERS: dict[str, int] = {
    # 0 ground: pure or self-contained (errors, config, wire format, protocols, plans).
    **dict.fromkeys(
        [
            "errors",
            "config",
            "base._clock",
            "base._timings",
            "ops._wire",
            "training._elastic_protocol",
            "detection._diagnosis",
            "inference._work_pool",
            "base._compat",
            "base._backend",
            "inference.sampler",
            "inference._guest",
            "base._traces",
        ],
        0,
    ),
    # 1 control plane: the store, its keys and records; start-up checks; progress signals.
    **dict.fromkeys(
        [
            "control._control",
            "control._torchelastic",
            "group.preflight",
            "detection._progress",
            "control._events",
            "control._board",
            "runtime._exit_guard",
        ],
        1,
    ),
    # 2 the process's view of the job.
    "runtime._runtime": 2,
    # 3 failure detection: the watchdog, store-side diagnosis, the process's hooks.
    **dict.fromkeys(
        ["detection.watchdog", "runtime._process_hooks", "detection._store_diagnosis"], 3
    ),
    # 4 regrouping (a new generation's group).
    "group.membership": 4,
    # 5 bounded operations.
    **dict.fromkeys(
        ["ops.collectives", "inference.gather", "ops.torch_collectives", "ops.checkpoint"], 5
    ),
    # 6 elastic training.
    **dict.fromkeys(["training.elastic", "training.elastic_sampler"], 6),
    # 7 the process group's life.
    "group.process_group": 7,
    # 8 what users call: DDP, inference, launchers, framework integrations, tools.
    **dict.fromkeys(
        [
            "training.ddp",
            "inference.inference",
            "tools.launch",
            "tools._fork_server",
            "testing",
            "tools._demo",
            "tools._doctor",
            "__init__",
            "__main__",
            "integrations",
            "integrations._common",
            "integrations.fabric",
            "integrations.lightning",
            "integrations.transformers",
        ],
        8,
    ),
}

#: Upward imports that exist today (importer -> imported): each is debt. None is left (issue
#: 27): an upper layer passes a hook down instead (see docs/architecture.md). Never add one.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


#: The package's folders (docs/architecture.md, "Where things live"): each ``__init__.py``
#: holds only a docstring, so a folder has no layer of its own.
FOLDERS = sorted(
    p.parent.name for p in PKG.glob("*/__init__.py") if p.parent.name != "integrations"
)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions, not
    under ``if TYPE_CHECKING:``."""
    package = name.split(".")[:-1]
    out: set[str] = set()

    def resolve(module: str | None, level: int, names: list[str]) -> None:
        if level:
            base = package[: len(package) - (level - 1)] if level > 1 else package
        else:
            if module is None or not module.startswith("resilient_ddp"):
                return
            base, module = [], module.removeprefix("resilient_ddp").lstrip(".") or None
        stem = [*base, *(module.split(".") if module else [])]
        for alias in names:
            sub = ".".join([*stem, alias])
            if sub in modules:
                out.add(sub)
            elif stem and ".".join(stem) in modules:
                out.add(".".join(stem))

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    walk(stmt)
                continue
            if isinstance(child, ast.ImportFrom):
                resolve(child.module, child.level, [a.name for a in child.names])
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("resilient_ddp."):
                        resolve(a.name, 0, [])
                        sub = a.name.removeprefix("resilient_ddp.")
                        if sub in modules:
                            out.add(sub)
            walk(child)

    walk(ast.parse(path.read_text()))
    out.discard(name)
    return out


def _upward() -> set[tuple[str, str]]:
    modules = {n: p for n, p in _modules().items() if n not in FOLDERS}
    return {
        (name, dep)
        for name, path in modules.items()
        for dep in _imports(name, path, set(modules))
        if LAYERS[dep] > LAYERS[name]
    }


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(_modules()) - set(LAYERS) - set(FOLDERS))
    assert not missing, f"place these modules in LAYERS (tests/test_layers.py): {missing}"
    gone = sorted(set(LAYERS) - set(_modules()))
    assert not gone, f"modules listed in LAYERS that no longer exist: {gone}"


def test_a_folder_holds_only_its_docstring() -> None:
    """Importing ``resilient_ddp.detection`` runs no code: the folders are places, and
    every module keeps the layer LAYERS gives it."""
    for folder in FOLDERS:
        tree = ast.parse((PKG / folder / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"{folder}/__init__.py: say what the folder is about"
        assert len(tree.body) == 1, f"{folder}/__init__.py must hold only its docstring"


def test_the_architecture_page_lists_every_folder_and_its_modules() -> None:
    """The page's folder table names each folder and exactly the modules in it."""
    import re

    page = (PKG.parent.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` \| [^|]+\| (.+) \|$", page, re.MULTILINE)
    listed = {folder: set(re.findall(r"`(\w+)`", mods)) for folder, mods in rows}
    on_disk = {
        folder: {p.stem for p in (PKG / folder).glob("*.py") if p.stem != "__init__"}
        for folder in [*FOLDERS, "integrations"]
    }
    # A module's description may quote other names in backticks: compare what exists.
    missing = {f: sorted(on_disk[f] - listed.get(f, set())) for f in on_disk}
    assert not any(missing.values()), f"docs/architecture.md's folder table misses {missing}"
    assert set(listed) == set(on_disk)


def test_no_new_upward_import() -> None:
    new = sorted(_upward() - KNOWN_UPWARD)
    assert not new, (
        "imports that go up a layer (importer -> imported; a cycle waiting to happen: "
        f"pass a hook down instead, see docs/architecture.md): {new}"
    )


def test_the_known_upward_imports_are_still_there() -> None:
    paid = sorted(KNOWN_UPWARD - _upward())
    assert not paid, f"these upward imports are gone: remove them from KNOWN_UPWARD: {paid}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from . import _runtime\n", {"_runtime"}),
        ("def f():\n    from .errors import ConfigError\n", {"errors"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .ddp import X\n", set()),
        ("import resilient_ddp.ops.collectives\n", {"ops.collectives"}),
        ("from resilient_ddp.integrations import _common\n", {"integrations._common"}),
    ],
)
def test_the_scan_sees_top_level_deferred_and_typing_imports(
    tmp_path: Path, source: str, expected: set[str]
) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    modules = {"_runtime", "errors", "ddp", "ops.collectives", "integrations._common", "m"}
    assert _imports("m", path, modules) == expected


def test_the_lower_layers_know_who_this_process_is_through_the_runtimes_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_events`` and ``_torchelastic`` (layer 1) learn the rank and generation from the
    provider ``_runtime`` registers at import, not by importing it."""
    import logging
    from types import SimpleNamespace

    from resilient_ddp.control import _events, _torchelastic
    from resilient_ddp.runtime import _runtime

    monkeypatch.setenv("RANK", "5")
    record = logging.LogRecord("resilient_ddp", logging.INFO, __file__, 1, "m", None, None)
    monkeypatch.setattr(_runtime, "_runtime", SimpleNamespace(rank=3, generation=2))
    assert _events.identity() == (3, 2)
    assert _events.RankFilter().filter(record)
    assert (record.rank, record.generation) == (3, 2)  # type: ignore[attr-defined]
    assert _torchelastic._own_rank() == 3
    monkeypatch.setattr(_runtime, "_runtime", None)
    assert _events.identity() is None
    _events.RankFilter().filter(record)
    assert (record.rank, record.generation) == ("-", "-")  # type: ignore[attr-defined]
    assert _torchelastic._own_rank() == 5  # torchrun's variable, without a runtime


def test_the_architecture_page_lists_the_same_layers_and_debt() -> None:
    """docs/architecture.md is kept honest: its layer table names every module in its
    layer, and its debt table is ``KNOWN_UPWARD``."""
    import re

    page = (PKG.parent.parent / "docs" / "architecture.md").read_text()
    debt = set(re.findall(r"^\| `([\w.]+)` -> `([\w.]+)` \|", page, re.MULTILINE))
    assert debt == KNOWN_UPWARD
    rows = re.findall(r"^\| (\d)\. [^|]+\| ([^|]+) \|", page, re.MULTILINE)
    listed = {
        name.removesuffix(".*"): int(level)
        for level, names in rows
        for name in re.findall(r"`([\w.*]+)`", names)
    }
    expected = {n: lv for n, lv in LAYERS.items() if not n.startswith("integrations.")}
    expected.pop("__main__")
    assert listed == expected
