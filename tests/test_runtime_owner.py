"""Only ``Runtime``'s own methods change its state: a scan of the package for writes to a
``Runtime``'s attributes outside ``src/resilient_ddp/runtime/_runtime.py``.

A write is an assignment, an augmented assignment or a ``del`` whose target is an attribute
of a runtime (``rt.x = ...``, ``self.rt.x += ...``, ``del runtime.x``), an item of one
(``rt.left[r] = ...``), or a call that mutates one of its containers in place
(``rt.failures.append(...)``, ``rt.pending.discard(...)``). A property of ``Runtime`` with a
setter is one of its own methods: ``rt.step = n`` runs ``Runtime``'s code and is not a
write from outside.

The writes that remain are listed in ``KNOWN_WRITES`` (module, attribute), each a debt:
a new one fails this test, and so does one listed here that is gone (remove it from the
list, which only shrinks). ``docs/architecture.md`` ("Who owns what") states the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "resilient_ddp"

#: Names a module gives a runtime (a local, a parameter, or a global of ``_runtime``).
RUNTIME_NAMES = frozenset({"rt", "rt0", "_rt", "runtime"})
#: Attributes that hold a runtime (``self.rt``, ``pool.rt``, ``self._rt``).
RUNTIME_ATTRS = frozenset({"rt", "_rt", "runtime"})
#: Functions that return a runtime (``_runtime.current()``, ``ensure_runtime()``...).
RUNTIME_FACTORIES = frozenset(
    {"ensure_runtime", "_guest_runtime", "Runtime", "of_group", "of_guest"}
)
#: Methods that change a container in place.
MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "add",
        "discard",
        "update",
        "setdefault",
        "sort",
        "reverse",
        "difference_update",
        "intersection_update",
        "symmetric_difference_update",
    }
)

#: Writes to a runtime's state from outside ``_runtime.py`` that exist today:
#: (module, attribute). Each is debt: replace it by a method of ``Runtime`` and remove it
#: here; never add one.
KNOWN_WRITES: set[tuple[str, str]] = set()


def _settable_properties() -> frozenset[str]:
    """The properties of ``Runtime`` that have a setter (its own code runs on a write)."""
    tree = ast.parse((PKG / "runtime" / "_runtime.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    found = set()
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef):
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Attribute) and dec.attr == "setter":
                    found.add(fn.name)
    return frozenset(found)


def _is_runtime(node: ast.expr, names: set[str]) -> bool:
    """Whether ``node`` names a runtime: a runtime name, a runtime attribute of anything,
    or a call of a function that returns one."""
    if isinstance(node, ast.Name):
        return node.id in RUNTIME_NAMES or node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr in RUNTIME_ATTRS
    if isinstance(node, ast.Call):
        fn = node.func
        if isinstance(fn, ast.Name):
            return fn.id in RUNTIME_FACTORIES
        if isinstance(fn, ast.Attribute):
            if fn.attr == "current":
                return isinstance(fn.value, ast.Name) and fn.value.id == "_runtime"
            return fn.attr in RUNTIME_FACTORIES
    return False


def _annotated_runtime(annotation: ast.expr | None) -> bool:
    """Whether ``annotation`` is ``Runtime`` or ``Runtime | None`` (quoted or not)."""
    if annotation is None:
        return False
    text = ast.unparse(annotation).replace("'", "").replace('"', "")
    return any(part.strip() == "Runtime" for part in text.split("|"))


def _runtime_names(tree: ast.Module) -> set[str]:
    """Other names that hold a runtime in a module: annotated ``Runtime``, or assigned a
    runtime (``me = _runtime.current()``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _annotated_runtime(node.annotation):
            names.add(node.arg)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and _annotated_runtime(node.annotation)
        ):
            names.add(node.target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_runtime(node.value, names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _unpacked(node: ast.expr) -> list[ast.expr]:
    """The targets a (possibly unpacking) target writes: ``a, (b, *c)`` -> a, b, c."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return [t for elt in node.elts for t in _unpacked(elt)]
    if isinstance(node, ast.Starred):
        return _unpacked(node.value)
    return [node]


def _written(node: ast.AST) -> list[ast.expr]:
    """What the statement or expression ``node`` binds, deletes or updates."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        return [t for tgt in node.targets for t in _unpacked(tgt)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        return _unpacked(node.target)
    if isinstance(node, (ast.With, ast.AsyncWith)):
        bound = [item.optional_vars for item in node.items if item.optional_vars is not None]
        return [t for var in bound for t in _unpacked(var)]
    return []


def scan(source: str, settable: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """The writes to a runtime's attributes in ``source``, (line, attribute), sorted;
    ``settable``: the properties of ``Runtime`` with a setter (not writes from outside)."""
    tree = ast.parse(source)
    names = _runtime_names(tree)

    def container_of_runtime(node: ast.expr) -> str | None:
        """The runtime attribute that ``node`` (``rt.x``, ``rt.x[k]``) is or is in."""
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and _is_runtime(node.value, names):
            return node.attr
        return None

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = container_of_runtime(node.func.value)
            if node.func.attr in MUTATORS and attr is not None:
                found.append((node.lineno, attr))  # rt.failures.append(...)
            continue
        for target in _written(node):
            attr = container_of_runtime(target)
            if attr is not None and (isinstance(target, ast.Subscript) or attr not in settable):
                found.append((target.lineno, attr))
    return sorted(found)


def _writes() -> dict[tuple[str, str], list[int]]:
    settable = _settable_properties()
    out: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(PKG).with_suffix("").parts)
        if name == "runtime._runtime":
            continue
        for line, attr in scan(path.read_text(), settable):
            out.setdefault((name, attr), []).append(line)
    return out


def test_no_write_to_a_runtime_from_outside_its_module() -> None:
    writes = _writes()
    new = {k: v for k, v in sorted(writes.items()) if k not in KNOWN_WRITES}
    assert not new, (
        "writes to a Runtime's attributes outside _runtime.py ((module, attribute): lines); "
        f"add a method to Runtime that names the change and call it instead: {new}"
    )


def _constructions() -> list[str]:
    """Where the package makes a runtime, as ``module:line``: a call of ``Runtime(...)``,
    or of ``cls(...)`` in one of ``Runtime``'s class methods."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(PKG).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Runtime":
                found.append(f"{name}:{node.lineno}")
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime"):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and "classmethod" in map(
                    ast.unparse, fn.decorator_list
                ):
                    for node in ast.walk(fn):
                        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cls":
                            found.append(f"{name}.Runtime.{fn.name}:{node.lineno}")
    return found


def test_one_place_creates_a_runtime() -> None:
    """Runtimes come only from ``Runtime``'s named constructors (``of_group``,
    ``of_guest``), whose ``cls(...)`` calls are the only constructions."""
    made = _constructions()
    assert all(m.startswith("runtime._runtime.Runtime.of_") for m in made), made
    assert {m.split(":")[0] for m in made} == {
        "runtime._runtime.Runtime.of_group",
        "runtime._runtime.Runtime.of_guest",
    }, made


def test_the_known_writes_are_still_there() -> None:
    paid = sorted(KNOWN_WRITES - set(_writes()))
    assert not paid, f"these writes are gone: remove them from KNOWN_WRITES: {paid}"


def test_the_settable_properties_are_found() -> None:
    """The properties whose writes run ``Runtime``'s own code (and post the board)."""
    assert _settable_properties() == {"step", "phase", "in_op"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("rt.generation = 3\n", [(1, "generation")]),
        ("self.rt.watchdog_tick += 1.0\n", [(1, "watchdog_tick")]),
        ("del runtime.elastic\n", [(1, "elastic")]),
        ("_runtime.current().raised = False\n", [(1, "raised")]),
        ("ensure_runtime().seq = 0\n", [(1, "seq")]),
        ("rt.op, rt.op_seq = '', -1\n", [(1, "op"), (1, "op_seq")]),
        ("rt.left[3] = {}\n", [(1, "left")]),
        ("del pool.rt.infos[2]\n", [(1, "infos")]),
        ("rt.failures.append(ev)\n", [(1, "failures")]),
        ("self._rt.stuck.clear()\n", [(1, "stuck")]),
        # A runtime by its annotation, or assigned from one, whatever its name.
        ("def f(job: Runtime) -> None:\n    job.status = 'left'\n", [(2, "status")]),
        ("def f(job: 'Runtime | None') -> None:\n    job.status = 'left'\n", [(2, "status")]),
        ("me = _runtime.current()\nme.compute_s = 1.0\n", [(2, "compute_s")]),
        # Not flagged: a settable property (Runtime's own setter runs), a method call, a
        # read, another object's state held by the runtime, and another object.
        ("rt.step = 4\nrt.phase = 'data'\n", []),
        ("rt.enter_generation(1, 0, 2)\nrt.watchdog.poke()\n", []),
        ("n = rt.world_size\nx = rt.failures[0]\n", []),
        ("rt.elastic.members = [0, 1]\nrt.elastic_state().committed = 5\n", []),
        ("el.members = [0]\nself.failures.append(x)\nguest.call = 2\n", []),
    ],
)
def test_the_scan_flags_writes_and_only_writes(
    source: str, expected: list[tuple[int, str]]
) -> None:
    assert scan(source, frozenset({"step", "phase", "in_op"})) == expected
