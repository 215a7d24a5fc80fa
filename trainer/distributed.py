"""Process group from the launcher's environment, the device, seeding. Device choice lives here only."""
from __future__ import annotations

import atexit
import os
import random
import re
import signal
import socket
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

# DeepSpeed picks its accelerator when first imported; without CUDA it is the CPU (it would guess
# so too, with a warning). Set here, before any strategy imports deepspeed; `use_device` decides
# for a run (train.device).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds its ops into torch's extension cache, shared by every environment of a user
# by default: two venvs rebuild each other's builds (a minute each). One cache per environment.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def environment_ninja_first(environ) -> None:
    """One ninja per environment too. torch runs the first `ninja` on PATH, and ninja versions keep
    .ninja_log in formats the others do not take (1.11, a system's, writes v5; 1.13, the pip package
    DeepSpeed installs, v7): 1.13 starts a v5 log over, 1.11 finds a v7 log's commands changed, and
    either rebuilds the other's build whole (45 s for DeepSpeed's shared-memory op). `make test`'s
    setup (the venv's python, its bin/ not on PATH) and a run in the activated venv used one each.
    The environment's own ninja, where it has one, for every build."""
    scripts = sysconfig.get_path("scripts")
    if os.path.isfile(os.path.join(scripts, "ninja")) and environ.get("PATH", "").split(os.pathsep)[0] != scripts:
        environ["PATH"] = scripts + os.pathsep + environ.get("PATH", "")


environment_ninja_first(os.environ)
# The environment as this module found it (after its settings above); in a rank forked from the
# rank server (`start_rank_server`): the server's, which the elastic agent's rank variables then differ from.
_ENVIRONMENT_AT_IMPORT = dict(os.environ)
DEVICE_VARIABLE = "TRAINER_DEVICE"  # the run's device type, set once and inherited by its ranks
_own_variables: dict[str, str] = {}  # rank variables `init` set for a process alone

# Launchers that set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT themselves: torchrun,
# accelerate launch, the deepspeed launcher. Under plain `srun`, SLURM's own variables are mapped.
SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK",
                  "SLURM_NTASKS_PER_NODE": "LOCAL_WORLD_SIZE"}


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_env(environ: dict[str, str] = os.environ) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/... as a launcher gave them; empty when no launcher started us."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                        "MASTER_ADDR", "MASTER_PORT") if k in environ}
    if int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ:
        env = {torch_key: environ[slurm_key].split("(")[0] for slurm_key, torch_key in SLURM_TO_TORCH.items()
               if slurm_key in environ}
        env["MASTER_ADDR"] = environ.get("MASTER_ADDR") or first_host(environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        env["MASTER_PORT"] = environ.get("MASTER_PORT") or str(29500 + int(environ.get("SLURM_JOB_ID", "0")) % 1000)
        return env
    return {}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    match = re.match(r"([^,\[]+)(?:\[([^,\]-]+))?", nodelist)
    return match.group(1) + (match.group(2) or "")


def launched_externally() -> bool:
    return bool(launcher_env())


ROUNDS_BEFORE = "TRAINER_ROUNDS_BEFORE"  # launch_local's rounds_before, in its ranks' environment


def restart_count() -> int:
    """How often this group was started again: by torch's elastic agent (torchrun --max-restarts,
    max_restarts), after the rounds its launching process ran itself (launch_local), plus SLURM's
    requeues of the job (launch/slurm.sbatch)."""
    return sum(int(os.environ.get(name) or 0) for name in ("TORCHELASTIC_RESTART_COUNT", ROUNDS_BEFORE,
                                                           "SLURM_RESTART_COUNT"))


def launcher_rank() -> int:
    return int(launcher_env().get("RANK", "0"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type() -> str:
    """cuda or cpu: the run's choice (train.device), else cuda whenever a GPU is visible."""
    chosen = os.environ.get(DEVICE_VARIABLE, "auto")
    if chosen == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return chosen


# Dense bf16 (= fp16) peak FLOP/s per GPU, by name (vendor figures), for MFU when train.peak_flops is not given.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s at the precision that runs; None where unknown: any CPU,
    and fp32 (whether matmuls use TF32 is a setting, and the peaks differ 8x)."""
    if device.type != "cuda" or precision == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)


def use_device(requested: str) -> str:
    """Decide the run's device type from train.device (auto|cpu|cuda), once, before any rank or
    DeepSpeed starts; the ranks inherit it. A GPU box can so run everything on the CPU."""
    from trainer.errors import ConfigError

    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda was asked for, but torch sees no CUDA device")
    os.environ[DEVICE_VARIABLE] = device_type() if requested == "auto" else requested
    os.environ["DS_ACCELERATOR"] = device_type()
    return device_type()


def pick_device(local_rank: int, local_world_size: int) -> torch.device:
    """This rank's device. On CUDA, from what the rank sees: one GPU (each task given its own by
    CUDA_VISIBLE_DEVICES or `srun --gpus-per-task=1`), or one per local rank."""
    if device_type() == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 1:
        index = 0
    elif local_rank < visible:
        index = local_rank
    else:
        raise RuntimeError(f"local rank {local_rank} of {local_world_size} sees {visible} GPUs: give each local "
                           "rank a GPU (one visible GPU per rank, or as many as the local ranks)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


RANK_TITLE = "trainer rank"  # a rank's process title begins `trainer rank R/N: `


def title_loader_worker(worker_id: int) -> None:
    """A data loader worker's own process title (the DataLoader's worker_init_fn), `trainer loader
    worker W of rank R/N: ...`: forked from its rank, it carried the rank's, so a kill meant for the
    rank, found by its title, could hit the worker."""
    import setproctitle

    title = setproctitle.getproctitle()
    if title.startswith(RANK_TITLE):
        setproctitle.setproctitle(f"trainer loader worker {worker_id} of {title.removeprefix('trainer ')}")


def init(timeout_s: float = 600) -> DistEnv:
    """Join (or, alone, create) the process group. Every run has one, world size 1 included,
    so DDP, FSDP2 and DeepSpeed all see the same kind of world. A collective that waits longer
    than `timeout_s` (a peer died or hangs) raises instead of hanging the job."""
    env = launcher_env()
    if not env:  # alone: a group of one, whose variables `shutdown` takes away again (a Hydra
        # multirun runs its next job in this process, which must not look launched by then)
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        _own_variables.update(env)
    os.environ.update(env)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world > 1:  # `ps` tells the ranks apart
        import setproctitle

        title = setproctitle.getproctitle()
        if not title.startswith(RANK_TITLE):
            setproctitle.setproctitle(f"{RANK_TITLE} {rank}/{world}: {title}")
    local_rank = int(env.get("LOCAL_RANK", rank))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(local_rank, local_world)
    if device.type == "cpu":  # OMP_NUM_THREADS, or the ranks share the cores; set, not left to OpenMP,
        # which read the variable when the process started: a forked rank's, its rank server's
        threads = os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(int(threads))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # The launcher's store (env://) under a key space of this restart round: torch's elastic
        # agent keeps one store across rounds, and a restarted group reading the dead ranks'
        # addresses from it hangs in init_process_group (seen with torchrun and nproc restarts).
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
        # On CUDA, gloo beside NCCL: FSDP2's CPU offload reduces CPU tensors (the gradient norm).
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(f"trainer/round_{restart_count()}", store), rank=rank,
                                world_size=world, timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, device)


def all_reduced(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`tensor`, reduced in place over every rank (summed by default), for use in an expression."""
    dist.all_reduce(tensor, op=op)
    return tensor


def broadcast_object(obj, src: int = 0, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def on_main(fn):
    """fn() decided once, on rank 0: its result on every rank, or its exception raised on every
    rank (none is left waiting in a collective for a rank that failed)."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = (fn(), None)
        except Exception as e:
            outcome = (None, e)
    value, error = broadcast_object(outcome)
    if error is not None:
        raise error
    return value


# Signals torch's elastic agent passes on to the ranks (then waits `shutdown_timeout` before
# SIGKILL): its defaults plus SLURM's warning signal. torchrun takes the same list as
# --signals-to-handle (launch/torchrun.sh, launch/slurm.sbatch).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


RANK_MODULES = ("trainer.training.run",)  # what every rank imports before it works


def forks_ranks() -> bool:
    """Where torch sees no GPU, local ranks are forked from the rank server. On a GPU box they are
    spawned, train.device=cpu too: the CUDA check every process makes at import
    (torch.cuda.is_available, above) poisons the children a process forks for CUDA."""
    return not torch.cuda.is_available()


def start_rank_server(modules: Sequence[str] = ()) -> None:
    """Where ranks are forked (`forks_ranks`), they are forked from one server process that imported
    RANK_MODULES and `modules` (torch, transformers, DeepSpeed: 1.5-6 s of every rank's start here)
    once, started now, beside whatever this process does next. A process that never computed is
    safe to fork (one that ran an OpenMP region is not: its forked children hang in their first one).
    The first call decides what the server imports; later calls change nothing."""
    import multiprocessing
    from multiprocessing import forkserver

    if not forks_ranks():
        return
    if forkserver._forkserver._forkserver_pid is None:  # not started yet (stop_rank_server: why private)
        atexit.register(stop_rank_server)
    multiprocessing.set_forkserver_preload([*RANK_MODULES, *modules])
    forkserver.ensure_running()


def stop_rank_server() -> None:
    """The rank server gone at once, as this process leaves. Left to find it gone, the server would
    tear its interpreter down first (0.5-0.9 s here) while holding this process's stdout, which
    whatever reads the command through a pipe (`| tee`, a subprocess) waits for. multiprocessing
    has no public way to stop its server."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()  # reaps it


def in_launchers_environment(environ: dict[str, str], fn, *args):
    """fn(*args) in the environment of the process that launched this rank, now (`environ`), with
    the rank variables torch's elastic agent set: a rank forked from the rank server found the
    server's environment, as it was when the server started."""
    rank_variables = {k: v for k, v in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(k) != v}
    wanted = {**environ, **rank_variables}
    for key in set(os.environ) - set(wanted):  # key by key: setproctitle finds no title where all went at once
        del os.environ[key]
    os.environ.update({k: v for k, v in wanted.items() if os.environ.get(k) != v})
    return fn(*args)


def launch_local(nproc: int, fn, *args, max_restarts: int = 0, shutdown_timeout_s: int = 30,
                 restart: Callable | None = None, rounds_before: int = 0) -> dict:
    """fn(*args) in `nproc` fresh local processes under torch's elastic launcher, which sets the
    rank variables for `init`, restarts all of them up to `max_restarts` times when one fails,
    and passes stop signals on to them. The rendezvous is on a fresh free port, so back-to-back
    launches (a Hydra sweep, a test suite) never clash: static (the quickest) for one round;
    with restarts torchrun --standalone's (c10d), which gives each round a store of its own (the
    static one keeps the first round's keys: seen, a restarted group hanging in
    init_process_group). `fn` must be importable (not from __main__). `restart(failures)`: asked,
    while restarts are left, whether to restart after the ranks that failed ({rank: failure}, how
    each failed); say no, and the launch ends as it does once `max_restarts` are used up.
    rounds_before: rounds of the ranks this process ran before (in itself), which `restart_count` adds."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.patches import decided_restarts

    rendezvous = ({"rdzv_backend": "c10d", "rdzv_configs": {"timeout": 120}} if max_restarts else
                  {"rdzv_backend": "static", "rdzv_configs": {"rank": 0, "timeout": 120}})
    start_rank_server()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", **rendezvous, max_restarts=max_restarts,
                          monitor_interval=0.1, signals_to_handle=SIGNALS_TO_HANDLE,
                          shutdown_timeout=shutdown_timeout_s,
                          start_method="forkserver" if forks_ranks() else "spawn")
    with decided_restarts(restart):
        environ = {**os.environ, **({ROUNDS_BEFORE: str(rounds_before)} if rounds_before else {})}
        return elastic_launch(config, in_launchers_environment)(environ, fn, *args)


def shutdown(peers_alive: bool = True) -> None:
    """Leave the group. peers_alive=False (a collective may have failed on a dead or hung peer):
    no barrier (another collective_timeout_s), and the group is not destroyed: with a gloo thread
    still stuck on that peer, destroying it can abort the process (SIGABRT) before the error
    reaches the launcher (seen once in ~20 such runs here); the process is leaving anyway."""
    if dist.is_initialized():
        if peers_alive:
            dist.barrier()
        if peers_alive or dist.get_world_size() == 1:
            dist.destroy_process_group()
    for key in _own_variables:
        os.environ.pop(key, None)
    _own_variables.clear()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_dir_resolver(default: str) -> str:
    """`hydra.run.dir`: TRAINER_RUN_DIR when the launching side already chose it; under an
    external launcher, ranks other than 0 get a scratch dir (rank 0's dir reaches them after
    the process group is up), so no rank invents a `${now:}` dir of its own."""
    if os.environ.get("TRAINER_RUN_DIR"):
        return os.environ["TRAINER_RUN_DIR"]
    if launched_externally() and launcher_rank() != 0:
        return tempfile.mkdtemp(prefix="trainer-rank-")
    return default
