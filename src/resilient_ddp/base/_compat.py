"""The torch versions resilient_ddp supports, checked when the package is imported.

The library builds on internals of ``DistributedDataParallel`` and c10d that torch does not
promise to keep between minor releases: it re-runs ``DistributedDataParallel.__init__`` on
an existing instance (``init_sync=False``), drives ``Reducer._rebuild_buckets`` and
``Reducer._remove_autograd_hooks``, overrides ``_default_broadcast_coalesced``, queues
autograd final callbacks (``Variable._execution_engine.queue_callback``), resets
``distributed_c10d._world.group_count`` and calls ``_set_pg_timeout``. A torch outside the
tested range can therefore fail in ways that look like the hangs this library exists to
prevent, so ``import resilient_ddp`` refuses it with an :class:`ImportError` that says what
to install.

:data:`TORCH_MIN` and :data:`TORCH_BELOW` are the one place the range is written;
``pyproject.toml`` declares the same range (a test compares them).

Setting ``RESILIENT_DDP_ALLOW_UNSUPPORTED_TORCH=1`` turns the error into a
:class:`RuntimeWarning`, for trying a newer torch before the range is widened.

Versions are compared as pip compares them (PEP 440) without needing ``packaging``: a local
label (``2.13.0+cpu``) is ignored, and a pre-release or development build (``2.14.0a0+git1234abc``,
``2.13.0.dev20260101``, ``2.11.0rc1``) comes before the release it leads to. So a nightly of
the next minor release is outside the range, and a release candidate of the lowest
supported one is too.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from typing import NamedTuple

__all__: list[str] = []

#: The oldest supported torch (major, minor), inclusive.
TORCH_MIN: tuple[int, int] = (2, 11)
#: The first torch (major, minor) that is no longer supported (exclusive bound).
TORCH_BELOW: tuple[int, int] = (2, 16)

#: The requirement as ``pyproject.toml`` declares it.
TORCH_REQUIREMENT = f"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"

#: Set to ``1`` (or true/yes/on) to import with an unsupported torch, with a warning.
ALLOW_ENV = "RESILIENT_DDP_ALLOW_UNSUPPORTED_TORCH"

_TRUE = frozenset({"1", "true", "yes", "on"})

# Release segment, then (PEP 440, case-insensitive) an optional pre-release, post-release
# and development segment, then an optional local label after "+".
_VERSION_RE = re.compile(
    r"""
    ^\s*v?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?[0-9]*)?
    (?P<post>(?:-[0-9]+)|(?:[-_.]?(?:post|rev|r)[-_.]?[0-9]*))?
    (?P<dev>[-_.]?dev[-_.]?[0-9]*)?
    (?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?
    \s*$
    """,
    re.VERBOSE | re.IGNORECASE,
)


class ParsedVersion(NamedTuple):
    """What the range check needs of a version string.

    Attributes:
        release: The release numbers, with trailing zeros dropped and then padded with
            zeros to at least three (``"2.13"`` and ``"2.13.0.0"`` -> ``(2, 13, 0)``).
        prerelease: Whether it is a pre-release or development build of ``release``
            (``a``/``b``/``rc`` or ``.dev`` segment), which PEP 440 orders before
            ``release`` itself.
    """

    release: tuple[int, ...]
    prerelease: bool


def parse_version(text: str) -> ParsedVersion:
    """Parse a torch version string such as ``torch.__version__``.

    Args:
        text: E.g. ``"2.13.0"``, ``"2.13.0+cpu"``, ``"2.14.0a0+git1234abc"``,
            ``"2.13.0.dev20260101+cu130"``.

    Returns:
        The release numbers and whether it is a pre-release.

    Raises:
        ValueError: ``text`` is not a PEP 440 version.
    """
    m = _VERSION_RE.match(str(text))
    if m is None:
        raise ValueError(f"not a PEP 440 version: {text!r}")
    numbers = [int(part) for part in m.group("release").split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:  # 2.11.0.0 is 2.11.0 (PEP 440)
        numbers.pop()
    release = (*numbers, *(0,) * (3 - len(numbers)))
    return ParsedVersion(release, m.group("pre") is not None or m.group("dev") is not None)


def is_supported(version: str) -> bool:
    """Whether torch ``version`` lies in ``[TORCH_MIN, TORCH_BELOW)``, as pip would judge it.

    Args:
        version: A torch version string.

    Raises:
        ValueError: ``version`` is not a PEP 440 version.
    """
    v = parse_version(version)
    low = (*TORCH_MIN, 0)
    high = (*TORCH_BELOW, 0)
    if v.release < low or (v.release == low and v.prerelease):
        return False
    # A pre-release of `high` (a nightly of the next minor, e.g. 2.16.0a0 against <2.16)
    # sorts below it, but PEP 440 keeps it out: it already has the next release's internals.
    return v.release < high


def check_torch_version(
    version: str | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse a torch outside the supported range.

    Args:
        version: The version to check; default: the installed ``torch.__version__``.
        environ: Where to read :data:`ALLOW_ENV`; default ``os.environ``.

    Raises:
        ImportError: ``version`` is outside :data:`TORCH_REQUIREMENT` (or unreadable) and
            :data:`ALLOW_ENV` is not set; the message names the installed version, the
            supported range, the ``pip install`` command that fixes it and the escape hatch.

    Warns:
        RuntimeWarning: Instead of the error, when :data:`ALLOW_ENV` is set.
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    try:
        ok = is_supported(version)
        problem = f"torch {version} is installed"
    except ValueError:
        ok = False
        problem = f"the installed torch's version {version!r} could not be read"
    if ok:
        return
    req = TORCH_REQUIREMENT
    env = os.environ if environ is None else environ
    if env.get(ALLOW_ENV, "").strip().lower() in _TRUE:
        warnings.warn(
            f"resilient_ddp supports {req} but {problem}; importing anyway because "
            f"{ALLOW_ENV} is set. Untested: a failure may hang or be misreported.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    raise ImportError(
        f"resilient_ddp supports {req}, but {problem}. The library relies on "
        "DistributedDataParallel and torch.distributed internals that change between torch "
        "releases, and was tested only in that range. Install a supported torch: "
        f'pip install "{req}". To import it anyway (untested: a failure may hang or be '
        f"misreported), set {ALLOW_ENV}=1."
    )


# Runs when the package imports this module, before any module that uses torch's internals.
check_torch_version()
