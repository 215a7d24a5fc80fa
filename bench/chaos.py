"""Chaos, counted: kill a training job again and again at random (seeded) moments, restart it
under the next strategy and world size each time, and check that nothing was lost.

    python bench/chaos.py --kills 20 [--seed 0] [--mode mixture|dpo|both] [--out DIR] [--json FILE]

The job: a tiny Qwen2 built from its config (no download, no weights file) with LoRA adapters
(peft=lora), trained in fp32 on a mixture of three sources (an hf text source, a chat source and
a tokens file, data=mixture) whose epochs are a few steps long; `--mode dpo` trains it with
objective=dpo on preference pairs against a precomputed reference (objective.precompute_ref,
whose cache is cleared before every start, so that every start computes it again); `both`
alternates the two, a run each. A run starts under fsdp at 2 ranks and every restart takes the
next of fsdp@2, zero2@2, zero3@1, ddp@2 (the global batch stays: 2 ranks x 4 rows, or 1 rank x
4 rows x 2 accumulated), resuming from the newest checkpoint in the run's checkpoint.dir.

Each start is killed once, one of three ways: SIGKILL of one rank (`rank`; at 1 rank the only
one), SIGKILL of the whole job, launcher and ranks (`job`), or SIGTERM to the launcher or one
rank (`term`: the ranks stop at the next step boundary and save). When is chosen at random
from the run's own evidence as it goes: its step records (metrics.jsonl), its log (trainer.log)
and its checkpoint dir, read every few milliseconds: a random moment of training, just after
the record of a step that saves (the save follows its record), just after the last step of an
epoch, during the reference's precompute (dpo), or during the start. Where each kill landed is
then decided from what was seen at the moment of the signal, not from what was aimed at:
  - save: a `.tmp-step_N` dir made by this start was in the checkpoint dir (a save in flight);
  - precompute: the precompute's log line was written and its table not yet (dpo);
  - epoch_change: the step in flight was the first of a new epoch (the last record was the last
    step of an epoch in the uninterrupted run), outside a save;
  - startup: no step recorded yet by this start, outside the precompute;
  - final: after the last step's record (its save, the run's end, the ranks leaving);
  - step: during a training step otherwise.
  - async_write: the step dir of a step before the last recorded one was still being written
    (checkpoint.async=true's background writer; never so while saves block training). Run it
    with `--override checkpoint.async=true --write-delay 1`: a tiny model's save is written in
    milliseconds, so the writer holds each step dir 1 s longer (bench/slow_writer) for kills to land in.

After each kill: the job must be gone within --exit-timeout s (else: a hang, counted and
killed), no process of it left behind (alive --exit-timeout s after its launcher left; one alive
2 s after it but gone by then is a slow exit, named and counted apart), and every step dir of the checkpoint dir intact
(`python -m trainer.verify CKPT_DIR`: its main, in this process). At the end of each run: every
step record of every start has the loss of the uninterrupted run (fsdp at 2 ranks) at that step
within --rtol, and the steps 1..N are all there. The report: kills by kind and by phase, resumes,
the largest relative loss difference, the time each kill cost (the run's wall time less the
uninterrupted run's, per kill; and the restart: from the signal to the next start's first step).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CYCLE = [("fsdp", 2), ("zero2", 2), ("zero3", 1), ("ddp", 2)]  # start i runs CYCLE[i % 4]
KINDS = ("rank", "job", "term")
PHASES = ("startup", "precompute", "step", "save", "epoch_change", "final", "async_write")
ROWS = 4  # per rank per micro-batch; 2 ranks x 4, or 1 rank x 4 x 2 accumulated: a global batch of 8
PRECOMPUTE_LINE = "objective.precompute_ref: the reference's log-probs"


# -- the job --------------------------------------------------------------------------------------------

def make_data(root: Path) -> dict[str, Path]:
    """The tokenizer (ChatML, 512 tokens), the model folder (config.json only) and the data."""
    import numpy as np
    from transformers import AutoTokenizer

    from trainer.demo import (
        conversations,
        documents,
        make_model_dir,
        preference_pairs,
        train_chat_tokenizer,
        write_jsonl,
        write_rows,
    )

    paths = {"tokenizer": root / "tokenizer", "model": root / "qwen2", "text": root / "licenses.jsonl",
             "chat": root / "chat.jsonl", "tokens": root / "web.bin", "pairs": root / "pairs.jsonl",
             "cache": root / "cache"}
    if paths["pairs"].is_file():  # the last written: made before
        return paths
    root.mkdir(parents=True, exist_ok=True)
    texts = documents()
    train_chat_tokenizer(paths["tokenizer"], texts)
    make_model_dir(paths["model"], "qwen2", weights=False)
    write_jsonl(paths["text"], texts[:300])
    write_rows(paths["chat"], conversations(texts, n=120))
    tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))
    ids = [i for text in texts[300:] for i in tok(text)["input_ids"] + [tok.eos_token_id]]
    np.asarray(ids, dtype=np.uint16).tofile(paths["tokens"])
    write_rows(paths["pairs"], preference_pairs(texts, n=48))
    return paths


def overrides(mode: str, data: dict[str, Path], strategy: str, world: int, steps: int, ckpt: Path,
              every: int) -> list[str]:
    common = [f"nproc={world}", f"strategy={strategy}", "model=hf", f"model.path={data['model']}", "model.seq_len=64",
              "peft=lora", "peft.r=4", "peft.alpha=8", f"train.max_steps={steps}", "train.log_every=1",
              f"train.micro_batch_size={ROWS}", f"train.grad_accum_steps={2 // world}", "data.num_workers=0",
              f"data.tokenizer={data['tokenizer']}", f"data.cache_dir={data['cache']}", "train.precision=fp32",
              f"checkpoint.dir={ckpt}", f"checkpoint.every_steps={every}", "checkpoint.keep_last=3",
              "collective_timeout_s=60", "shutdown_timeout_s=10"]
    if mode == "dpo":
        return common + ["objective=dpo", "objective.precompute_ref=true", "data=preference",
                         f"data.path={data['pairs']}", "optim.lr=1e-2"]
    sources = (f"[{{kind:hf,path:{data['text']},weight:0.5,name:text}},"
               f"{{kind:chat,path:{data['chat']},weight:0.3,name:chat}},"
               f"{{kind:tokens,path:{data['tokens']},weight:0.2,name:web}}]")
    return common + ["data=mixture", f"data.sources={sources}", "data.epoch_samples=48", "optim.lr=1e-2"]


def clear_reference_cache(data: dict[str, Path]) -> None:
    """dpo: the precomputed reference's table gone, so that the next start computes it again."""
    shutil.rmtree(data["cache"] / "reference", ignore_errors=True)


# -- one start, watched -------------------------------------------------------------------------------------

def read_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The whole lines of `path` after `offset`, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode().splitlines(), offset + end


@dataclass
class Start:
    """One launch of the trainer CLI in its own session (process group), and what it recorded."""
    index: int
    strategy: str
    world: int
    run_dir: Path
    ckpt: Path
    process: subprocess.Popen
    began: float
    records: list[tuple[float, dict]] = field(default_factory=list)  # (when seen, record)
    events: list[dict] = field(default_factory=list)
    precompute_seen: float | None = None
    wall_began: float = 0.0  # time.time() at the launch: a .tmp-step_N dir made since is this start's
    _offsets: list[int] = field(default_factory=lambda: [0, 0])

    def poll(self) -> None:
        lines, self._offsets[0] = read_lines(self.run_dir / "metrics.jsonl", self._offsets[0])
        now = time.monotonic()
        for line in lines:
            row = json.loads(line)
            if "event" in row:
                self.events.append(row)
            elif "split" not in row:
                self.records.append((now, row))
        if self.precompute_seen is None:
            log, self._offsets[1] = read_lines(self.run_dir / "trainer.log", self._offsets[1])
            if any(PRECOMPUTE_LINE in line for line in log):
                self.precompute_seen = now

    @property
    def last_step(self) -> int | None:
        return self.records[-1][1]["step"] if self.records else None

    def saves_in_flight(self) -> list[str]:
        """The `.tmp-step_N` dirs this start made (a save in flight; an older one is a dead start's)."""
        try:
            return [p.name for p in self.ckpt.glob(".tmp-step_*") if p.stat().st_ctime >= self.wall_began]
        except FileNotFoundError:  # renamed as it was looked at: the save just completed
            return []

    def in_flight_async(self, saves: list[str]) -> bool:
        """checkpoint.async=true: a background write in flight, the step dir of a step before the last
        recorded one still being written (a save in the step blocks training: never so without it)."""
        return self.last_step is not None and any(int(name.rsplit("_", 1)[1]) < self.last_step for name in saves)

    def ranks(self) -> list:
        import psutil

        try:
            return sorted((p for p in psutil.Process(self.process.pid).children(recursive=True)
                           if " ".join(p.cmdline()).startswith("trainer rank")), key=lambda p: p.pid)
        except psutil.NoSuchProcess:
            return []


def launch(index: int, mode: str, data: dict[str, Path], root: Path, steps: int, every: int, ckpt: Path,
           threads: int, extra: list[str] = (), write_delay: float = 0.0) -> Start:
    strategy, world = CYCLE[index % len(CYCLE)]
    run_dir = root / f"start_{index:04d}_{strategy}@{world}"
    if mode == "dpo":
        clear_reference_cache(data)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore",
           "TRAINER_RUN_DIR": str(run_dir)}
    if write_delay:  # bench/slow_writer: the background writer holds each step dir open this much longer
        env.update(CHAOS_WRITE_DELAY_S=str(write_delay),
                   PYTHONPATH=os.pathsep.join([str(REPO / "bench" / "slow_writer"), env.get("PYTHONPATH", "")]))
    out = open(run_dir.with_suffix(".out"), "w")
    wall = time.time()
    process = subprocess.Popen([sys.executable, "-m", "trainer", *overrides(mode, data, strategy, world, steps, ckpt,
                                                                            every), *extra, f"hydra.run.dir={run_dir}"],
                               cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    out.close()
    start = Start(index, strategy, world, run_dir, ckpt, process, time.monotonic())
    start.wall_began = wall - 0.01
    return start


def group_alive(pgid: int) -> list[int]:
    """The live processes of the start's process group (its session: launcher, rank server, ranks);
    zombies, dead and waiting for their parent (init) to reap them, are not counted."""
    import psutil

    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return alive


def left_after(start: Start, grace: float = 2.0) -> list[int]:
    """The start's processes still alive `grace` s after its launcher left."""
    deadline = time.monotonic() + grace
    while (left := group_alive(start.process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def command_lines(pids: list[int]) -> str:
    """What each process is (its command line, cut short), to say what was left."""
    import psutil

    lines = []
    for pid in pids:
        try:
            lines.append(f"{pid} ({' '.join(psutil.Process(pid).cmdline())[:160]})")
        except psutil.Error:
            lines.append(f"{pid} (gone)")
    return ", ".join(lines)


def end_group(start: Start) -> list[int]:
    """SIGKILL what is left of the start's process group (by its id: the session it was given); the pids."""
    left = group_alive(start.process.pid)
    if left:
        try:
            os.killpg(start.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


# -- when to kill -----------------------------------------------------------------------------------------------

@dataclass
class Aim:
    target: str  # anytime | save | epoch_change | precompute | startup
    kind: str
    delay: float  # seconds after the trigger


def aim(rng: random.Random, mode: str, write_delay: float = 0.0) -> Aim:
    targets = ["anytime", "save", "epoch_change", "startup"] + (["precompute"] * 3 if mode == "dpo" else [])
    weights = [0.35, 0.3, 0.3, 0.05] + ([0.3] * 3 if mode == "dpo" else [])
    target = rng.choices(targets, weights)[0]
    kind = rng.choice(KINDS)
    delay = {"anytime": rng.uniform(0.0, 3.0), "save": rng.uniform(0.0, 0.03 + write_delay),
             "epoch_change": rng.uniform(0.0, 0.05),
             "precompute": rng.uniform(0.0, 1.0), "startup": rng.uniform(0.0, 8.0)}[target]
    return Aim(target, kind, delay)


def trigger(start: Start, a: Aim, resumed_at: int, epoch_ends: set[int], every: int, steps: int) -> float | None:
    """When (monotonic) the aim's trigger was seen, or None while not yet. A start that saw no step
    beyond where it resumed is never killed but at `startup` (each start moves the run on)."""
    if a.target == "startup":
        return start.began
    if a.target == "precompute":
        return start.precompute_seen
    fresh = [(t, r["step"]) for t, r in start.records if r["step"] > resumed_at]
    if not fresh:
        return None
    if a.target == "anytime":
        return fresh[0][0]
    wanted = (lambda s: s % every == 0) if a.target == "save" else (lambda s: s in epoch_ends)
    hits = [t for t, s in fresh if wanted(s) and s < steps]
    if hits:
        return hits[0]
    if any(wanted(s) for s in range(fresh[-1][1] + 1, steps)):
        return None  # still ahead
    return fresh[0][0]  # nothing left to aim at before the end: a random moment instead


# -- the report ---------------------------------------------------------------------------------------------------

@dataclass
class Tally:
    kills: collections.Counter = field(default_factory=collections.Counter)  # by kind
    phases: collections.Counter = field(default_factory=collections.Counter)
    kind_phase: collections.Counter = field(default_factory=collections.Counter)
    aims: collections.Counter = field(default_factory=collections.Counter)
    exit_codes: collections.Counter = field(default_factory=collections.Counter)
    resumes: int = 0
    resumes_by: collections.Counter = field(default_factory=collections.Counter)  # strategy@world that resumed
    starts: int = 0
    runs: int = 0
    hangs: list = field(default_factory=list)
    left_behind: list = field(default_factory=list)
    slow_exits: list = field(default_factory=list)  # alive past the grace, gone within --exit-timeout: not a failure
    damaged: list = field(default_factory=list)
    loss_failures: list = field(default_factory=list)
    max_rel_diff: float = 0.0
    steps_compared: int = 0
    restart_s: list = field(default_factory=list)  # signal -> the next start's first step record
    exit_s: list = field(default_factory=list)  # signal -> the job gone
    lost_s: list = field(default_factory=list)  # per run: (wall - uninterrupted wall) / kills
    reference_s: dict = field(default_factory=dict)
    wall_s: float = 0.0
    began: float = field(default_factory=time.monotonic)
    compared_kills: int = 0  # the kills of the runs whose losses were compared (finished runs)

    def as_dict(self) -> dict:
        def med(xs):
            return round(statistics.median(xs), 2) if xs else None

        kills = sum(self.kills.values())
        return {"kills": kills, "by_kind": dict(self.kills), "by_phase": {p: self.phases.get(p, 0) for p in PHASES},
                "by_kind_and_phase": {f"{k}/{p}": n for (k, p), n in sorted(self.kind_phase.items())},
                "aimed_at": dict(self.aims), "exit_codes": {str(k): v for k, v in self.exit_codes.items()},
                "starts": self.starts, "resumes": self.resumes, "resumes_by": dict(self.resumes_by), "runs": self.runs,
                "hangs": self.hangs, "left_behind": self.left_behind,
                "slow_exits": self.slow_exits, "damaged_checkpoints": self.damaged,
                "loss_failures": self.loss_failures[:20], "max_rel_loss_diff": self.max_rel_diff,
                "steps_compared": self.steps_compared, "kills_in_compared_runs": self.compared_kills,
                "time_lost_per_kill_s": round(sum(self.lost_s) / kills, 2) if kills else None,
                "restart_s_median": med(self.restart_s), "restart_s_max": round(max(self.restart_s), 2) if self.restart_s else None,
                "exit_s_median": med(self.exit_s), "exit_s_max": round(max(self.exit_s), 2) if self.exit_s else None,
                "reference_s": self.reference_s, "wall_s": round(self.wall_s, 1)}


def verify_checkpoints(ckpt: Path) -> str | None:
    """`python -m trainer.verify CKPT_DIR` (its main, here): None when every step dir is intact."""
    import contextlib
    import io

    from trainer import verify

    if not list(ckpt.glob("step_*")):
        return None
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            verify.main([str(ckpt)])
    except SystemExit as e:
        if e.code:
            return said.getvalue().strip()[-2000:]
    return None


# -- the runs -----------------------------------------------------------------------------------------------------

def reference_run(mode: str, data: dict[str, Path], root: Path, steps: int, every: int, threads: int,
                  timeout: float, extra: list[str] = (), write_delay: float = 0.0) -> tuple[dict[int, dict], float]:
    """The uninterrupted run (fsdp at 2 ranks): its record per step, and its wall time."""
    ckpt = root / "ckpt"
    start = launch(0, mode, data, root, steps, every, ckpt, threads, extra, write_delay)
    try:
        start.process.wait(timeout=timeout)
    finally:
        end_group(start)
    start.poll()
    if start.process.returncode != 0:
        raise SystemExit(f"the uninterrupted {mode} run failed: see {start.run_dir.with_suffix('.out')}")
    rows = {r["step"]: r for _, r in start.records}
    assert sorted(rows) == list(range(1, steps + 1)), sorted(rows)
    return rows, time.monotonic() - start.began


def kill(start: Start, a: Aim, rng: random.Random) -> str:
    """Send the aim's signal; what it was sent to."""
    ranks = start.ranks()
    if a.kind == "job":
        os.killpg(start.process.pid, signal.SIGKILL)
        return "job"
    if a.kind == "rank":
        if ranks:
            victim = rng.choice(ranks)
            victim.kill()
            return f"rank pid {victim.pid}"
        start.process.kill()  # one rank, in the launching process
        return "rank (the process)"
    if ranks and rng.random() < 0.5:
        victim = rng.choice(ranks)
        victim.send_signal(signal.SIGTERM)
        return f"SIGTERM rank pid {victim.pid}"
    start.process.send_signal(signal.SIGTERM)
    return "SIGTERM launcher"


def evidence(start: Start, reference_cache: Path) -> dict:
    """What is seen of the start now: read just before a signal (and the saves again just after)."""
    start.poll()
    saves = start.saves_in_flight()
    return {"saves": saves, "async": start.in_flight_async(saves), "last_step": start.last_step,
            "precompute": start.precompute_seen is not None and not start.records
            and not list(reference_cache.glob("*/train.pt"))}


def phases_of(seen: dict, saves_after: list[str], epoch_ends: set[int], steps: int) -> list[str]:
    """Where a signal landed, from what was seen around it (see the top)."""
    found = []
    if seen["saves"] or saves_after:
        found.append("save")
    if seen["async"]:
        found.append("async_write")
    if seen["precompute"]:
        found.append("precompute")
    elif seen["last_step"] is None:
        found.append("startup")
    if seen["last_step"] in epoch_ends and "save" not in found:
        found.append("epoch_change")
    if seen["last_step"] == steps:
        found.append("final")
    return found or ["step"]


def chaos_run(run: int, mode: str, data: dict[str, Path], root: Path, reference: dict[int, dict], reference_s: float,
              kills_left: int, rng: random.Random, tally: Tally, args) -> int:
    """One run from step 0 to its end, killed at each start until `kills_left` is spent; the kills made."""
    run_root = root / f"run_{run:03d}_{mode}"
    run_root.mkdir(parents=True)
    ckpt = run_root / "ckpt"
    epochs = {s: r["epoch"] for s, r in reference.items()}
    epoch_ends = {s for s in epochs if s + 1 in epochs and epochs[s + 1] != epochs[s]}
    began, made, index, resumed_at, pending_restart = time.monotonic(), 0, 0, 0, None
    all_records: list[dict] = []
    ended = False
    while True:
        start = CURRENT["start"] = launch(index, mode, data, run_root, args.steps, args.every, ckpt, args.threads,
                                          args.override, args.write_delay)
        tally.starts += 1
        a = aim(rng, mode, args.write_delay) if made < kills_left and not ended else None
        fired, deadline = None, time.monotonic() + args.start_timeout
        while start.process.poll() is None and time.monotonic() < deadline:
            start.poll()
            if pending_restart is not None and start.records:
                tally.restart_s.append(start.records[0][0] - pending_restart)
                pending_restart = None
            if a is not None and fired is None:
                at = trigger(start, a, resumed_at, epoch_ends, args.every, args.steps)
                if at is not None and time.monotonic() >= at + a.delay:
                    seen = evidence(start, data["cache"] / "reference")
                    target = kill(start, a, rng)
                    fired = time.monotonic()
                    found = phases_of(seen, start.saves_in_flight(), epoch_ends, args.steps)
                    tally.kills[a.kind] += 1
                    tally.aims[a.target] += 1
                    for p in found:
                        tally.phases[p] += 1
                        tally.kind_phase[(a.kind, p)] += 1
                    made += 1
                    if args.verbose:
                        print(f"  kill {made}: {a.kind} ({target}) aimed at {a.target}, landed in {'+'.join(found)} "
                              f"after step {start.last_step} of start {index} ({start.strategy}@{start.world})",
                              flush=True)
                    deadline = fired + args.exit_timeout
            time.sleep(0.004)
        if start.process.poll() is None:
            late = (f"still running {args.exit_timeout:g} s after the signal" if fired else
                    f"neither killed nor ended {args.start_timeout:g} s after its launch (last step: {start.last_step})")
            tally.hangs.append(f"run {run} start {index} ({start.strategy}@{start.world}): {late}")
        code = start.process.poll()
        exited = time.monotonic()
        left = left_after(start) if code is not None else []
        if left:  # past the grace: gone within the exit timeout is slow (a loaded machine), else left behind
            named = command_lines(left)
            still = left_after(start, grace=args.exit_timeout)
            where = f"run {run} start {index} ({start.strategy}@{start.world}): {named}"
            if still:
                tally.left_behind.append(f"{where} alive {args.exit_timeout:g} s after the launcher left")
            else:
                tally.slow_exits.append(f"{where} gone {time.monotonic() - exited:.1f} s after the launcher left")
        end_group(start)
        start.process.wait()
        start.poll()
        if fired is not None:
            tally.exit_s.append(exited - fired)
            pending_restart = fired
        tally.exit_codes[start.process.returncode] += 1
        all_records += [r for _, r in start.records]
        if any(e["event"] in ("resumed",) for e in start.events):
            tally.resumes += 1
            tally.resumes_by[f"{start.strategy}@{start.world}"] += 1
        damaged = verify_checkpoints(ckpt)
        if damaged:
            tally.damaged.append(f"run {run} start {index}: {damaged}")
        tally.wall_s = time.monotonic() - tally.began
        if args.json:  # after every start: a stopped chaos run leaves its counts so far
            Path(args.json).write_text(json.dumps(tally.as_dict(), indent=1) + "\n")
        ended = ended or run_ended(start, ckpt, args.steps)
        if ended and start.process.returncode == 0:  # (a kill after the run's end: one more start says so)
            break
        if fired is None and a is not None and start.process.returncode != 0:
            tally.loss_failures.append(f"run {run} start {index} failed before its kill: exit {start.process.returncode}"
                                       f" (see {start.run_dir.with_suffix('.out')})")
            if index > 8:
                break
        resumed_at = max([resumed_at, newest_step(ckpt)])
        index += 1
        if index > 4 * (args.steps + kills_left):
            tally.loss_failures.append(f"run {run}: no end after {index} starts")
            break
    tally.runs += 1
    tally.lost_s.append(max(0.0, (time.monotonic() - began) - reference_s))
    compare(run, all_records, reference, tally, args)
    tally.compared_kills += made
    if not args.keep:
        shutil.rmtree(run_root, ignore_errors=True)
    return made


def newest_step(ckpt: Path) -> int:
    return max([0] + [int(p.name.split("_")[1]) for p in ckpt.glob("step_*")])


def run_ended(start: Start, ckpt: Path, steps: int) -> bool:
    """The run is over: this start recorded its end, or it left with exit 0 from a checkpoint at the
    last step. The trainer then says "nothing to do" and records no end: the kill before it landed
    after the last save was published and before the end's record."""
    return (any(e["event"] == "end" for e in start.events)
            or start.process.returncode == 0 and newest_step(ckpt) >= steps)


def compare(run: int, rows: list[dict], reference: dict[int, dict], tally: Tally, args) -> None:
    """Every record of every start against the uninterrupted run's at its step."""
    for r in rows:
        want = reference[r["step"]]["loss"]
        diff = abs(r["loss"] - want) / abs(want)
        tally.max_rel_diff = max(tally.max_rel_diff, diff)
        tally.steps_compared += 1
        if diff > args.rtol:
            tally.loss_failures.append(f"run {run} step {r['step']}: loss {r['loss']!r} vs {want!r} ({diff:.2e})")
        if r["epoch"] != reference[r["step"]]["epoch"]:
            tally.loss_failures.append(f"run {run} step {r['step']}: epoch {r['epoch']} vs {reference[r['step']]['epoch']}")
    missing = set(reference) - {r["step"] for r in rows}
    if missing:
        tally.loss_failures.append(f"run {run}: steps never recorded: {sorted(missing)[:10]}")


def chaos(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    data = make_data(root / "data")
    modes = ["mixture", "dpo"] if args.mode == "both" else [args.mode]
    tally = Tally()
    began = tally.began
    references = {}
    for mode in modes:
        ref_root = root / f"reference_{mode}"
        if ref_root.exists():
            shutil.rmtree(ref_root)
        ref_root.mkdir(parents=True)
        references[mode] = reference_run(mode, data, ref_root, args.steps, args.every, args.threads,
                                         args.start_timeout, args.override, args.write_delay)
        tally.reference_s[mode] = round(references[mode][1], 1)
        print(f"uninterrupted {mode} run: {args.steps} steps in {references[mode][1]:.1f} s", flush=True)
    made, run = 0, 0
    try:
        while made < args.kills:
            mode = modes[run % len(modes)]
            made += chaos_run(run, mode, data, root, *references[mode], args.kills - made, rng, tally, args)
            run += 1
            tally.wall_s = time.monotonic() - began
            print(f"run {run}: {made} kills so far, {tally.resumes} resumes, max loss diff {tally.max_rel_diff:.2e}, "
                  f"{len(tally.hangs)} hangs, {len(tally.damaged)} damaged, {len(tally.loss_failures)} failures, "
                  f"{tally.wall_s:.0f} s", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(tally.as_dict(), indent=1) + "\n")
    finally:  # stopped on the way (a test's timeout, an error): the start in flight ends with it
        start = CURRENT["start"]
        if start is not None and start.process.poll() is None:
            end_group(start)
    report = tally.as_dict()
    report.update(seed=args.seed, mode=args.mode, steps=args.steps, every=args.every, rtol=args.rtol)
    return report


def ok(report: dict) -> bool:
    return not (report["hangs"] or report["left_behind"] or report["damaged_checkpoints"] or report["loss_failures"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["mixture", "dpo", "both"], default="both")
    p.add_argument("--steps", type=int, default=24, help="steps of each run")
    p.add_argument("--every", type=int, default=2, help="checkpoint.every_steps")
    p.add_argument("--rtol", type=float, default=1e-6, help="largest relative loss difference allowed")
    p.add_argument("--exit-timeout", type=float, default=60.0, help="seconds a killed job may take to leave")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a start may run before its kill or its end (a start that never ends: a hang)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    p.add_argument("--out", help="work dir (default: a fresh one under /tmp)")
    p.add_argument("--json", help="write the report here (also after each run)")
    p.add_argument("--keep", action="store_true", help="keep each run's dirs")
    p.add_argument("--verbose", action="store_true", help="a line per kill")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more trainer override for every start (e.g. checkpoint.async=true)")
    p.add_argument("--write-delay", type=float, default=0.0, metavar="S",
                   help="with checkpoint.async=true: the background writer holds each step dir S s longer "
                        "(bench/slow_writer), so that kills land mid-write")
    return p.parse_args(argv)


CURRENT: dict = {"start": None}  # the start running now: its process group ends with this process


def stop(signum, frame) -> None:
    """SIGTERM/SIGINT to the chaos run: the start running now ends with it (its own process group)."""
    start = CURRENT["start"]
    if start is not None and start.process.poll() is None:
        end_group(start)
    sys.exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    args = parse()
    report = chaos(args)
    print(json.dumps(report, indent=1))
    sys.exit(0 if ok(report) else 1)


if __name__ == "__main__":
    main()
