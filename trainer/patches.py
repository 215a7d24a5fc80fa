"""Every replacement of a third-party internal, in one place (docs/design.md, Rooms).

Each `Internal` names a function the trainer puts its own in place of, the signature the
replacement relies on, and the versions it was checked against; tests/test_patches.py fails when
an installed library's signature is no longer the recorded one. To add one: an `Internal` in
REPLACED, then `replaced(...)` around the work that needs it (or `install(...)` for the process).
"""
from __future__ import annotations

import fcntl
import functools
import importlib
import inspect
import os
import shutil
import subprocess
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from trainer.log import log


@dataclass(frozen=True)
class Internal:
    """Attribute `name` of `owner` (a module, or `module:Class`), relied on as `signature`."""
    owner: str
    name: str
    signature: str  # str(inspect.signature(...)) of the library's own function
    checked: str  # the versions it was checked against

    def home(self) -> object:
        module, _, cls = self.owner.partition(":")
        home = importlib.import_module(module)
        return getattr(home, cls) if cls else home

    def library_function(self) -> Callable:
        """The library's own function, under any replacement of ours and under a decorator that
        keeps it in its closure without functools.wraps (DeepSpeed's instrument_w_nvtx)."""
        function = inspect.unwrap(getattr(self.home(), self.name))
        own = [cell.cell_contents for cell in function.__closure__ or ()
               if getattr(cell.cell_contents, "__name__", None) == self.name]
        return own[0] if own else function


RUN_NINJA_BUILD = Internal("torch.utils.cpp_extension", "_run_ninja_build",
                           "(build_directory: str, verbose: bool, error_prefix: str) -> None", "torch 2.13.0")
JIT_COMPILE = Internal("torch.utils.cpp_extension", "_jit_compile",
                       "(name, sources, extra_cflags, extra_cuda_cflags, extra_sycl_cflags, extra_ldflags, "
                       "extra_include_paths, build_directory: str, verbose: bool, with_cuda: bool | None, "
                       "with_sycl: bool | None, is_python_module, is_standalone, keep_intermediates=True) "
                       "-> module | str", "torch 2.13.0")
# also relies on agent._remaining_restarts (a restart is taken while it is above 0) and RunResult.failures
MONITOR_WORKERS = Internal("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent",
                           "_monitor_workers", "(self, worker_group: 'WorkerGroup') -> 'RunResult'", "torch 2.13.0")
# DeepSpeed's ZeRO optimizers decide an overflow inside step() (0.19.8: stage_1_and_2.step asks
# check_overflow() where check_grad_overflow is set; stage3.step asks
# _overflow_check_and_loss_scale_update(update_scale=False), then cleans up). 0.19.5's stage 3 has
# another signature: hence MIN_DEEPSPEED 0.19.8.
ZERO12_CHECK_OVERFLOW = Internal("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "check_overflow",
                                 "(self, partition_gradients=True)", "DeepSpeed 0.19.8")
ZERO3_CHECK_OVERFLOW = Internal("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3",
                                "_overflow_check_and_loss_scale_update", "(self, update_scale=True)", "DeepSpeed 0.19.8")
# made a no-op while a model is built whose values come afterwards (models/hf.py without_initialisation)
INITIALIZE_WEIGHTS = Internal("transformers:PreTrainedModel", "initialize_weights", "(self)", "transformers 5.24")
# Under unmanaged accumulation (strategy.grad_reduce=micro_step) engine.step() begins with the
# boundary work (ZeRO-2/3: finalize_gradient_accumulation_boundary); the trainer does it before,
# to take the norm, and step() must not do it twice (it is not idempotent).
ZERO12_FINALIZE = Internal("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer",
                           "finalize_gradient_accumulation_boundary", "(self)", "DeepSpeed 0.19.8")
ZERO3_FINALIZE = Internal("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3",
                          "finalize_gradient_accumulation_boundary", "(self)", "DeepSpeed 0.19.8")
# ZeRO-3's start (zero3_start_*): collectives whose values the trainer overwrites or never reads
ZERO3_INIT_PARAM = Internal("deepspeed.runtime.zero.partition_parameters:Init", "_zero_init_param", "(self, param)",
                            "DeepSpeed 0.19.8")
ZERO3_ALL_GATHER = Internal("deepspeed.runtime.zero.partition_parameters:Init", "_all_gather",
                            "(self, param_list, async_op=False, hierarchy=None)", "DeepSpeed 0.19.8")
ZERO3_GRAD_HOOKS = Internal("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3",
                            "create_reduce_and_remove_grad_hooks", "(self)", "DeepSpeed 0.19.8")
REPLACED = [RUN_NINJA_BUILD, JIT_COMPILE, MONITOR_WORKERS, ZERO12_CHECK_OVERFLOW, ZERO3_CHECK_OVERFLOW,
            ZERO12_FINALIZE, ZERO3_FINALIZE, ZERO3_INIT_PARAM, ZERO3_ALL_GATHER, ZERO3_GRAD_HOOKS,
            INITIALIZE_WEIGHTS]


def install(internal: Internal, make: Callable[[Callable], Callable], on: object = None) -> Callable:
    """Put make(original) in the internal's place (on the instance `on`, where given), once;
    returns the original."""
    home = internal.home() if on is None else on
    current = getattr(home, internal.name)
    if getattr(current, "replaces", None) == internal:
        return current.__wrapped__
    replacement = functools.wraps(current)(make(current))
    replacement.replaces = internal
    setattr(home, internal.name, replacement)
    return current


@contextmanager
def replaced(internal: Internal, make: Callable[[Callable], Callable], on: object = None) -> Iterator[None]:
    """`install` for the duration of the block; the original is back afterwards."""
    original = install(internal, make, on)
    try:
        yield
    finally:
        if on is None:
            setattr(internal.home(), internal.name, original)
        else:  # the class's own shows through again
            delattr(on, internal.name)


# DeepSpeed JIT-builds its CPU ops (shared-memory collectives at the first zero run, CPU Adam at the
# first optimizer offload) through torch's loader, into TORCH_EXTENSIONS_DIR/<op>/.
def watch_op_builds() -> None:
    """For this process: a build with work to do is said (a minute or more of silence otherwise),
    and a load never waits on a build lock whose holder is dead (`op_build_lock`)."""
    install(RUN_NINJA_BUILD, _announced)
    install(JIT_COMPILE, _locked)


def _announced(run_ninja_build: Callable) -> Callable:
    def announced(build_directory: str, verbose: bool, error_prefix: str) -> None:
        ninja = shutil.which("ninja")
        dry = subprocess.run([ninja, "-n", "-C", build_directory], capture_output=True, text=True) if ninja else None
        if dry is None or "no work to do" not in dry.stdout:  # said by the rank that builds, whichever it is
            log.warning(f"building DeepSpeed's op {Path(build_directory).name} for this environment (once: about a "
                        f"minute; cached in {build_directory})")
        run_ninja_build(build_directory, verbose, error_prefix)
    return announced


def _locked(jit_compile: Callable) -> Callable:
    parameters = inspect.signature(jit_compile)

    def locked(*args, **kwargs):
        with op_build_lock(parameters.bind(*args, **kwargs).arguments["build_directory"]):
            return jit_compile(*args, **kwargs)
    return locked


OWN_LOCK = "trainer.lock"  # beside torch's `lock` in an op's build directory
SAY_WAIT_AFTER_S = 2.0  # an op that is built already loads well within this: no line for it


@contextmanager
def op_build_lock(build_directory: str) -> Iterator[None]:
    """The op's build directory for this process alone. torch's own lock (`lock`, a FileBaton) is a
    bare file that a killed build leaves behind, and torch waits for it to go with no timeout. Ours
    is an flock on `trainer.lock`, which the kernel drops when its holder dies however it dies, and
    which records the holder's pid for the line a waiting process says. Holding it, a `lock` that no
    live process has open was left by a killed build: it is removed, with a line, and the build
    runs again (ninja redoes what the kill cut short)."""
    os.makedirs(build_directory, exist_ok=True)
    baton = os.path.join(build_directory, "lock")
    own = os.open(os.path.join(build_directory, OWN_LOCK), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _take(own, baton)
        os.ftruncate(own, 0)
        os.pwrite(own, str(os.getpid()).encode(), 0)
        _clear_stale(baton)
        yield
    finally:
        os.close(own)  # releases the flock


def _take(own: int, baton: str) -> None:
    said_at = time.monotonic() + SAY_WAIT_AFTER_S
    while True:
        try:
            fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if said_at is not None and time.monotonic() > said_at:
                holder = os.pread(own, 32, 0).decode() or "unknown"
                log.warning(f"waiting for {baton}: pid {holder} is building or loading this op")
                said_at = None
            time.sleep(0.1)


def _clear_stale(baton: str) -> None:
    """Wait while a live process outside the trainer holds torch's lock; remove it when none does.
    A process releasing it closes the file before removing it: no holder is believed on one look."""
    said, holderless = False, 0
    while os.path.exists(baton):
        holder = _opened_by(baton)
        holderless = holderless + 1 if holder is None else 0
        if holderless == 2:
            with suppress(FileNotFoundError):
                os.remove(baton)
            log.warning(f"removed {baton}, left by a killed build: no live process holds it")
            return
        if holder is not None and not said:
            log.warning(f"waiting for {baton}: pid {holder} holds it")
            said = True
        time.sleep(0.2)


def _opened_by(path: str) -> int | None:
    """A live process that has `path` open (read from /proc), or None. torch's FileBaton keeps its
    lock file open until it removes it. Without /proc (not Linux) none is seen."""
    target = os.path.realpath(path)
    with suppress(FileNotFoundError):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                            return int(pid)
    return None


@contextmanager
def decided_restarts(decide: Callable[[dict], bool] | None) -> Iterator[None]:
    """Around a launch: `decide(failures)` ({global rank: ProcessFailure}, read from the result of the
    agent's monitoring) for each failed round the agent has a restart left for; where it says no, the
    agent stops the group as it does once its restarts are used up. torch's agent restarts whatever
    failed while its one budget lasts, and only logs "Worker group FAILED"."""
    def deciding(monitor: Callable) -> Callable:
        def monitored(agent, group):
            result = monitor(agent, group)
            if decide is not None and result.is_failed() and agent._remaining_restarts > 0 and \
                    not decide(result.failures):
                agent._remaining_restarts = 0
            return result
        return monitored

    with replaced(MONITOR_WORKERS, deciding):
        yield


@contextmanager
def deepspeed_overflow(zero) -> Iterator[None]:
    """Around one engine.step(): the ZeRO optimizer `zero` finds an overflow, whatever its gradients,
    and takes its own overflow path (no update to masters, moments or step count; gradients
    cleared; an fp16 scale backed off). No public API skips a step on demand."""
    if hasattr(zero, ZERO3_CHECK_OVERFLOW.name):
        def found_in_stage3(own: Callable) -> Callable:
            def found(update_scale=True):
                zero.overflow = True
                return zero._loss_scale_update_and_overflow_cleanup() if update_scale else True
            return found

        with replaced(ZERO3_CHECK_OVERFLOW, found_in_stage3, on=zero):
            yield
        return

    def found_in_stage1_2(own: Callable) -> Callable:
        def found(partition_gradients=True):
            zero.overflow = True
        return found

    own_setting, zero.check_grad_overflow = zero.check_grad_overflow, True  # asked only where it is set
    try:
        with replaced(ZERO12_CHECK_OVERFLOW, found_in_stage1_2, on=zero):
            yield
    finally:
        zero.check_grad_overflow = own_setting


@contextmanager
def deepspeed_boundary_done(zero) -> Iterator[None]:
    """Around one engine.step() under unmanaged accumulation, after the ZeRO-2/3 optimizer `zero`
    finalized its gradients for the trainer's norm: step() does not finalize them again."""
    internal = ZERO3_FINALIZE if hasattr(zero, ZERO3_CHECK_OVERFLOW.name) else ZERO12_FINALIZE
    with replaced(internal, lambda own: lambda: None, on=zero):
        yield


@contextmanager
def zero3_start_build() -> Iterator[None]:
    """Around a model's build under zero.Init, whose every partition the strategy fills afterwards:
    each parameter is partitioned as built, without first broadcasting rank 0's whole initial
    values to every rank (DeepSpeed 0.19.8: one broadcast per parameter, the whole model sent to be
    overwritten)."""
    def unsent(own: Callable) -> Callable:
        def zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()
        return zero_init_param

    with replaced(ZERO3_INIT_PARAM, unsent):
        yield


@contextmanager
def zero3_start_hooks() -> Iterator[None]:
    """Around deepspeed.initialize of a ZeRO-3 model: its optimizer registers each parameter's
    gradient hook (register_post_accumulate_grad_hook, which needs no values) on the partitioned
    parameter. DeepSpeed 0.19.8 gathers every parameter whole first, one collective each, and
    partitions it again right after: the whole model through the network for nothing."""
    def ungathered(create_hooks: Callable) -> Callable:
        def create(self):
            with replaced(ZERO3_ALL_GATHER, lambda own: lambda *args, **kwargs: None):
                create_hooks(self)
        return create

    with replaced(ZERO3_GRAD_HOOKS, ungathered):
        yield
