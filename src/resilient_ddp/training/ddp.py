"""ResilientDDP: DistributedDataParallel whose gradient reduction cannot hang silently.

It is a subclass of :class:`torch.nn.parallel.DistributedDataParallel`: construction
arguments, ``.module``, ``no_sync()``, ``join()``, ``state_dict()`` and checkpoints behave as
DDP's. What it adds:

* every gradient bucket is reduced through a library-owned future, completed by the backend
  or failed by the watchdog; a hook on the model's outputs queues an autograd final
  callback ahead of DDP's own, which waits on those futures within the op budget and
  raises our typed error from ``loss.backward()`` (DDP's reducer would turn it into
  ``RuntimeError: Unable to cast ...``);
* the forward-pass buffer broadcast goes through the bounded :func:`broadcast`, and the
  reducer's one-time bucket layout exchange (a blocking broadcast at the forward after the
  first synchronised backward) is waited for as a bounded op too;
* construction checks, within the op budget, that parameters and the environment agree
  across ranks, and raises :class:`PreflightError` with a per-rank table otherwise;
* step and phase (forward / backward / optimizer / data) are tracked for the heartbeat, so
  a peer's error says what the culprit was doing;
* pickling, ``torch.save`` of the whole model and ``copy.deepcopy`` work as on DDP: the
  library's per-pass state is dropped and rebuilt with the reducer.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten

from resilient_ddp.base import _timings
from resilient_ddp.base._backend import nccl_version
from resilient_ddp.config import ResilienceConfig, resolve
from resilient_ddp.detection import _progress, _store_diagnosis
from resilient_ddp.errors import (
    ConfigError,
    ControlPlaneError,
    PreflightError,
    RankFailureError,
    ResilientDDPError,
    forget_frames,
    format_rank_table,
)
from resilient_ddp.group.membership import _group_users, leave_behind, release_retired
from resilient_ddp.group.process_group import ensure_runtime
from resilient_ddp.ops.collectives import Op, all_gather_object, all_reduce, broadcast
from resilient_ddp.runtime import _exit_guard, _runtime
from resilient_ddp.runtime._runtime import PendingOp, Runtime
from resilient_ddp.training import elastic
from resilient_ddp.training._elastic_protocol import ShrinkDecision

__all__ = ["ResilientDDP", "make_resilient"]

log = logging.getLogger("resilient_ddp")

_optimizer_hooks_installed = False
# The live models: an optimizer is the library's business only when it steps parameters of
# one of them (see _install_optimizer_hooks).
_live_models: weakref.WeakSet[ResilientDDP] = weakref.WeakSet()
# Bumped whenever a model registers or goes, which invalidates every cached scope.
_models_version = 0
# Per optimizer, whether it is in scope, with the models version and the number of its
# parameter groups (add_param_group) it was decided for.
_optimizer_scope: weakref.WeakKeyDictionary[Any, tuple[int, int, bool]] = (
    weakref.WeakKeyDictionary()
)
# Models whose step ended with a synchronised backward pass; the optimizer step that follows
# publishes their new step count (see ResilientDDP._rd_publish_step).
_ended_steps: weakref.WeakSet[ResilientDDP] = weakref.WeakSet()
# Attributes that belong to the process and the reducer, not to the model: never pickled,
# set afresh by ResilientDDP._rd_init_local_state (which must set every one of them).
_LOCAL_STATE = (
    "_rd_buckets",
    "_rd_inner_hook",
    "_rd_inner_state",
    "_rd_pass",
    "_rd_pass_error",
    "_rd_callback_queued",
    "_rd_compute_start",
    "_rd_bucket_sync_due",
    "_rd_bucket_thread",
    "_rd_beat_at",
    "_rd_join_work",
    "_rd_div",
    "_rd_hook_name",
)


class NoTrainableParametersError(ConfigError, RuntimeError):
    """The module given to :class:`ResilientDDP` has no parameter that requires a gradient.

    A :class:`ConfigError` (a bad argument) and, like the error torch's
    ``DistributedDataParallel`` raises there, a ``RuntimeError``.
    """


class ResilientDDP(DistributedDataParallel):
    """A drop-in :class:`~torch.nn.parallel.DistributedDataParallel` with bounded, typed
    failure handling.

    Construct it exactly like DDP (same positional and keyword arguments); the training loop
    does not change. When a peer crashes, raises, hangs or stops, ``loss.backward()`` (or
    the next collective) raises :class:`RankFailureError` on every other rank within the
    core bounds, naming the culprit, its step and phase.

    Args:
        module: The module to replicate.
        *args: DDP's positional arguments (``device_ids``, ``output_device``, ...).
        resilience: Budgets and policies; the fields given in code win, ``RESILIENT_DDP_*``
            variables fill in the others. Default: the config of the current runtime (or
            the process-wide config when this call attaches to torch's group).
        **kwargs: DDP's keyword arguments (``find_unused_parameters``, ``static_graph``,
            ``gradient_as_bucket_view``, ``broadcast_buffers``, ``bucket_cap_mb``, ...).

    Blocks while ranks compare parameters and environment (at most ``op_timeout``) and while
    DDP broadcasts rank 0's parameters.

    **Steps.** A *step* is one training step: forward and backward passes (with
    ``no_sync()``, several micro-batches) ending in a backward pass that reduces the
    gradients, then the optimizer step. Steps are numbered from 0, as ``for step, batch in
    enumerate(loader)`` numbers them: step ``N`` is the one that runs after ``N`` completed
    steps, and ``resilience_stats["step"]`` is that count. A failure report names the step
    and phase the culprit was in: ``[step 5, phase 'data', ...]`` means that it failed
    after completing steps 0 to 4, before the forward pass of step 5. Both come from the
    culprit's last heartbeat. The end of a step (its optimizer step, or else the next
    forward pass) publishes one at once, at most five times per ``heartbeat_interval``, so
    a rank that dies between steps is named in the step it was in; phase changes within a
    step wait for the regular heartbeat. The report gives the age of what it shows when it
    is not fresh (``as of 0.2 s earlier``). The count starts at construction, and a copy
    (``copy.deepcopy``, pickling) goes on from the original's count. With
    ``on_failure="shrink"`` it is the job's count of committed steps, which survivors and
    joiners share.

    **Optimizers.** The library acts on the steps of the optimizers over the model's
    parameters only (an optimizer is one of them when at least one of its parameters is a
    parameter of a live ``ResilientDDP``): their steps mark the "optimizer" and "data"
    phases and end the step, and with ``on_failure="shrink"`` their state is sent to
    survivors and joiners and a discarded step is a no-op for them, as a whole (an
    optimizer over the model and other parameters skips the step for all of them). Other
    optimizers (an EMA, a discriminator or a probe trained locally) are left alone.

    **Copies.** ``copy.deepcopy(model)``, ``pickle`` and ``torch.save(model)`` /
    ``torch.load(..., weights_only=False)`` behave as on DDP: the default process group is
    required, and the copy gets a new reducer on the default group of the process that
    loads it. A comm hook registered with :meth:`register_comm_hook` is not carried over
    (DDP's reducer holds it); register it again on the copy.

    **Comm hooks and join.** :meth:`register_comm_hook` and ``_register_builtin_comm_hook``
    check, refuse and log as DDP's do (the same exception types and messages, the same
    ``_get_ddp_logging_data()``); the hooks run inside the library's own, so their waits are
    bounded and fail when a peer fails. ``join(divide_by_initial_world_size=False)`` divides
    the gradients by the ranks that have not joined, as DDP does without a hook.

    **torch.compile.** ``torch.compile(model)`` compiles the wrapped module as it does under
    DDP; the library's bookkeeping runs outside dynamo's tracing (no more graph breaks than
    DDP's). With ``on_failure="shrink"`` or inside ``distributed_inference`` the forward
    pass runs uncompiled.

    Raises:
        PreflightError: Parameter names, shapes or dtypes, the backend, the torch/CUDA/NCCL
            versions differ across ranks, or two ranks of one host use the same GPU.
        RankFailureError: A rank failed during construction.
        ConfigError: The module has no parameter that requires a gradient (also a
            ``RuntimeError``, as DDP's error there), or a ``process_group`` of your own with
            ``on_failure="shrink"``.
    """

    # -- construction ------------------------------------------------------------------------
    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        resilience: ResilienceConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if not any(p.requires_grad for p in module.parameters()):
            # DDP raises a bare RuntimeError here (torch's own DDP tests expect one): ours
            # is a ConfigError that code written for DDP still catches.
            raise NoTrainableParametersError(
                f"ResilientDDP, as DistributedDataParallel, needs a module with a parameter "
                f"that requires a gradient; {type(module).__name__} has none (run a module "
                f"that does not train without the wrapper, e.g. with rd.distributed_inference)."
            )
        rt = ensure_runtime(resilience)
        # Fields given in code win; RESILIENT_DDP_* variables fill in the others.
        self._rd_config = resolve(resilience) if resilience is not None else rt.config
        group = kwargs.get("process_group")
        el = rt.elastic
        if el is not None and group is not None:
            raise ConfigError(
                "on_failure='shrink' rebuilds the default process group after a failure; "
                "ResilientDDP cannot follow a process_group of your own there."
            )
        self._rd_args, self._rd_kwargs = args, dict(kwargs)
        received = el.received if el is not None else None
        joiner = False
        if el is not None and received is not None and "model" in received:
            joiner = True
            # A joiner: the members sent their state when they admitted it; they do not
            # take part in construction-time checks or DDP's initial broadcast.
            module.load_state_dict(received.pop("model"))
            kwargs["init_sync"] = False
            el.pending_optim = received.pop("optim", None)
        try:
            if not joiner:
                _check_agreement(rt, self._rd_config, module, args, kwargs, group)
            # DDP's initial sync (a shape check, then rank 0's parameters and buffers
            # broadcast) runs over the process group directly: a rank that died there left
            # the others with a raw gloo error naming nobody, or waiting without end. The
            # shapes were just checked (_check_agreement); the state goes through our
            # bounded broadcast below, which names a rank that fails.
            own_sync = bool(kwargs.get("init_sync", True))
            kwargs["init_sync"] = False
            # Buffers are broadcast in forward by our bounded broadcast (see
            # _default_broadcast_coalesced), so DDP keeps its own switch.
            super().__init__(module, *args, **kwargs)
            if own_sync:
                self._rd_sync_initial_state(buffers=kwargs.get("forward_sync_buffers") is not None)
        except RankFailureError as e:
            if el is not None:
                # No recovery before training began: the job is over. A replacement
                # waiting to join (rd.spawn's restarts) gives up at once, saying why,
                # instead of waiting out init_timeout for an admission nobody makes.
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                elastic._mark_ended(
                    rt.control_root, el, f"a rank failed while ResilientDDP was built: {first}"
                )
            raise
        self.compute_times: list[float] = []
        self._rd_steps = 0  # steps completed (see "Steps" in the class docstring)
        self._rd_init_local_state()
        if rt.step < 0:
            rt.step = self._rd_step_count(rt)

    def _rd_sync_initial_state(self, *, buffers: bool) -> None:
        """DDP's initial sync, bounded: the parameters (and buffers, when DDP syncs them
        at construction) of the group's first rank, sent to every rank by
        :func:`broadcast`, one op per dtype and bucket (``broadcast_bucket_size``).

        Args:
            buffers: Buffers are synced whatever ``broadcast_buffers`` says (DDP does so
                when ``forward_sync_buffers`` is given).

        Raises:
            RankFailureError: A rank failed meanwhile (the ranks that failed are named).
            CollectiveTimeoutError: A rank did not take part within the op's budget.
        """
        ignore = self.parameters_to_ignore
        states = [p.detach() for n, p in self.module.named_parameters() if n not in ignore]
        sync_buffers = getattr(
            self, "forward_sync_buffers", getattr(self, "broadcast_buffers", True)
        )
        if buffers or sync_buffers:
            states += [b.detach() for n, b in self.module.named_buffers() if n not in ignore]
        # In buckets of DDP's broadcast_bucket_size, as DDP does: a flat copy of a whole
        # large model would double its memory for a moment.
        limit = max(1, int(self.broadcast_bucket_size))
        bucket: list[torch.Tensor] = []
        size = 0
        for t in states:
            if bucket and size + t.numel() * t.element_size() > limit:
                self._default_broadcast_coalesced(bucket, authoritative_rank=0)
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket:
            self._default_broadcast_coalesced(bucket, authoritative_rank=0)

    def _rd_init_local_state(self) -> None:
        """Set up what belongs to this process and to the reducer rather than to the model
        (futures, threads, the comm hook that refers back to this object), at construction
        and when a copy is unpickled (as DDP rebuilds its reducer there)."""
        self._rd_buckets: list[tuple[torch.futures.Future[torch.Tensor], list[Any], Any]] = []
        self._rd_inner_hook: Callable[..., Any] | None = None
        self._rd_inner_state: Any = None
        self._rd_pass: list[tuple[Op, PendingOp, Any]] = []
        self._rd_pass_error: BaseException | None = None
        self._rd_callback_queued = False
        self._rd_compute_start = 0.0
        self._rd_bucket_sync_due = False
        self._rd_bucket_thread: threading.Thread | None = None
        self._rd_beat_at = 0.0  # time.monotonic() of the last step-boundary heartbeat
        self._rd_join_work: Any = None  # this forward pass's join notification
        self._rd_div: int | None = None  # this pass's divide factor (_rd_divide_factor)
        self._rd_hook_name: str | None = None  # the user's comm hook, as DDP's logs name it
        self._rd_register_own_hook()
        _keep_out_of_dynamo()
        _install_optimizer_hooks()
        _register_model(self)
        _group_users.add(self)  # its reducer holds its group (see release_retired)

    def __del__(self) -> None:
        """Let the reducer and DDP's logger go before the process group.

        Left to the interpreter, the attributes go in the order DDP set them: the process
        group first, then the reducer, whose C++ destructor then drops the last reference
        to the group with the GIL held. ``~ProcessGroupGloo`` joins its worker thread, and
        a worker finishing a late op needs the GIL to free a tensor that Python saw: the
        process froze when the function holding the model returned (about 1 run in 10 of
        the slow-rank inference test, native stacks in the closing note of issue 18). The
        reducer going first drops a reference that is not the last; the group then goes
        through its Python handle, which releases the GIL while it waits for its threads.
        """
        try:
            self._rd_release_stuck_reducer()
            for name in ("logger", "reducer"):
                self.__dict__.pop(name, None)
        except Exception:  # noqa: BLE001 - a half-built model has nothing to release
            pass

    @property
    def _rd_group(self) -> dist.ProcessGroup | None:
        """The group for our collectives: ``None`` for the default (world) group, which
        a group retry may rebuild."""
        return self.process_group if self.process_group is not dist.group.WORLD else None

    # -- copies (pickle, torch.save, copy.deepcopy) ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The picklable state: DDP's (without process group, reducer and logger), less
        what :meth:`_rd_init_local_state` rebuilds.

        Raises:
            RuntimeError: The model does not use the default process group (as DDP).
        """
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        for name in _LOCAL_STATE:
            state.pop(name, None)
        # DDP's list of hooks holds ours, whose state (a weak reference to this object)
        # cannot be pickled; _rd_init_local_state registers it again on the new reducer.
        state["_comm_hooks"] = [(h, s) for h, s in state["_comm_hooks"] if h is not _resilient_hook]
        # The default group (the only one DDP pickles with) is the loading process's own.
        state["_rd_kwargs"] = {k: v for k, v in self._rd_kwargs.items() if k != "process_group"}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled model on the default group of this process: DDP builds a new
        reducer; the library's per-process state starts afresh. Communicates with no one (the
        runtime attaches at the first collective if this process has none yet)."""
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._rd_init_local_state()

    # -- forward -----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        bypass = _dynamo_bypass
        if bypass is not None and torch.compiler.is_compiling():
            # Under torch.compile: one call that dynamo does not trace runs the forward
            # pass, so that the library's bookkeeping breaks no graph; the wrapped module's
            # own forward is still compiled, as under DDP (see _keep_out_of_dynamo).
            run, before, after = bypass
            return run(self, inputs, kwargs, before, after)
        return _forward(self, inputs, kwargs, ResilientDDP._rd_before, ResilientDDP._rd_after)

    def _rd_before(self, inputs: Any, kwargs: Any) -> tuple[bool, Any]:
        """The library's part of a forward pass before DDP's.

        Returns:
            ``(True, output)`` when the pass is done (elastic training, local forward
            passes), else ``(False, join_config)``: the join configuration to run DDP's
            forward under (``None``: the model's own).
        """
        rt = _runtime.current()
        if rt is not None and rt.elastic is not None and not rt.local_forward:
            return True, self._rd_elastic_forward(rt, inputs, kwargs)
        if rt is not None:
            # A known failure makes the step fail now, not in its first collective.
            rt.raise_if_failed("forward", rt.seq + 1)
            if rt.local_forward:
                # distributed_inference: ranks run different numbers of forwards, so DDP's
                # per-forward buffer broadcast would pair up unrelated calls.
                return True, self._rd_local_forward(inputs, kwargs)
            rt.phase = "forward"
            self._rd_publish_step(rt)
        join_config = self._rd_notify_join()
        if rt is not None:
            self._rd_sync_buckets()
            self._rd_compute_start = time.monotonic()
        return False, join_config

    def _rd_after(self, output: Any) -> Any:
        """The library's part of a forward pass after DDP's."""
        if getattr(self, "device_type", "") == "cuda":
            # A progress signal: the watchdog counts completed events (never waits).
            _progress.cuda_progress.record()
        return self._rd_watch_backward(output)

    def _rd_notify_join(self) -> Any:
        """Tell a ``join()`` context that this rank has not joined, as DDP's forward does,
        and keep the count of such ranks that it returns (see :meth:`_rd_divide_factor`).

        DDP hands that count to its reducer, which divides the gradients by it under
        ``join(divide_by_initial_world_size=False)``; with the library's comm hook the
        reducer divides nothing, so the hook does. Done before the bucket layout exchange,
        in DDP's order (a joined rank's join hook counts first, then rebuilds).

        Returns:
            The join configuration for DDP's forward (the notification already sent), or
            ``None`` when there is nothing to take over.
        """
        self._rd_div = None
        config = self._join_config
        if (
            not config.enable
            or not config.is_first_joinable
            or getattr(self, "_use_python_reducer", False)
            or getattr(self, "_delay_all_reduce_all_params", False)
        ):
            self._rd_join_work = None
            return None
        self._rd_join_work = Join.notify_join_context(self)
        return config._replace(is_first_joinable=False)

    def _rd_divide_factor(self, op: Op) -> int:
        """What DDP's reducer divides gradients by when it has no comm hook: the world
        size, or under ``join(divide_by_initial_world_size=False)`` the number of ranks that
        have not joined, which the forward pass's join notification counts (waited for
        within ``op``'s bounds, where DDP waits without a bound).

        Raises:
            RankFailureError: A peer failed before the count completed.
            CollectiveTimeoutError: The count did not complete within the op budget.
        """
        div = self._rd_div
        if div is None:
            work, self._rd_join_work = self._rd_join_work, None
            if work is None or getattr(self, "_divide_by_initial_world_size", True):
                div = dist.get_world_size(op.group)
            else:
                op.wait(work, cuda=self.join_device.type == "cuda")
                div = int(work.get_future().value()[0].item())
            self._rd_div = div
        return div

    def _rd_local_forward(self, inputs: Any, kwargs: Any) -> Any:
        """The wrapped module's forward without DDP's synchronisation (no reducer hooks);
        inputs still move to the device as DDP would move them."""
        if self.device_ids:
            moved, moved_kwargs = self.to_kwargs(  # type: ignore[no-untyped-call]
                inputs, kwargs, self.device_ids[0]
            )
            inputs, kwargs = moved[0], moved_kwargs[0]
        return self.module(*inputs, **kwargs)

    def _rd_sync_buckets(self) -> None:
        """Run the reducer's one-time bucket rebuild as a bounded op, when it is due.

        After the first synchronised backward of a reducer, DDP's next forward rebuilds the
        gradient buckets in the order gradients became ready and agrees on the layout with
        two blocking broadcasts from rank 0, bounded only by the backend's timeout: a peer
        that dies there surfaces as gloo's bare ``RuntimeError``, one that stops hangs the
        step. Here the rebuild runs in a helper thread (the call releases the GIL) and is
        waited for like any other op; DDP's own call that follows finds nothing to do.

        Raises:
            RankFailureError: A peer failed meanwhile.
            CollectiveTimeoutError: The exchange did not complete within the op budget.
        """
        if not self._rd_bucket_sync_due or not torch.is_grad_enabled():
            return
        self._rd_bucket_sync_due = False
        timeout, budget = self._rd_config.op_bounds()
        op = Op(
            "ddp_bucket_layout",
            group=self._rd_group,
            timeout=timeout,
            budget=budget,
            retry=1,
            validate=False,
        )
        reducer = self.reducer
        done: torch.futures.Future[bool] = torch.futures.Future()

        def rebuild() -> None:
            try:
                done.set_result(reducer._rebuild_buckets())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)  # type: ignore[arg-type]  # stubs: the value type

        def body() -> None:
            p = op.track(done)
            worker = threading.Thread(target=rebuild, name="resilient_ddp-buckets", daemon=True)
            self._rd_bucket_thread = worker
            worker.start()
            try:
                op.wait_pending(p, done)
            except BaseException:
                if worker.is_alive():
                    # Left behind inside the backend until its own timeout: the process
                    # must not run the backend's destructors at exit.
                    _exit_guard.arm_exit_guard()
                raise

        op.run(body, signature=dict)
        if done.value():
            self._has_rebuilt_buckets = True

    def _default_broadcast_coalesced(
        self,
        bufs: list[torch.Tensor] | None = None,
        bucket_size: int | None = None,
        authoritative_rank: int = 0,
    ) -> None:
        """DDP's buffer broadcast, through the bounded :func:`broadcast` (one op per dtype).

        ``authoritative_rank`` is the sender's rank in DDP's process group, as DDP passes
        it (``process_group.rank()`` terms), not its global rank.
        """
        tensors = list(self.modules_buffers) if bufs is None else list(bufs)
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        group = self._rd_group
        src = authoritative_rank
        if group is not None:
            src = dist.get_global_rank(group, authoritative_rank)
        timeout, budget = self._rd_config.op_bounds()
        for same in by_dtype.values():
            flat = _flatten(same)
            broadcast(
                flat,
                src=src,
                group=group,
                timeout=timeout,
                budget=budget,
                validate=False,
            )
            for t, synced in zip(same, _unflatten(flat, same), strict=True):
                t.copy_(synced)
        # Waiting for the others in this broadcast is not this rank's compute: start the
        # straggler clock after it (under DDP a slow rank makes everyone wait here).
        self._rd_compute_start = time.monotonic()

    # -- backward: the comm hook (see _resilient_hook) and the wait at its end ---------------
    def _rd_watch_backward(self, output: Any) -> Any:
        if torch.is_grad_enabled():
            self._rd_callback_queued = False
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._rd_on_backward_start)  # type: ignore[no-untyped-call]
        return output

    def _rd_on_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._rd_callback_queued:
            self._rd_callback_queued = True
            rt = _runtime.current()
            if rt is not None:
                rt.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._rd_finish_backward)
        return grad

    def _rd_register_own_hook(self) -> None:
        """Register the library's comm hook on the reducer, directly: DDP's
        ``register_comm_hook`` would report it in ``_get_ddp_logging_data()`` and in
        ``_comm_hooks``, which show the user's hook, as on DDP."""
        # A weak reference: DDP's reducer holds the hook's state, and a strong one would
        # keep this model alive through its own reducer.
        dist._register_comm_hook(self.reducer, weakref.ref(self), _resilient_hook)

    def _rd_logger(self) -> dist.Logger:
        logger = self.logger
        if logger is None:
            raise AssertionError("self.logger must not be None")  # DDP's own check
        return logger

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a DDP communication hook, exactly as on DDP; it runs inside the
        library's own.

        The same checks, errors and logging data as
        :meth:`DistributedDataParallel.register_comm_hook`: ``_get_ddp_logging_data()
        ["comm_hook"]`` is the hook's ``__qualname__`` and ``_comm_hooks`` lists it. Your
        ``hook(state, bucket)`` still returns a future; ResilientDDP bounds the wait on it
        and fails it when a peer fails. Call at most once, before the first backward.

        Raises:
            TypeError: ``hook`` is not callable, or is the bf16 hook where the backend
                cannot run it (DDP's checks and messages).
            ValueError: ``hook``'s annotations are not DDP's signature.
            RuntimeError: A hook was already registered (the reducer's own error).
        """
        self._check_comm_hook(hook)  # type: ignore[no-untyped-call]
        self._rd_hook_name = hook.__qualname__
        self._rd_logger()._set_comm_hook_name(self._rd_hook_name)
        self._comm_hooks.append((hook, state))
        if self._rd_inner_hook is not None:
            # The reducer holds the library's hook: it refuses another with DDP's error.
            self._rd_register_own_hook()
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        self._rd_inner_hook = hook
        self._rd_inner_state = state

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """Register one of DDP's built-in C++ hooks, as its Python equivalent inside the
        library's bounded reduction (the same arithmetic: the same gradients, bitwise).

        ``dist.BuiltinCommHookType.ALLREDUCE`` runs ``default_hooks.allreduce_hook``,
        ``FP16_COMPRESS`` ``default_hooks.fp16_compress_hook``; the logging data names the
        built-in type, as on DDP.

        Raises:
            TypeError: ``comm_hook_type`` is not a ``BuiltinCommHookType`` (as on DDP).
            RuntimeError: A hook was already registered (the reducer's own error).
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self._rd_hook_name = str(comm_hook_type)
        self._rd_logger()._set_comm_hook_name(self._rd_hook_name)
        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        hook = (
            builtin.get(comm_hook_type)
            if type(comm_hook_type) is type(dist.BuiltinCommHookType.ALLREDUCE)
            else None
        )
        if self._rd_inner_hook is not None or hook is None:
            # The reducer raises DDP's error: a hook is registered (the library's), or
            # comm_hook_type is not a built-in type.
            dist._register_builtin_comm_hook(self.reducer, comm_hook_type)
            raise RuntimeError(
                "register_builtin_comm_hook or register_comm_hook can only be called once."
            )
        # The C++ hooks reduce over the reducer's group: the default group, whatever
        # generation it is in (None), or the model's own.
        self._rd_inner_hook = hook
        self._rd_inner_state = self._rd_group

    def _rd_finish_backward(self) -> None:
        """Autograd final callback, queued ahead of DDP's: wait (bounded) for every bucket
        reduced in this backward pass and raise our typed error if one failed."""
        ops, self._rd_pass = self._rd_pass, []
        error, self._rd_pass_error = self._rd_pass_error, None
        rt = _runtime.current()
        if rt is not None:
            self.compute_times = [
                *self.compute_times[-19:],
                time.monotonic() - self._rd_compute_start,
            ]
            rt.set_compute_time(sorted(self.compute_times)[len(self.compute_times) // 2])
        rest = ops  # not waited for (yet)
        try:
            if error is not None:
                raise error
            for i, (op, p, keep) in enumerate(ops):
                rest = ops[i + 1 :]
                op.wait_pending(p, keep)
        except RankFailureError as e:
            rest = _forget_ops(rest)
            if rt is None or rt.elastic is None or isinstance(e, ControlPlaneError):
                raise
            # The pass's bucket ops end together (the runtime has one in-op flag), through
            # the runtime rather than Op.end: a pass may have no Op (none of its buckets
            # reduced, or the first one's Op could not begin).
            rt.end_op()
            self._rd_recover_in_backward(rt, e)
        else:
            if rt is not None and rt.elastic is not None and self._rd_buckets:
                self._rd_buckets = []
                rt.elastic.commit(rt.elastic.members)
        finally:
            _forget_ops(rest)
            if rt is not None:
                rt.end_op()
                rt.phase = "after_backward"
        if ops:
            # The step ends here; its new number is published at the optimizer step that
            # follows (that step still belongs to this one), or at the next forward pass.
            self._rd_steps += 1
            _ended_steps.add(self)
        if (
            ops
            and not self._has_rebuilt_buckets
            and (self.static_graph or not self.find_unused_parameters)
        ):
            # DDP rebuilds its buckets at the next forward (see _rd_sync_buckets).
            self._rd_bucket_sync_due = True

    # -- elastic training (on_failure="shrink") ----------------------------------------------
    def _rd_elastic_forward(self, rt: Runtime, inputs: Any, kwargs: Any) -> Any:
        el = rt.elastic_state()
        el.skip_step = False
        while True:
            try:
                if (el.join_seen or el.grow is not None) and elastic.maybe_admit(
                    rt, el, self._rd_snapshot
                ):
                    el.rebuild = True
                if el.rebuild:
                    self._rd_rebuild_reducer()
                rt.raise_if_failed("forward", rt.seq + 1)
                rt.phase = "forward"
                self._rd_publish_step(rt)
                self._rd_sync_buckets()
                self._rd_compute_start = time.monotonic()
                output = DistributedDataParallel.forward(self, *inputs, **kwargs)  # type: ignore[no-untyped-call]
                return self._rd_watch_backward(output)
            except RankFailureError as e:
                if isinstance(e, ControlPlaneError):
                    raise
                cause: RankFailureError = e
            dec = self._rd_recover(rt, "forward", False, cause)
            if dec.outcome == "continue":
                continue  # this step goes on, on the new group
            # Discarded on every survivor: compute locally, the optimizer step is skipped.
            el.skip_step = True
            el.rollback()
            return self._rd_local_forward(inputs, kwargs)

    def _rd_recover(
        self, rt: Runtime, where: str, has_grads: bool, cause: RankFailureError
    ) -> ShrinkDecision:
        """Run the elastic recovery with this model's state; the reducer is rebuilt at the
        next forward (never inside the backward pass that failed)."""
        dec = elastic.recover(
            rt,
            where=where,
            has_grads=has_grads,
            cause=cause,
            snapshot=self._rd_snapshot,
            load=self._rd_load,
        )
        rt.elastic_state().rebuild = True
        # Recovered: the failure's frames hold the old generation's works and reducer,
        # which must go with its group, not whenever the garbage collector runs.
        forget_frames(cause)
        # A skipped step's backward still runs through the old reducer's hooks.
        self._rd_release_stuck_reducer()
        return dec

    def _rd_recover_in_backward(self, rt: Runtime, cause: RankFailureError) -> None:
        """A reduction of this backward pass failed with ``on_failure="shrink"``: recover,
        then settle every bucket's future (redone over the survivors, or discarded)."""
        el = rt.elastic_state()
        buckets, self._rd_buckets = self._rd_buckets, []
        has_grads = not self.gradient_as_bucket_view and self._rd_inner_hook is None
        while True:
            dec = self._rd_recover(rt, "reduce", has_grads, cause)
            if dec.outcome != "redo":
                break
            try:
                redone = [self._rd_redo(params) for _, params, _ in buckets]
            except RankFailureError as e:
                if isinstance(e, ControlPlaneError):
                    raise
                cause = e
                continue
            for (fut, _, _), flat in zip(buckets, redone, strict=True):
                _settle(fut, flat)
            el.commit(el.members)
            return
        # Skipped: DDP copies these zeros into the gradients, and the optimizer step that
        # follows is turned into a no-op (see _install_optimizer_hooks).
        for fut, _, like in buckets:
            _settle(fut, torch.zeros_like(like))
        el.skip_step = True
        el.rollback()

    def _rd_redo(self, params: list[Any]) -> torch.Tensor:
        """This rank's local gradients of one bucket, averaged over the new group."""
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        cfg = self._rd_config
        all_reduce(flat, timeout=cfg.op_timeout, validate=False)
        return flat.div_(dist.get_world_size())

    def _rd_rebuild_reducer(self) -> None:
        """Rebuild DDP's reducer in place on the current default group: the
        object, ``.module`` and the optimizer stay; states already agree, so no sync."""
        self._rd_release_stuck_reducer()
        # What DDP reports about the user's hook (which _rd_inner_hook still holds). Not
        # read from the old logger: a call into it here froze the rebuild (ranks stuck in
        # recovery for good in the elastic fault matrix); the name is kept on the side.
        hooks = self._comm_hooks
        hook_name = self._rd_hook_name
        for name in ("reducer", "logger"):
            if hasattr(self, name):
                delattr(self, name)
        kwargs = dict(self._rd_kwargs)
        kwargs["init_sync"] = False
        DistributedDataParallel.__init__(self, self.module, *self._rd_args, **kwargs)
        self._rd_bucket_sync_due = False
        self._rd_register_own_hook()
        self._comm_hooks = hooks
        if hook_name is not None:
            self._rd_logger()._set_comm_hook_name(hook_name)
        rt = _runtime.current()
        if rt is not None and rt.elastic is not None:
            rt.elastic.rebuild = False
        # The group the old reducer held (retired by the rebuild) can go now.
        release_retired()

    def _rd_release_stuck_reducer(self) -> None:
        """Let go of a reducer whose bucket exchange is still stuck in the backend.

        That exchange holds the reducer's mutex until the backend's timeout: destructing
        the reducer or DDP's logger would wait for it with the GIL held (the process
        freezes), and so would the reducer's autograd hooks in the next backward pass. So
        its hooks are taken off the parameters (what its destructor would do) and the
        objects are kept (the exit guard is armed) until the exchange ends, then released
        with the retired groups (:func:`membership.leave_behind`).
        """
        worker, self._rd_bucket_thread = self._rd_bucket_thread, None
        if worker is not None and worker.is_alive():
            self.reducer._remove_autograd_hooks()
            leave_behind(self.process_group, self.reducer, getattr(self, "logger", None), worker)

    def _rd_snapshot(self) -> dict[str, Any]:
        """What a survivor or joiner takes over from the state source."""
        rt = _runtime.current()
        assert rt is not None
        assert rt.elastic is not None
        el = rt.elastic
        return {
            "model": self.module.state_dict(),
            "optim": [o.state_dict() for o in elastic.live(el.optimizers)],
            "committed": el.committed,
            "samplers": [s.state_dict() for s in el.live_samplers()],
            "extras": {k: v.state_dict() for k, v in el.extras.items()},
            "history": el.history,
        }

    def _rd_load(self, state: dict[str, Any]) -> None:
        rt = _runtime.current()
        assert rt is not None
        assert rt.elastic is not None
        el = rt.elastic
        self.module.load_state_dict(state["model"])
        optimizers = elastic.live(el.optimizers)
        if optimizers and len(optimizers) == len(state["optim"]):
            for o, sd in zip(optimizers, state["optim"], strict=True):
                o.load_state_dict(sd)
        else:
            el.pending_optim = list(state["optim"])  # loaded when they first step
        el.committed = int(state["committed"])
        for smp, sd in zip(el.live_samplers(), state["samplers"], strict=False):
            smp.load_state_dict(sd)
        for k, sd in state["extras"].items():
            if k in el.extras:
                el.extras[k].load_state_dict(sd)

    def register_elastic_state(self, name: str, obj: Any) -> None:
        """Send ``obj``'s state (``state_dict()`` / ``load_state_dict()``, e.g. an LR
        scheduler or a step counter of yours) with the model to survivors that take the
        state over and to joiners, under ``name``. A no-op without ``on_failure="shrink"``.

        Raises:
            ConfigError: ``obj`` has no ``state_dict``/``load_state_dict``.
        """
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"{name!r}: {obj!r} has no state_dict()/load_state_dict()")
        rt = _runtime.current()
        if rt is None or rt.elastic is None:
            return
        rt.elastic.extras[name] = obj
        received = rt.elastic.received
        if received is not None and name in received.get("extras", {}):
            obj.load_state_dict(received["extras"].pop(name))

    # -- optimizer phases: step numbering (see _install_optimizer_hooks) ---------------------
    def _rd_step_count(self, rt: Runtime) -> int:
        """Steps completed so far: this model's count, or with ``on_failure="shrink"`` the
        job's committed steps (which survivors and joiners share)."""
        return int(rt.elastic.committed) if rt.elastic is not None else self._rd_steps

    def _rd_publish_step(self, rt: Runtime) -> None:
        """Show the current step in the heartbeat; a new one is published ahead of the
        regular beat, so that a rank dying early in a step is named in that step."""
        _ended_steps.discard(self)
        step = self._rd_step_count(rt)
        if rt.step == step:
            return
        rt.step = step
        now = time.monotonic()
        gap = _timings.step_beat_gap(rt.config)
        if rt.watchdog is not None and now - self._rd_beat_at >= gap:
            self._rd_beat_at = now
            rt.watchdog.poke()

    # -- reports -----------------------------------------------------------------------------
    def straggler_report(self) -> dict[str, Any]:
        """Every rank's median step compute time (forward + backward, before waiting on the
        gradient reduction) and the ranks slower than the group median by more than
        ``straggler_margin``.

        Returns:
            ``{"median_s": float, "compute_s": {rank: seconds}, "stragglers": [rank, ...]}``.
            Reads the heartbeats (one store round trip); never raises for a slow rank.
        """
        rt = _runtime.current()
        if rt is None:
            return {"median_s": 0.0, "compute_s": {}, "stragglers": []}
        return _store_diagnosis.straggler_report(rt, rt.control)

    @property
    def resilience_stats(self) -> dict[str, Any]:
        """What happened to this job so far, as seen by this rank.

        Returns:
            ``{"rank", "world_size", "generation", "step", "failures", "joins",
            "redone_steps", "skipped_steps", "recovery_s", "events", "world_size_history"}``:
            ``step`` is the number of completed steps, which is also the number of the
            step in progress (see "Steps" in the class docstring; with
            ``on_failure="shrink"``, the job's committed steps), ``events`` one
            record per shrink or join (culprits, outcome, timings) and, in a process that
            joined a running job, an ``"admitted"`` record (``requested_t``: when it asked,
            ``time.time()``; ``waited_s``: from asking to admitted with the state),
            ``recovery_s`` the recovery time of each shrink in seconds. Without
            ``on_failure="shrink"`` only rank, world size, generation and step are filled
            in.
        """
        rt = _runtime.current()
        out: dict[str, Any] = {
            "rank": rt.rank if rt else -1,
            "world_size": rt.world_size if rt else 0,
            "generation": rt.generation if rt else -1,
            "step": self._rd_step_count(rt) if rt else self._rd_steps,
            "failures": 0,
            "joins": 0,
            "redone_steps": 0,
            "skipped_steps": 0,
            "recovery_s": [],
            "events": [],
            "world_size_history": [],
        }
        if rt is None or rt.elastic is None:
            return out
        el = rt.elastic
        shrinks = [e for e in el.events if e["kind"] == "shrink"]
        out.update(
            failures=len(shrinks),
            joins=sum(1 for e in el.events if e["kind"] == "join"),
            redone_steps=el.redone,
            skipped_steps=el.skipped,
            recovery_s=[e["recovery_s"] for e in shrinks],
            events=[dict(e) for e in el.events],
            world_size_history=[(h["step"], h["world_size"]) for h in el.history],
        )
        return out

    @property
    def resilience(self) -> ResilienceConfig:
        """The config this model runs under."""
        return self._rd_config


# -- taking over a DDP that a framework built --------------------------------------------------
def make_resilient(
    model: DistributedDataParallel,
    *,
    resilience: ResilienceConfig | None = None,
    bound_torch_collectives: bool = True,
) -> ResilientDDP:
    """Turn a :class:`~torch.nn.parallel.DistributedDataParallel` that a framework built
    (Accelerate's ``prepare``, the Hugging Face ``Trainer``, code of your own) into a
    :class:`ResilientDDP`, in place.

    The object stays the same (``make_resilient(m) is m``), so the framework's references
    to it (its list of models, its optimizer wrappers) stay valid; from the call on it has
    every guarantee of a :class:`ResilientDDP` built directly: bounded, typed bucket
    reductions in ``backward()``, a bounded buffer broadcast in ``forward()``, the step and
    phase in the heartbeat. Like :class:`ResilientDDP`'s constructor it checks, within the
    op budget, that parameters and environment agree across ranks (DDP had already
    broadcast rank 0's parameters). Call it on every rank at the same point, before a
    forward pass or between steps. A model that already is a :class:`ResilientDDP` is
    returned as it is.

    Args:
        model: The DDP model (exactly ``DistributedDataParallel``; subclasses are refused).
        resilience: Budgets and policies, as for :class:`ResilientDDP`.
        bound_torch_collectives: Also route ``torch.distributed``'s blocking collectives
            through the library (see :func:`bound_torch_collectives`), so that the
            framework's own ``all_reduce``, ``barrier`` or ``all_gather`` (metric syncs,
            ``gather`` for evaluation) end with the library's typed error too.

    Returns:
        ``model``, now a :class:`ResilientDDP`.

    Blocks while ranks compare parameters and environment (at most ``op_timeout``).

    Raises:
        ConfigError: ``model`` is not a ``DistributedDataParallel``, is a subclass of it,
            already has a communication hook, is in the middle of a backward pass, or the
            configuration asks for ``on_failure="shrink"`` (not supported for a model
            built by a framework: the framework's samplers and world size would not follow).
        PreflightError: As for :class:`ResilientDDP`.
        RankFailureError: A rank failed during the check.
    """
    if isinstance(model, ResilientDDP):
        return model
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"make_resilient takes a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(model).__name__}. HINT: call it on what the framework returns once it "
            "wrapped the model for distributed training (e.g. accelerator.prepare(model)); "
            "a model that is not wrapped yet can be wrapped with ResilientDDP directly."
        )
    if type(model) is not DistributedDataParallel:
        raise ConfigError(
            f"make_resilient takes DistributedDataParallel itself, not the subclass "
            f"{type(model).__qualname__}: its overrides could not be kept. HINT: build "
            "ResilientDDP instead, or make your subclass derive from ResilientDDP."
        )
    if _in_backward():
        raise ConfigError(
            "make_resilient was called during a backward pass. HINT: call it before the "
            "first forward pass or between steps (after optimizer.step())."
        )
    hook_name = model._get_ddp_logging_data().get("comm_hook", "")  # type: ignore[no-untyped-call]
    if model._comm_hooks or hook_name:
        raise ConfigError(
            f"make_resilient: the model already has a communication hook "
            f"({hook_name or model._comm_hooks[0][0]}); DDP's reducer takes one hook only, "
            "and the library needs its own. HINT: call make_resilient first, then "
            "register_comm_hook or _register_builtin_comm_hook (ResilientDDP's run inside "
            "the library's own)."
        )
    rt = ensure_runtime(resilience)
    config = resolve(resilience) if resilience is not None else rt.config
    if rt.elastic is not None or config.on_failure == "shrink":
        raise ConfigError(
            "make_resilient does not support on_failure='shrink': a framework keeps its own "
            "world size, samplers and process group, which the library could not rebuild "
            "after a failure. HINT: use on_failure='raise' (the default) and let the "
            "launcher restart the job from a checkpoint."
        )
    group = model.process_group if model.process_group is not dist.group.WORLD else None
    kwargs: dict[str, Any] = {
        "device_ids": model.device_ids,
        "output_device": model.output_device,
        "dim": model.dim,
        "find_unused_parameters": model.find_unused_parameters,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
    }
    if group is not None:
        kwargs["process_group"] = group
    _check_agreement(rt, config, model.module, (), kwargs, group)
    model.__class__ = ResilientDDP
    adopted: ResilientDDP = model  # type: ignore[assignment]  # its class was just changed
    adopted._rd_config = config
    adopted._rd_args, adopted._rd_kwargs = (), kwargs
    adopted.compute_times = []
    adopted._rd_steps = 0
    adopted._rd_init_local_state()
    if rt.step < 0:
        rt.step = adopted._rd_step_count(rt)
    if bound_torch_collectives:
        from resilient_ddp.ops.torch_collectives import bound_torch_collectives as bound

        bound()
    return adopted


def _forward(
    model: ResilientDDP,
    inputs: Any,
    kwargs: Any,
    before: Callable[[ResilientDDP, Any, Any], tuple[bool, Any]],
    after: Callable[[ResilientDDP, Any], Any],
) -> Any:
    """ResilientDDP's forward pass: the library's part (``before``, ``after``) around DDP's.

    ``before`` and ``after`` are :meth:`ResilientDDP._rd_before` and
    :meth:`ResilientDDP._rd_after`, or under ``torch.compile`` the same methods hidden from
    dynamo (see :func:`_keep_out_of_dynamo`).
    """
    done, value = before(model, inputs, kwargs)
    if done:
        return value
    saved = model._join_config
    if value is not None:
        # The join notification was sent (see _rd_notify_join): DDP's must not be.
        model._join_config = value
    try:
        output = DistributedDataParallel.forward(model, *inputs, **kwargs)  # type: ignore[no-untyped-call]
    finally:
        model._join_config = saved
    return after(model, output)


# Under torch.compile, ResilientDDP.forward calls _forward through a wrapper that dynamo does
# not trace, with the library's methods hidden from it (set by _keep_out_of_dynamo).
_dynamo_bypass: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None


def _keep_out_of_dynamo() -> None:
    """Keep the library's forward-pass bookkeeping out of what dynamo traces (once per
    process; DDP's constructor has imported dynamo by then).

    Traced, each clock read, lock, thread-local and future of the library is a graph break
    (19 over three steps of a small MLP, against DDP's 3). So the compiled forward calls
    :func:`_forward`, whose frame dynamo skips (what it calls is still traced, the wrapped
    module's forward included, as under DDP), and the library's methods that it or DDP's
    forward calls (before and after DDP's part, the buffer broadcast) run with dynamo off.

    ``_forward`` is marked with dynamo's ``skip`` (its code is skipped at no cost per call)
    where torch has it; ``torch.compiler.disable(recursive=False)`` does the same, but runs
    dynamo's frame conversion on every call (measured: +0.6 ms per forward and +2 ms per
    backward pass of a 0.26 M-parameter MLP, against +0.1 ms and none with ``skip``).
    """
    global _dynamo_bypass
    if _dynamo_bypass is not None:
        return
    hide = torch.compiler.disable
    skip = getattr(getattr(torch._dynamo, "decorators", None), "skip", None)
    run = skip(_forward) if skip is not None else hide(_forward, recursive=False)  # type: ignore[no-untyped-call]
    broadcast_buffers = ResilientDDP.__dict__["_default_broadcast_coalesced"]
    type.__setattr__(ResilientDDP, "_default_broadcast_coalesced", hide(broadcast_buffers))  # type: ignore[no-untyped-call]
    _dynamo_bypass = (
        run,
        hide(ResilientDDP._rd_before),  # type: ignore[no-untyped-call]
        hide(ResilientDDP._rd_after),  # type: ignore[no-untyped-call]
    )


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (autograd's current graph task)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and int(task_id()) != -1


# -- construction-time agreement ---------------------------------------------------------------
def _param_table(module: nn.Module) -> list[tuple[str, str, str]]:
    rows = [(n, str(tuple(p.shape)), str(p.dtype)) for n, p in module.named_parameters()]
    rows += [(n, str(tuple(b.shape)), str(b.dtype)) for n, b in module.named_buffers()]
    return rows


def _device_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    ids = kwargs.get("device_ids", args[0] if args else None)
    p = next(module.parameters(), None)
    dev = str(p.device) if p is not None else "cpu"
    if ids:
        dev = str(torch.device("cuda", ids[0]) if isinstance(ids[0], int) else ids[0])
    return dev


def _environment(rt: Runtime, module: nn.Module, args: Any, kwargs: Any) -> dict[str, str]:
    device = _device_of(module, args, kwargs)
    gpu = ""
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        gpu = str(getattr(props, "uuid", idx))
    return {
        "host": rt.identity["host"],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": nccl_version(),
        "python": platform.python_version(),
        "backend": rt.backend,
        "device": device,
        "gpu": gpu,
    }


def _check_agreement(
    rt: Runtime, cfg: ResilienceConfig, module: nn.Module, args: Any, kwargs: Any, group: Any
) -> None:
    params = _param_table(module)
    timeout, budget = cfg.op_bounds()
    digest = hashlib.blake2b(repr(params).encode(), digest_size=8).hexdigest()
    mine = {"env": _environment(rt, module, args, kwargs), "digest": digest, "params": params}
    rows = all_gather_object(mine, group=group, timeout=timeout, budget=budget, validate=False)
    problems: list[str] = []
    table: dict[int, dict[str, str]] = {}
    for r, row in enumerate(rows):
        table[r] = {**row["env"], "params": f"{len(row['params'])} tensors #{row['digest']}"}
    for key in ("torch", "cuda", "nccl", "python", "backend"):
        values = {r: row["env"][key] for r, row in enumerate(rows)}
        if len(set(values.values())) > 1:
            problems.append(
                f"{key} differs: " + ", ".join(f"rank {r}: {v}" for r, v in values.items())
            )
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and a job that puts
    # them there meant one GPU each. Gloo moves CUDA tensors through the host, so ranks
    # sharing a GPU is legal there (a workstation with one GPU).
    users: dict[tuple[str, str], int] = {}
    for r, row in enumerate(rows):
        env = row["env"]
        if env["device"].startswith("cuda") and "nccl" in env["backend"]:
            gpu = (env["host"], env["gpu"] or env["device"])
            if gpu in users:
                problems.append(
                    f"ranks {users[gpu]} and {r} both use {env['device']} on host {env['host']}"
                    " (set device_ids=[local_rank] and torch.cuda.set_device(local_rank))"
                )
            users.setdefault(gpu, r)
    ref = rows[0]
    for r, row in enumerate(rows[1:], start=1):
        if row["digest"] != ref["digest"]:
            problems.append(f"rank {r}: " + _param_diff(ref["params"], row["params"]))
    if problems:
        text = "\n".join(f"  - {p}" for p in problems)
        raise PreflightError(
            f"ResilientDDP: ranks disagree before training (rank {rt.rank} sees):\n{text}\n"
            + _format_rows(table),
            problems=problems,
            table=table,
        )


def _param_diff(ref: list[Any], other: list[Any]) -> str:
    a = {n: (s, d) for n, s, d in ref}
    b = {n: (s, d) for n, s, d in other}
    for name, (shape, dtype) in a.items():
        if name not in b:
            return f"has no parameter/buffer {name!r} (rank 0 has {shape} {dtype})"
        if (shape, dtype) != b[name]:
            return f"{name!r} is {b[name][0]} {b[name][1]}, rank 0 has {shape} {dtype}"
    extra = [n for n in b if n not in a]
    return f"has extra parameter/buffer(s) {extra[:3]} that rank 0 does not"


def _format_rows(table: dict[int, dict[str, str]]) -> str:
    cols = ["host", "device", "gpu", "backend", "torch", "cuda", "nccl", "python", "params"]
    return format_rank_table(table, cols)


# -- forward: the buffer broadcast -------------------------------------------------------------
def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


# -- backward: the comm hook -------------------------------------------------------------------
def _resilient_hook(
    state: weakref.ReferenceType[ResilientDDP], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The comm hook DDP calls for each ready bucket: issue the reduction (through the
    user's hook if any) behind a library-owned future."""
    ddp = state()
    assert ddp is not None
    tensor = bucket.buffer()
    shadow = _shadowing(ddp)
    if not ddp._rd_callback_queued and not shadow:
        # A backward pass that did not start from an output of ours (the model was made
        # resilient between its forward and backward passes, or the outputs were detached
        # and re-attached): wait at its end all the same, and raise there what fails below.
        ddp._rd_on_backward_start(tensor)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[tensor.device] if tensor.device.type == "cuda" else None
    )
    rt0 = _runtime.current()
    elastic_mode = rt0 is not None and rt0.elastic is not None
    if elastic_mode:
        # Kept to settle the future after a recovery: the bucket's parameters (whose .grad
        # still holds this rank's local gradients) and a tensor of its size.
        ddp._rd_buckets.append((result, bucket.parameters(), tensor))
    try:
        timeout, budget = ddp._rd_config.op_bounds()
        op = Op(
            f"ddp_bucket{bucket.index()}",
            group=ddp._rd_group,
            timeout=timeout,
            budget=budget,
            retry=1,
            validate=False,
        )
    except ResilientDDPError as e:
        return _fail_bucket(ddp, result, e, elastic_mode)
    try:
        inner, keep, pick = _issue(ddp, op, bucket, shadow)
    except ResilientDDPError as e:
        return _fail_bucket(ddp, result, e, elastic_mode)
    except BaseException:
        _abandon_pass(ddp, op)
        raise
    if not isinstance(inner, torch._C.Future):
        # DDP's reducer raises its own error for what the user's hook returned
        # ("... must return a torch.futures.Future object, but got ...").
        _abandon_pass(ddp, op)
        return inner  # type: ignore[no-any-return]
    p = op.track(cast(Any, inner), future=result, result_fn=pick, hold=elastic_mode)
    if not shadow:
        ddp._rd_pass.append((op, p, keep))
    else:
        # No backward pass of ours to wait in: a joined rank shadowing the others'
        # reductions (DDP's join), which waits on the future itself. The watchdog still
        # fails it when a peer fails.
        inner.add_done_callback(lambda _: _settle_shadow(op, p))
    return result


def _shadowing(ddp: ResilientDDP) -> bool:
    """Whether the comm hook was called outside a backward pass: a joined rank shadowing
    the others' reductions (DDP's join calls the reducer's hook directly)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        return not ddp._rd_callback_queued
    return int(task_id()) == -1


def _issue(
    ddp: ResilientDDP, op: Op, bucket: dist.GradBucket, shadow: bool
) -> tuple[Any, Any, Any]:
    """Issue one bucket's reduction: DDP's own averaging, or the user's hook.

    Returns:
        The future it completes (whatever the user's hook returned), what to keep of it
        (see :meth:`Op.forget`), and the function that maps its value to the gradients.

    Raises:
        RankFailureError: A peer failed before the join count completed.
        CollectiveTimeoutError: The join count did not complete within the op budget.
    """
    if ddp._rd_inner_hook is not None:
        inner = ddp._rd_inner_hook(ddp._rd_inner_state, bucket)
        return inner, inner, _value
    tensor = bucket.buffer()
    # As DDP's reducer does without a hook: scale by 1 / its divide factor, then sum. A
    # joined rank's shadow reduction (no pass of ours) sums zeros.
    div = dist.get_world_size(op.group) if shadow else ddp._rd_divide_factor(op)
    tensor.mul_(1.0 / div)
    work = dist.all_reduce(tensor, group=op.group, async_op=True)
    return work.get_future(), work, _first


def _value(v: Any) -> Any:
    return v


def _first(v: Any) -> Any:
    return v[0]


def _fail_bucket(
    ddp: ResilientDDP,
    result: torch.futures.Future[torch.Tensor],
    error: ResilientDDPError,
    elastic_mode: bool,
) -> torch.futures.Future[torch.Tensor]:
    """A bucket's reduction could not be issued: the pass's final callback raises
    ``error``; its future fails too (elastic training settles it after a recovery)."""
    ddp._rd_pass_error = error
    if not elastic_mode:
        result.set_exception(error)  # type: ignore[arg-type]  # stubs: Tensor; any exception works
    return result


# DDP checks a hook's annotations with inspect; under `from __future__ import annotations`
# they are strings, so give it the objects.
_resilient_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _abandon_pass(ddp: ResilientDDP, op: Op) -> None:
    """The user's comm hook failed (it raised, or returned something other than a
    future): the backward pass ends with that error, without the final callback. Let the
    pass's ops go, so that the next pass starts clean."""
    ddp._rd_pass = _forget_ops(ddp._rd_pass)
    ddp._rd_pass_error = None
    ddp._rd_callback_queued = False
    op.end()


def _forget_ops(ops: list[tuple[Op, PendingOp, Any]]) -> list[Any]:
    """Unregister the ops of a backward pass that failed before they were waited for.

    Otherwise each failed pass left its later buckets' ops registered for good (one per
    kill-and-rejoin cycle in the generation-leak test), each holding its bucket's future
    and the value it was settled with. Their works are kept as a failed wait keeps its own
    (``Runtime.stuck``): released with their group once it is retired.

    Returns:
        An empty list (nothing left to forget).
    """
    for op, p, keep in ops:
        op.forget(p, keep)
    return []


def _settle_shadow(op: Op, p: PendingOp) -> None:
    """A joined rank's shadow reduction completed: let its pending op go and end the op
    (its work completed; the watchdog no longer needs to fail it)."""
    op.untrack(p)
    op.end()


# -- elastic training --------------------------------------------------------------------------
def _settle(fut: torch.futures.Future[torch.Tensor], value: torch.Tensor) -> None:
    """Complete a bucket's future with ``value`` (or overwrite the value it completed with)."""
    if fut.done():
        fut.value().copy_(value)
    else:
        fut.set_result(value)


# -- phases from the optimizer -----------------------------------------------------------------
def _register_model(model: ResilientDDP) -> None:
    """Count ``model``'s parameters in the optimizer hooks' scope while it lives."""
    global _models_version
    if model in _live_models:
        return
    _live_models.add(model)
    _models_version += 1
    weakref.finalize(model, _model_gone).atexit = False


def _model_gone() -> None:
    global _models_version
    _models_version += 1


def _in_scope(opt: Any) -> bool:
    """Whether ``opt`` steps at least one parameter of a live :class:`ResilientDDP`.

    Decided once per optimizer and cached (a dictionary lookup per step); decided again
    when a model registers or goes, or when the optimizer's number of parameter groups
    changes (``add_param_group``). An optimizer over the model's parameters and others
    (a head, a loss-scale parameter) is in scope as a whole.
    """
    groups = getattr(opt, "param_groups", ())
    cached = _optimizer_scope.get(opt)
    if cached is not None and cached[0] == _models_version and cached[1] == len(groups):
        return cached[2]
    version = _models_version
    ours_ids = {id(p) for m in list(_live_models) for p in m.parameters()}
    ours = any(id(p) in ours_ids for g in groups for p in g["params"])
    _optimizer_scope[opt] = (version, len(groups), ours)
    return ours


def _install_optimizer_hooks() -> None:
    """Install the global optimizer step hooks (once per process), which act only on the
    optimizers over a live model's parameters (see :func:`_in_scope`).

    For such an optimizer, the pre-step hook marks the "optimizer" phase and, with
    ``on_failure="shrink"``, runs :func:`_elastic_pre_step`; the post-step hook marks the
    "data" phase and publishes the step count of the models whose step just ended. Any
    other optimizer (an EMA, a discriminator trained locally, a probe) is left alone: its
    steps mark no phase, its state is not sent to survivors or joiners, and a discarded
    step does not touch its gradients.
    """
    global _optimizer_hooks_installed
    if _optimizer_hooks_installed:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        rt = _runtime.current()
        if rt is not None and _in_scope(opt):
            rt.phase = "optimizer"
            if rt.elastic is not None:
                _elastic_pre_step(rt.elastic, opt)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        rt = _runtime.current()
        if rt is not None and _in_scope(opt):
            rt.phase = "data"
            for model in list(_ended_steps):
                model._rd_publish_step(rt)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    _optimizer_hooks_installed = True


def _elastic_pre_step(el: Any, opt: Any) -> None:
    """Prepare a step of ``opt``, an optimizer over the model's parameters (see
    :func:`_in_scope`), with ``on_failure="shrink"``.

    Tracks it (its state moves with the model to survivors and joiners), loads the state
    received for it, and turns a discarded step into a no-op: optimizers skip parameters
    without a gradient, so neither parameters nor their state change. The whole step is
    skipped, including the parameters of ``opt`` outside the model, whose gradients came
    from the discarded step too.
    """
    optimizers = elastic.live(el.optimizers)
    if not any(o is opt for o in optimizers):
        el.optimizers.append(weakref.ref(opt))
        optimizers.append(opt)
    index = next(i for i, o in enumerate(optimizers) if o is opt)
    pending = el.pending_optim
    if pending is not None and index < len(pending) and pending[index] is not None:
        opt.load_state_dict(pending[index])
        pending[index] = None
    if el.world_changes:
        # After the state load: what a listener sets (a learning rate) applies to this step.
        el.deliver_world_changes()
    if el.skip_step:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
