"""The installed distribution matches what ``pyproject.toml`` promises."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import subprocess
import sys

import resilient_ddp


def test_all_is_sorted() -> None:
    assert list(resilient_ddp.__all__) == sorted(resilient_ddp.__all__)


def test_all_has_no_duplicates() -> None:
    assert len(set(resilient_ddp.__all__)) == len(resilient_ddp.__all__)


def test_every_public_name_is_accessible() -> None:
    missing = [name for name in resilient_ddp.__all__ if not hasattr(resilient_ddp, name)]
    assert missing == []


def test_version_matches_distribution_metadata() -> None:
    assert resilient_ddp.__version__ == importlib.metadata.version("resilient-ddp")


def test_py_typed_marker_is_shipped() -> None:
    assert importlib.resources.files("resilient_ddp").joinpath("py.typed").is_file()


def test_console_script_points_at_main_module() -> None:
    (entry_point,) = importlib.metadata.entry_points(group="console_scripts", name="resilient-ddp")
    assert entry_point.value == "resilient_ddp.__main__:main"
    # Found without importing it: importing __main__ must not start the demo.
    assert importlib.util.find_spec("resilient_ddp.__main__") is not None


FRAMEWORKS = ("lightning", "pytorch_lightning", "torchmetrics", "accelerate", "transformers")


def test_importing_the_package_imports_no_framework() -> None:
    """``import resilient_ddp`` (and its integrations package) imports none of the
    frameworks, installed or not; each integration module imports its own."""
    code = (
        "import sys, resilient_ddp, resilient_ddp.integrations; "
        f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_framework_extras_are_declared() -> None:
    extras = importlib.metadata.metadata("resilient-ddp").get_all("Provides-Extra") or []
    assert {"lightning", "accelerate", "transformers"} <= set(extras), extras
