"""The supported torch range: version parsing, the import-time check, pyproject's range."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import resilient_ddp as rd
from resilient_ddp.base import _compat
from resilient_ddp.base._compat import (
    ALLOW_ENV,
    TORCH_BELOW,
    TORCH_MIN,
    TORCH_REQUIREMENT,
    ParsedVersion,
    check_torch_version,
    is_supported,
    parse_version,
)

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# Versions around the range's ends, written from the constants so that a range change
# needs no edit here.
_LOW = f"{TORCH_MIN[0]}.{TORCH_MIN[1]}"
_PREV = f"{TORCH_MIN[0]}.{TORCH_MIN[1] - 1}"
_HIGH = f"{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"
_LAST = f"{TORCH_BELOW[0]}.{TORCH_BELOW[1] - 1}"


@pytest.mark.parametrize(
    ("text", "release", "pre"),
    [
        ("2.13.0", (2, 13, 0), False),
        ("2.13", (2, 13, 0), False),
        ("2.11.0.0", (2, 11, 0), False),
        ("2.13.1+cpu", (2, 13, 1), False),
        ("2.11.0+cu130", (2, 11, 0), False),
        ("2.6.0+rocm6.4.1", (2, 6, 0), False),
        ("2.14.0a0+git1234abc", (2, 14, 0), True),
        ("2.13.0.dev20260101", (2, 13, 0), True),
        ("2.13.0.dev20260101+cpu", (2, 13, 0), True),
        ("2.11.0rc1", (2, 11, 0), True),
        ("2.12.0b2", (2, 12, 0), True),
        ("2.13.0.post1", (2, 13, 0), False),
        (" v2.13.0 ", (2, 13, 0), False),
        ("3.0.0", (3, 0, 0), False),
    ],
)
def test_parse_version(text: str, release: tuple[int, ...], pre: bool) -> None:
    assert parse_version(text) == ParsedVersion(release, pre)


@pytest.mark.parametrize("text", ["", "torch", "2.x", "2.13.0+", "2.13.0 cpu", "1!2.13.0"])
def test_parse_version_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="PEP 440"):
        parse_version(text)


@pytest.mark.parametrize(
    "version",
    [
        f"{_LOW}.0",
        f"{_LOW}.0+cpu",
        f"{_LOW}.0+cu130",
        f"{_LOW}.2",
        f"{_LOW}.1rc1",  # a candidate of a patch release above the lowest release
        f"{_LAST}.0",
        f"{_LAST}.9+cu130",
        f"{_LAST}.0.dev20260101",  # a nightly of a supported minor release
        f"{_LAST}.0a0+git1234abc",
    ],
)
def test_in_range(version: str) -> None:
    assert is_supported(version)
    check_torch_version(version, environ={})  # neither raises nor warns (warnings are errors)


@pytest.mark.parametrize(
    "version",
    [
        f"{_PREV}.0",
        f"{_PREV}.9+cu128",
        "1.13.1",
        f"{_LOW}.0rc1",  # before the release itself, as pip orders it
        f"{_LOW}.0a0+git1234abc",
        f"{_LOW}.0.dev20250101",
        f"{_HIGH}.0",
        f"{_HIGH}.0+cpu",
        f"{_HIGH}.0a0+git1234abc",  # a nightly of the next minor: its internals already
        f"{_HIGH}.0.dev20260101",
        f"{_HIGH}.1",
        f"{TORCH_BELOW[0] + 1}.0.0",
    ],
)
def test_out_of_range(version: str) -> None:
    assert not is_supported(version)
    with pytest.raises(ImportError) as info:
        check_torch_version(version, environ={})
    message = str(info.value)
    assert f"torch {version} is installed" in message
    assert TORCH_REQUIREMENT in message
    assert f'pip install "{TORCH_REQUIREMENT}"' in message
    assert f"{ALLOW_ENV}=1" in message


def test_unreadable_version_is_refused() -> None:
    with pytest.raises(ImportError, match=r"version 'weird' could not be read"):
        check_torch_version("weird", environ={})


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_escape_hatch_turns_the_error_into_a_warning(value: str) -> None:
    with pytest.warns(RuntimeWarning, match=rf"torch {_PREV}\.0 is installed.*{ALLOW_ENV}"):
        check_torch_version(f"{_PREV}.0", environ={ALLOW_ENV: value})
    with pytest.warns(RuntimeWarning, match="could not be read"):
        check_torch_version("weird", environ={ALLOW_ENV: value})


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_escape_hatch_off(value: str) -> None:
    with pytest.raises(ImportError):
        check_torch_version(f"{_HIGH}.0", environ={ALLOW_ENV: value})


def test_escape_hatch_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(ImportError):
        check_torch_version(f"{_HIGH}.0")
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=ALLOW_ENV):
        check_torch_version(f"{_HIGH}.0")


def test_default_is_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_supported(str(torch.__version__)), "the torch tests run on is outside the range"
    check_torch_version(environ={})
    monkeypatch.setattr(torch, "__version__", f"{_PREV}.0")
    with pytest.raises(ImportError, match=rf"torch {_PREV}\.0 is installed"):
        check_torch_version(environ={})


def test_importing_the_module_runs_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import resilient_ddp` imports ``_compat`` first; its import is what refuses."""
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", f"{_HIGH}.0")
    try:
        with pytest.raises(ImportError, match=re.escape(TORCH_REQUIREMENT)):
            importlib.reload(_compat)
    finally:
        monkeypatch.undo()
        importlib.reload(_compat)


def _parts(requirement: str) -> tuple[str, list[str]]:
    """The name and the sorted specifiers of ``requirement``, spaces removed."""
    m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*([^;\[]*?)\s*", requirement)
    assert m is not None, f"not a plain requirement: {requirement!r}"
    specs = [s.replace(" ", "") for s in m.group(2).split(",") if s.strip()]
    return m.group(1).lower(), sorted(specs)


def test_pyproject_declares_the_checked_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads(_PYPROJECT.read_text())["project"]["dependencies"]
    torch_deps = [d for d in deps if re.match(r"torch\s*($|[^\w.-])", d)]
    assert len(torch_deps) == 1, deps
    assert _parts(torch_deps[0]) == _parts(TORCH_REQUIREMENT)


def test_escape_hatch_variable_is_not_a_config_error() -> None:
    rd.ResilienceConfig.from_env({ALLOW_ENV: "1"})
