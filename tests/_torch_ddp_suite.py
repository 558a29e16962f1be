"""Runs test cases of torch's own DDP suite inside ranks spawned by tests/test_torch_ddp_suite.py.

The cases are methods of ``DistributedTest._DistTestBase`` in the torch wheel's
``torch/testing/_internal/distributed/distributed_test.py``. torch runs each one in fresh
processes spawned by its ``MultiProcessTestCase``; importing torch and that module takes
several seconds per process here, so this adapter instead runs the selected cases one after
the other in the same two ranks, each on its own process group, the way torch's
``TestDistBackend._run`` does: ``dist.init_process_group``, a barrier, the test method, a
barrier, then the group is destroyed. With ``substitute``, ``ResilientDDP`` replaces
``DistributedDataParallel`` under the names the test module uses, and attaches to each
group on first use, as it does for a user who calls ``torch.distributed`` directly.
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import importlib.util
import os
import sys
import types
import unittest
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel

import resilient_ddp as rd

# Per case: the backend's own timeout on plain torch.distributed calls, and the op timeout
# of ResilientDDP's reductions. A rank left alone in a collective (its peer failed a check)
# then raises with its own traceback instead of waiting for gloo's 30 minutes.
CASE_TIMEOUT = timedelta(seconds=20)
# A rank still running after this long dumps its stacks and exits; shorter than the
# launcher's deadline in tests/test_torch_ddp_suite.py.
RANK_DEADLINE_S = 80


def _stand_in_for_expecttest() -> None:
    """torch's test utilities import ``expecttest`` (a torch test dependency, not ours) for
    the base of their ``TestCase``; none of the cases run here uses its ``assertExpected``.
    Without the package, a plain ``unittest.TestCase`` stands in for it."""
    if "expecttest" in sys.modules or importlib.util.find_spec("expecttest") is not None:
        return
    stand_in = types.ModuleType("expecttest")
    stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules["expecttest"] = stand_in


def _import_suite(world_size: int, temp_dir: str) -> Any:
    # The module reads these at import time (BACKEND, WORLD_SIZE) or in its file-based
    # barrier (TEMP_DIR), as set up by torch's run_test.py and TestDistBackend.setUp.
    os.environ.update(
        {
            "BACKEND": "gloo",
            "WORLD_SIZE": str(world_size),
            "TEMP_DIR": temp_dir,
            # Our report is enough; no "To execute this test, run ..." hint per failure.
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        }
    )
    _stand_in_for_expecttest()
    from torch.testing._internal.distributed import distributed_test

    return distributed_test


def _substitute(suite: Any, built: collections.Counter[str], case: list[str]) -> None:
    """Make every spelling of DDP in the test module build a ResilientDDP: the module's own
    ``DistributedDataParallel`` import, ``nn.parallel.DistributedDataParallel`` and
    ``torch.nn.parallel.DistributedDataParallel`` (one attribute of ``torch.nn.parallel``).
    resilient_ddp is imported first, so its subclass keeps the real base.

    ``built[name]`` counts the ResilientDDP models constructed while ``case[0]`` is
    ``name``: proof that the case ran ours, not torch's."""
    torch.nn.parallel.DistributedDataParallel = rd.ResilientDDP  # type: ignore[misc]
    suite.DistributedDataParallel = rd.ResilientDDP
    init = rd.ResilientDDP.__init__

    @functools.wraps(init)
    def counting_init(self: rd.ResilientDDP, *args: Any, **kwargs: Any) -> None:
        built[case[0]] += 1
        init(self, *args, **kwargs)

    rd.ResilientDDP.__init__ = counting_init  # type: ignore[method-assign]


def run_cases(
    rank: int, world_size: int, temp_dir: str, names: list[str], substitute: bool
) -> dict[str, Any]:
    """Run torch's test methods ``names`` in order on this rank.

    Returns:
        ``{"outcomes": {name: "passed" | "skipped: <reason>"}, "built": {name: count}}``,
        ``built`` counting the ResilientDDP models each case constructed (with
        ``substitute``; empty otherwise).

    Raises:
        Whatever the first failing case raised (the cases after it are not run: its peer
        may be stuck in a collective of that case). Its traceback goes to the parent.
    """
    # Before the launcher's deadline: a rank stuck anyway leaves every thread's stack.
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    # Each case gets a group and a control plane of its own under the launcher's store;
    # RESILIENT_DDP_STORE would make every case share one control plane (and see the
    # previous case's departures).
    os.environ.pop("RESILIENT_DDP_STORE", None)
    suite = _import_suite(world_size, temp_dir)
    built: collections.Counter[str] = collections.Counter()
    current = [""]
    if substitute:
        _substitute(suite, built, current)
    rd.set_config(
        rd.ResilienceConfig(
            op_timeout=CASE_TIMEOUT,
            heartbeat_interval=timedelta(milliseconds=200),
            heartbeat_timeout=timedelta(seconds=5),
        )
    )
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    class Case(suite.TestDistBackend, suite.DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        pass

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    outcomes: dict[str, str] = {}
    for i, name in enumerate(names):
        current[0] = name
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"torch_ddp_suite/{i}", store),
            rank=rank,
            world_size=world_size,
            timeout=CASE_TIMEOUT,
        )
        # As TestDistBackend._run and MultiProcessTestCase.run_test do it in each process.
        case = Case(name)
        case.rank = rank
        case.file_name = os.path.join(temp_dir, "init_dir", f"case{i}")
        common_utils.set_rng_seed()  # type: ignore[no-untyped-call]
        try:
            case._barrier()
            getattr(case, name)()
            case._barrier()
            outcomes[name] = "passed"
        except unittest.SkipTest as e:
            outcomes[name] = f"skipped: {e}"
        except SystemExit as e:
            # torch's skip decorators exit the process with a code of TEST_SKIPS.
            if not isinstance(e.code, int) or e.code not in skip_codes:
                raise
            outcomes[name] = f"skipped: {skip_codes[e.code]}"
        finally:
            rd.destroy_process_group()  # detaches the runtime too, when one is attached
    return {"outcomes": outcomes, "built": dict(built)}
