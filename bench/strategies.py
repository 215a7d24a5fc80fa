"""Every strategy at several world sizes: the trainer against a hand-written loop of the same
backend (not a test: prints numbers, writes JSON and a chart).

    python bench/strategies.py [--model small] [--ranks 1,2,4] [--steps 12] [--out-dir bench/results]
    python bench/strategies.py --model tiny --steps 6 --warmup 2 --ranks 1,2 --out-dir /tmp/b   # quick check
    python bench/strategies.py --from-json bench/results/strategies_small_cpu.json   # table + chart again
    bench/gpu.sh                                         # one CUDA GPU: gpt_1b, bf16, world size 1, MFU

Per strategy and world size, one launch of fresh rank processes runs the trainer and the raw
loop of bench/raw_loops.py, `--rounds` times each in alternating order: same model and initial
weights, data, global batch (micro-batch = global / ranks), optimizer, LR schedule, clipping,
precision and steps. Reported: median step time after `--warmup` steps of each run, tokens/s,
the bytes rank 0 holds (metrics `mem`: params/grads/optim; CUDA `peak`), peak RSS (max over
ranks), the trainer/raw ratio of median and of fastest step times (the trainer's overhead), the
largest loss difference between the two, and with --peak-flops the MFU. The bench fails (exit 1,
naming the run and the step) when a step's losses differ past SAME_WORK_RTOL: then the two did
different work and their times do not compare.
Results: <out-dir>/strategies_<model>_<device>.json (rewritten after every run, per-step times
included) and .png. On a CPU shared with other work, `--threads 1` keeps a busy core from
stalling a rank's thread pool (seen: 25x slower steps at 2 threads per rank).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench.raw_loops` importable here and in the spawned ranks

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
MB = 1e6
# The trainer and the raw loop do the same work when their per-step losses agree this closely
# (relative): fp32 only reorders a reduction here and there; bf16 rounds each op's output.
SAME_WORK_RTOL = {"fp32": 1e-5, "bf16": 1e-2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="a preset of conf/model/")
    p.add_argument("--ranks", "--nproc", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="first steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=2,
                   help="trainer and raw loop runs per launch, in alternating order (T R, R T, ...)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, at every world size")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (OMP_NUM_THREADS); default: the trainer's, CPU cores / local ranks")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when there is one")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="the device's peak FLOP/s at --precision (e.g. 989e12: H100/H200 dense bf16): report MFU")
    p.add_argument("--out-dir", default=str(REPO / "bench/results"))
    p.add_argument("--run-dir", default=None, help="metrics.jsonl and rank logs of each run (default: a temp dir)")
    p.add_argument("--from-json", default=None,
                   help="an earlier results file: recompute its summaries from the per-step times, print the table, "
                   "redraw the chart")
    args = p.parse_args()
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no steps of --steps {args.steps} to time")
    return args


def choose_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    if requested == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes CUDA whenever the ranks see it
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def model_preset(name: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(REPO / "conf/model" / f"{name}.yaml"))


def model_facts(model: dict) -> dict:
    """Parameters and training FLOPs per token, from a model built on the meta device."""
    from trainer.config import to_config
    from trainer.models import model_facts as facts

    built = facts(to_config({"model": model}).model, None)
    return {"params": built.params, "flops_per_token": built.flops_per_token}


def run_one(strategy: str, ranks: int, args, model: dict, run_dir: Path) -> dict:
    """Launch `ranks` fresh processes; the trainer and the raw loop `--rounds` times each. Their
    per-step times, losses and memory (`summarise` derives the rest)."""
    from bench.raw_loops import measure
    from trainer import distributed
    from trainer.training.run import in_group

    cfg = {"strategy": {"name": strategy}, "model": model,
           "train": {"max_steps": args.steps, "log_every": 1, "micro_batch_size": args.global_batch // ranks,
                     "precision": args.precision}}
    per_rank = distributed.launch_local(ranks, in_group, measure, f"{strategy}_x{ranks}", cfg, str(run_dir),
                                        args.rounds)
    trainer, raw = per_rank[0]["trainer"], per_rank[0]["raw"]
    return {
        "strategy": strategy, "ranks": ranks, "micro_batch_size": args.global_batch // ranks,
        "threads_per_rank": per_rank[0]["threads"],
        "mem": trainer[0][-1]["mem"],  # rank 0, after backward, first trainer run
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in per_rank.values()),
        "raw": {"peak_bytes": raw[0]["peak_bytes"], "start_bytes": raw[0]["start_bytes"]},
        "trainer_step_times_s": [[row["step_time_s"] for row in rows] for rows in trainer],
        "raw_step_times_s": [r["step_times_s"] for r in raw],
        "trainer_losses": [[row["loss"] for row in rows] for rows in trainer],
        "raw_losses": [r["losses"] for r in raw],
    }


def summarise(run: dict, settings: dict) -> None:
    """Add what follows from the per-step times: for the trainer and the raw loop, the median and
    the fastest step after each run's warm-up steps, tokens/s, MFU; the trainer/raw ratios of
    both. On a shared machine interference only adds time, so the fastest steps show the work
    itself when the medians are blurred by other load."""
    tokens_per_step = settings["global_batch"] * settings["seq_len"]
    for timed, runs in ((run, run["trainer_step_times_s"]), (run["raw"], run["raw_step_times_s"])):
        steps = [t for times in runs for t in times[settings["warmup"]:]]
        timed["step_time_s"], timed["fastest_step_s"] = statistics.median(steps), min(steps)
        timed["tokens_per_s"] = tokens_per_step / timed["step_time_s"]
        if settings["peak_flops"]:  # model FLOPs per second over what the ranks' devices could do
            timed["mfu"] = timed["tokens_per_s"] * settings["flops_per_token"] / (settings["peak_flops"] * run["ranks"])
    run["overhead_ratio"] = run["step_time_s"] / run["raw"]["step_time_s"]
    run["overhead_ratio_fastest"] = run["fastest_step_s"] / run["raw"]["fastest_step_s"]
    pairs = [(a, b) for ts, rs in zip(run["trainer_losses"], run["raw_losses"]) for a, b in zip(ts, rs)]
    run["loss_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
    run["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs)


def different_work(results: dict) -> list[str]:
    """The runs whose trainer and raw loop did not do the same work: a step's losses differ past
    SAME_WORK_RTOL. Their step times are not comparable, so the bench fails on them."""
    rtol = SAME_WORK_RTOL[results["settings"]["precision"]]
    lines = []
    for run in results["runs"]:
        for r, (ts, rs) in enumerate(zip(run["trainer_losses"], run["raw_losses"])):
            step = next((i for i, (a, b) in enumerate(zip(ts, rs), 1) if abs(a - b) > rtol * abs(b)), None)
            if step is not None:
                lines.append(f"{run['strategy']} x{run['ranks']} round {r}: step {step} loss {ts[step - 1]:.7g} "
                             f"(trainer) vs {rs[step - 1]:.7g} (raw), past rtol {rtol:g}")
    return lines


def print_table(results: dict) -> None:
    s = results["settings"]
    print(f"\nmodel={s['model']} ({s['params'] / 1e6:.1f}M params) device={s['device']} precision={s['precision']} "
          f"global batch={s['global_batch']} x {s['seq_len']} tokens; step times: median of the last "
          f"{s['steps'] - s['warmup']} of {s['steps']} steps of {s['rounds']} runs each")
    cuda = any(r["mem"]["peak"] is not None for r in results["runs"])
    columns = [("strategy", "{strategy}", 9), ("ranks", "{ranks}", 6), ("step s", "{step_time_s:.3f}", 8),
               ("tokens/s", "{tokens_per_s:.0f}", 10), ("params MB", "{params:.1f}", 10),
               ("grads MB", "{grads:.1f}", 9), ("optim MB", "{optim:.1f}", 9),
               ("peak RSS MB", "{rss:.0f}", 12), ("threads", "{threads_per_rank}", 8)]
    if cuda:
        columns += [("peak GPU MB", "{gpu_peak:.0f}", 12), ("raw peak GPU MB", "{raw_gpu_peak:.0f}", 16)]
    if s["peak_flops"]:
        columns += [("MFU %", "{mfu:.1f}", 7), ("raw MFU %", "{raw_mfu:.1f}", 10)]
    columns += [("raw step s", "{raw_step:.3f}", 11), ("ratio", "{ratio:.3f}", 7),
                ("fastest s", "{fastest_step_s:.3f}", 10), ("raw fastest", "{raw_fastest:.3f}", 12),
                ("ratio", "{ratio_fastest:.3f}", 7), ("loss diff", "{diff:.1e}", 10)]
    print("".join(f"{title:>{width}}" for title, _, width in columns))
    for r in results["runs"]:
        values = {**r, **{k: v / MB for k, v in r["mem"].items() if k != "peak"},
                  "rss": r["peak_rss_bytes"] / MB, "gpu_peak": (r["mem"]["peak"] or 0) / MB,
                  "raw_gpu_peak": (r["raw"]["peak_bytes"] or 0) / MB,
                  "mfu": 100 * r.get("mfu", 0), "raw_mfu": 100 * r["raw"].get("mfu", 0),
                  "raw_step": r["raw"]["step_time_s"], "ratio": r["overhead_ratio"], "diff": r["loss_max_abs_diff"],
                  "raw_fastest": r["raw"]["fastest_step_s"], "ratio_fastest": r["overhead_ratio_fastest"]}
        print("".join(f"{fmt.format(**values):>{width}}" for _, fmt, width in columns))
    print("ratio: trainer / raw loop, of the median and of the fastest step times; loss diff: the largest "
          "difference of their per-step losses")
    runs = results["runs"]
    if runs:
        geomean = {key: math.exp(statistics.fmean(math.log(r[key]) for r in runs))
                   for key in ("overhead_ratio", "overhead_ratio_fastest")}
        print(f"geometric mean of the ratios over {len(runs)} runs: {geomean['overhead_ratio']:.3f} (median steps), "
              f"{geomean['overhead_ratio_fastest']:.3f} (fastest steps)")


def plot(results: dict, path: Path) -> None:
    """Three panels, bars grouped by world size: step time (black tick: raw loop, number:
    trainer/raw), bytes rank 0 holds (params/grads/optim stacked), peak memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, runs = results["settings"], results["runs"]
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    ranks = sorted({r["ranks"] for r in runs})
    width = 0.8 / len(strategies)
    color = dict(zip(strategies, plt.cm.tab10.colors))
    cuda = any(r["mem"]["peak"] is not None for r in runs)
    fig, (time_ax, bytes_ax, peak_ax) = plt.subplots(1, 3, figsize=(18, 5.5))
    ticks, labels = [], []
    for run in runs:
        x = ranks.index(run["ranks"]) + (strategies.index(run["strategy"]) - (len(strategies) - 1) / 2) * width
        ticks.append(x), labels.append(run["strategy"])
        step, raw = run["step_time_s"], run["raw"]["step_time_s"]
        time_ax.bar(x, step, width * 0.9, color=color[run["strategy"]])
        time_ax.hlines(raw, x - width * 0.45, x + width * 0.45, color="black", linewidth=2)
        time_ax.annotate(f"{run['overhead_ratio']:.2f}", (x, max(step, raw)), ha="center", va="bottom", fontsize=7)
        bottom = 0.0
        for kind, grey in (("params", "0.2"), ("grads", "0.5"), ("optim", "0.8")):  # not a strategy's colour
            mb = run["mem"][kind] / MB
            bytes_ax.bar(x, mb, width * 0.9, bottom=bottom, color=grey, label=kind if run is runs[0] else None)
            bottom += mb
        peak = run["mem"]["peak"] if cuda else run["peak_rss_bytes"]
        peak_ax.bar(x, peak / MB, width * 0.9, color=color[run["strategy"]])
    time_ax.plot([], [], color="black", linewidth=2, label="raw loop")
    for ax, title in ((time_ax, "median step time, s (number: trainer / raw)"),
                      (bytes_ax, "bytes rank 0 holds, MB"),
                      (peak_ax, "peak CUDA memory, MB" if cuda else "peak RSS (max over ranks), MB")):
        ax.set_title(title, fontsize=10)
        ax.set_xticks(ticks, labels, rotation=90, fontsize=8)
        group_axis = ax.secondary_xaxis(-0.2)
        group_axis.set_xticks(range(len(ranks)), [f"{n} rank{'s' if n > 1 else ''}" for n in ranks])
        group_axis.tick_params(length=0)
        group_axis.spines["bottom"].set_visible(False)
    time_ax.margins(y=0.25)  # room for the legend above the bars
    time_ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=color[n]) for n in strategies]
                   + time_ax.get_legend_handles_labels()[0], labels=strategies + ["raw loop"], fontsize=8,
                   ncol=3, loc="upper center")
    bytes_ax.legend(fontsize=8)
    threads = "/".join(sorted({str(r["threads_per_rank"]) for r in runs}))
    fig.suptitle(f"{s['model']} ({s['params'] / 1e6:.1f}M params), {s['device']}, {s['precision']}, "
                 f"global batch {s['global_batch']} x {s['seq_len']} tokens, {threads} thread(s) per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        for run in results["runs"]:
            summarise(run, results["settings"])
        Path(args.from_json).write_text(json.dumps(results, indent=1))
        print_table(results)
        plot(results, Path(args.from_json).with_suffix(".png"))
        return
    device = choose_device(args.device)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the ranks inherit it; the trainer then keeps it
    import torch

    model = model_preset(args.model)
    ranks = [int(n) for n in args.ranks.split(",")]
    if any(args.global_batch % n for n in ranks):
        sys.exit(f"--global-batch {args.global_batch} must divide evenly over --ranks {args.ranks}")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out_dir) / f"strategies_{args.model}_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"settings": {"model": args.model, **model_facts(model), "seq_len": model["seq_len"],
                            "device": device, "precision": args.precision, "global_batch": args.global_batch,
                            "steps": args.steps, "warmup": args.warmup,
                            "rounds": args.rounds, "peak_flops": args.peak_flops,
                            "torch": torch.__version__, "deepspeed": version("deepspeed"),
                            "cpus": os.cpu_count(), "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M")},
               "runs": []}
    print(f"[bench] rank logs and metrics: {run_dir}", flush=True)
    for n in ranks:
        for strategy in args.strategies.split(","):
            started = time.perf_counter()
            run = run_one(strategy, n, args, model, run_dir)
            summarise(run, results["settings"])
            results["runs"].append(run)
            out.write_text(json.dumps(results, indent=1))  # after every run: a crash keeps what was measured
            print(f"[bench] {strategy} x{n}: trainer {run['step_time_s']:.3f} s/step, "
                  f"raw {run['raw']['step_time_s']:.3f} s/step, ratio {run['overhead_ratio']:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    print_table(results)
    plot(results, out.with_suffix(".png"))
    print(f"\n[bench] results: {out}, chart: {out.with_suffix('.png')}")
    if differ := different_work(results):
        sys.exit("[bench] FAILED: the trainer and the raw loop did different work, so their times do not compare:\n  "
                 + "\n  ".join(differ))


if __name__ == "__main__":
    main()
