"""The table of derived timings (``resilient_ddp.base._timings``): its values, its imports, and a
scan of the package that fails when a grace formula is written outside it.

The expected values are computed by hand from each config below, not by the formulas under
test.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from resilient_ddp.base import _timings as tm
from resilient_ddp.config import ResilienceConfig

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "resilient_ddp"

# default: the library's defaults (interval 0.5 s, timeout 15 s, op 60 s, store 60 s,
# diagnosis 1 s); fast: a test job's (store_timeout below the stall limit, so the stall limit
# wins); slow: long intervals and an op_timeout shorter than the heartbeat grace.
CONFIGS = {
    "default": ResilienceConfig(),
    "fast": ResilienceConfig(
        heartbeat_interval=0.2,
        heartbeat_timeout=2,
        op_timeout=3,
        store_timeout=1,
        diagnosis_timeout=0.1,
    ),
    "slow": ResilienceConfig(
        heartbeat_interval=2,
        heartbeat_timeout=30,
        op_timeout=1,
        store_timeout=120,
        diagnosis_timeout=5,
        busy_timeout=40,
    ),
}

# function -> (default, fast, slow), in seconds.
TABLE: dict[Callable[[ResilienceConfig], float], tuple[float, float, float]] = {
    tm.store_stall_limit: (15 + 1, 2 + 0.4, 30 + 4),
    tm.store_lost_limit: (60, 2.4, 120),
    tm.store_answering_window: (2, 1.4, 5),
    tm.watchdog_stop_wait: (2, 1.4, 5),
    tm.watchdog_verdict_wait: (1.5, 0.9, 4.5),
    tm.host_mates_wait: (1, 0.4, 4),
    tm.blind_spell_limit: (7.5, 1, 15),
    tm.host_mate_silence: (14, 1.6, 26),
    tm.step_beat_gap: (0.1, 0.04, 0.4),
    tm.tell_grace: (3, 2.4, 6),
    tm.diagnosis_window: (1.25, 0.65, 5),
    tm.shared_verdict_wait: (1.25 + 2, 0.65 + 1.4, 5 + 5),
    tm.failure_check_slice: (0.25, 0.2, 0.25),
    tm.data_plane_recheck: (0.5, 0.2, 2),
    tm.shrink_recovery_budget: (180 + 15, 9 + 2, 3 + 30),
    tm.late_proposer_grace: (1.5, 0.9, 1),
    tm.shrink_decider_wait: (1.5 + 2, 0.9 + 1.4, 1 + 5),
    tm.rendezvous_form_timeout: (15, 2, 2),
    tm.inference_thread_join_wait: (61, 3.4, 121),
    tm.inference_finish_poll: (0.1, 0.1, 0.1),
}


@pytest.mark.parametrize("fn", list(TABLE), ids=lambda f: f.__name__)
@pytest.mark.parametrize("which", range(3), ids=list(CONFIGS))
def test_each_timing_has_its_value_on_each_config(
    fn: Callable[[ResilienceConfig], float], which: int
) -> None:
    cfg = list(CONFIGS.values())[which]
    got = fn(cfg)
    assert isinstance(got, float)
    assert got == pytest.approx(TABLE[fn][which], abs=1e-9)


@pytest.mark.parametrize(
    ("which", "window_s", "idle_s", "expected"),
    [
        ("default", 3.0, 1.0, 2.5),  # idleness reaches the window in 2 s, then one interval
        ("default", 3.0, 10.0, 0.5),  # already past the window: never sooner than a beat
        ("fast", 3.0, 2.9, 0.3),
        ("slow", 40.0, 0.0, 42.0),
    ],
)
def test_stuck_recheck_delay(which: str, window_s: float, idle_s: float, expected: float) -> None:
    got = tm.stuck_recheck_delay(CONFIGS[which], window_s, idle_s)
    assert got == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("which", "learned_s", "expected"),
    [("default", 3.0, 3.0), ("default", 4000.0, 1800.0), ("slow", 50.0, 40.0)],
)
def test_op_stuck_window_is_capped_by_busy_timeout(
    which: str, learned_s: float, expected: float
) -> None:
    assert tm.op_stuck_window(CONFIGS[which], learned_s) == pytest.approx(expected)


def test_doctor_run_limit() -> None:
    assert tm.doctor_run_limit(300, 60) == 300 + 240 + 120
    assert tm.doctor_run_limit(10, 2.5) == 10 + 10 + 120


def test_every_timing_of_the_table_is_tested() -> None:
    """A timing added to the table without a row here fails (its value is unchecked)."""
    public = {
        name
        for name, value in vars(tm).items()
        if callable(value) and not name.startswith("_") and value.__module__ == tm.__name__
    }
    tested = {f.__name__ for f in TABLE} | {
        "stuck_recheck_delay",
        "op_stuck_window",
        "doctor_run_limit",
    }
    assert public == tested


def test_the_table_imports_only_the_config() -> None:
    """The table is in the ground layer: it imports the config, nothing else of ours, and
    no third-party module."""
    tree = ast.parse((PACKAGE / "base" / "_timings.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported == {"__future__", "resilient_ddp.config"}


# -- the scan: no grace formula outside the table ---------------------------------------------
# A timing leaf: a config duration field, or a timing the runtime keeps derived from them.
# Arithmetic on one (a multiple, a sum with a constant, a min/max with another timing) is a
# derived timing and belongs in the table. A name or ``self`` attribute assigned a bare leaf
# (``interval = cfg.heartbeat_interval.total_seconds()``) is a leaf too.
LEAVES = frozenset(
    {
        "heartbeat_interval",
        "heartbeat_timeout",
        "hb_timeout",
        "op_timeout",
        "op_budget",
        "effective_op_budget",
        "store_timeout",
        "init_timeout",
        "diagnosis_timeout",
        "busy_timeout",
        "join_startup_timeout",
        "straggler_interval",
        "base_stuck_window",
        "stall_s",
        "store_timeout_s",
    }
)

# (file, enclosing function) -> why a formula may stay there. Keep this short.
ALLOWED = {
    ("config.py", "ResilienceConfig.base_stuck_window"): (
        "the stuck window's base is a public property of the config, beside "
        "effective_op_budget, and inference.py reads it"
    ),
}


def _is_constant(node: ast.expr) -> bool:
    """A number, a module constant (``UPPER_CASE``) or arithmetic of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.Name):
        return node.id.lstrip("_").isupper()
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_").isupper()
    if isinstance(node, ast.UnaryOp):
        return _is_constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_constant(node.left) and _is_constant(node.right)
    return False


#: Operators that compute a number (``changed |= f(timeout)`` computes a flag).
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.scope: list[str] = []
        self.names: list[set[str]] = [set()]
        self.attrs = self._leaf_attributes(tree)
        self.found: list[tuple[str, int, str, str]] = []

    def _is_leaf(self, node: ast.expr) -> bool:
        """A bare timing: a leaf field or name, or its ``.total_seconds()``."""
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "total_seconds"
            and not node.args
        ):
            return self._is_leaf(node.func.value)
        if isinstance(node, ast.Attribute):
            return node.attr in LEAVES or node.attr in self.attrs
        if isinstance(node, ast.Name):
            return node.id in LEAVES or any(node.id in s for s in self.names)
        return False

    def _leaf_attributes(self, tree: ast.Module) -> set[str]:
        """``self.x = <leaf>`` anywhere in the module makes ``x`` a leaf (the watchdog's
        ``self.interval``)."""
        self.attrs = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and self._is_leaf(node.value):
                for t in node.targets:
                    if isinstance(t, ast.Attribute):
                        self.attrs.add(t.attr)
        return self.attrs

    def _mentions(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.expr) and self._is_leaf(n) for n in ast.walk(node))

    def _flag(self, node: ast.expr) -> None:
        where = ".".join(self.scope) or "<module>"
        self.found.append((self.path, node.lineno, where, ast.unparse(node)))

    def _visit_scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.names.append(set())
        self.generic_visit(node)
        self.names.pop()
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._visit_scope(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._is_leaf(node.value):
            self.names[-1] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def _arithmetic(self, node: ast.expr, left: ast.expr, right: ast.expr) -> bool:
        """Whether ``left <op> right`` derives a timing. ``clock + timing`` (a deadline)
        and ``measured - timing`` or ``count * timing`` (a measurement in seconds) do not:
        one side is a bare leaf and the other a value that is neither a timing nor a
        constant."""
        if not self._mentions(node):
            return False
        for a, b in ((left, right), (right, left)):
            if self._is_leaf(a) and not self._mentions(b) and not _is_constant(b):
                return False
        return True

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, _ARITHMETIC) and self._arithmetic(node, node.left, node.right):
            self._flag(node)
            return  # one finding per formula
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.op, _ARITHMETIC) and self._arithmetic(
            node.value, node.target, node.value
        ):
            self._flag(node.value)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # min/max of a timing with a constant or another timing: a bound or a floor.
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            timed = [a for a in node.args if self._mentions(a)]
            others = [a for a in node.args if not self._mentions(a)]
            if timed and (len(timed) > 1 or any(_is_constant(a) for a in others)):
                self._flag(node)
                return
        self.generic_visit(node)


def grace_formulas(package: Path) -> Iterator[tuple[str, int, str, str]]:
    """Every derived timing written in ``package`` outside the table and :data:`ALLOWED`:
    ``(file, line, enclosing function, expression)``."""
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "base/_timings.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        scan = _Scan(rel, tree)
        scan.visit(tree)
        for found in scan.found:
            if (found[0], found[2]) not in ALLOWED:
                yield found


def test_no_grace_formula_outside_the_timing_table() -> None:
    found = [f"{p}:{line} in {fn}: {expr}" for p, line, fn, expr in grace_formulas(PACKAGE)]
    assert not found, "derived timings outside _timings.py (add them to the table):\n" + (
        "\n".join(found)
    )


def test_every_allowed_spot_still_holds_a_formula() -> None:
    """An allow-list entry whose formula has gone (moved to the table) must go too."""
    used: set[tuple[str, str]] = set()
    for path in {p for p, _ in ALLOWED}:
        tree = ast.parse((PACKAGE / path).read_text())
        scan = _Scan(path, tree)
        scan.visit(tree)
        used |= {(p, f) for p, _, f, _ in scan.found}
    assert set(ALLOWED) <= used, set(ALLOWED) - used


_WATCHDOG = (
    "class W:\n"
    "    def __init__(self, cfg):\n"
    "        self.interval = cfg.heartbeat_interval.total_seconds()\n"
)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(cfg):\n    return 2 * cfg.heartbeat_interval.total_seconds() + 0.5\n", True),
        ("def f(rt):\n    end = time.monotonic() + 2 * rt.config.heartbeat_interval\n", True),
        ("def f(cfg):\n    i = cfg.heartbeat_interval.total_seconds()\n    return 2 * i\n", True),
        ("def f(cfg):\n    return max(2.0, min(cfg.heartbeat_timeout, cfg.op_timeout))\n", True),
        ("def f(cfg):\n    return min(cfg.heartbeat_interval.total_seconds(), _CAP_S)\n", True),
        ("class W:\n    def g(self):\n        return self.hb_timeout / 2\n", True),
        ("def f(rt):\n    rt.x += rt.config.op_timeout.total_seconds() * 3\n", True),
        # a deadline or a measurement against one bare timing is not a formula
        ("def f(cfg):\n    return time.monotonic() + cfg.op_timeout.total_seconds()\n", False),
        (
            _WATCHDOG + "    def g(self, now):\n        return now - self.last - self.interval\n",
            False,
        ),
        (
            _WATCHDOG + "    def g(self):\n        return self.hb_timeout - 2 * self.interval\n",
            True,
        ),
        ("def f(rt):\n    return rt.waits + _timings.watchdog_stop_wait(rt.config)\n", False),
        ("def f(self):\n    self.interval = self.first * 2\n", False),  # not a leaf
        ("def f(t):\n    ok = True\n    ok |= g(f'{t.heartbeat_timeout} s')\n", False),  # a flag
    ],
)
def test_the_scan_tells_formulas_from_deadlines(source: str, flagged: bool) -> None:
    tree = ast.parse(source)
    scan = _Scan("x.py", tree)
    scan.visit(tree)
    assert bool(scan.found) is flagged, scan.found
