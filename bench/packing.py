"""What padding-free packing buys on chat data (not a test: prints numbers, writes JSON).

    python bench/packing.py                       # reference `small` (~11M), seq 512, 240 conversations
    python bench/packing.py --model tiny --conversations 60     # quick check

A chat set whose conversations' lengths vary about 10x (answers of 15 to 900 characters, made by
trainer/demo.py from the bundled texts), trained for one epoch by the trainer itself (one
rank, `data=chat`), with `data.packing=true` (conversations joined into rows of `seq_len`,
position ids restarting at each) and `data.packing=false` (one padded row per conversation).
Reported per mode: rows (and steps) per epoch, the share of row positions that hold a
conversation's token, the epoch's time, and target tokens per second (the assistants' tokens:
`tokens` in metrics.jsonl). An epoch's time is its steps x their median time, which leaves out
the first step's warm-up and bursts of other work on the machine (the steps of either mode cost
the same: rows of seq_len). The modes alternate for `--rounds` epochs each, and each reports
its fastest (the others' are in the JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ANSWER_CHARS = (15, 45, 135, 405, 800)  # about 10x from the shortest conversation to the longest
MODELS = {  # reference shapes (conf/model/), with the chat tokenizer's vocabulary
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256},
    "small": {"d_model": 384, "n_layers": 6, "n_heads": 6, "d_ff": 1536},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="small")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench/results/packing_cpu.json"))
    return p.parse_args()


def make_data(root: Path, n: int) -> tuple[Path, Path]:
    from trainer.demo import conversations, documents, train_chat_tokenizer, write_rows

    texts = documents()
    return (write_rows(root / "chat.jsonl", conversations(texts, n, ANSWER_CHARS)),
            train_chat_tokenizer(root / "tokenizer", texts))


def config(args, data: Path, tokenizer: Path, cache: Path, packing: bool) -> dict:
    from trainer.demo import VOCAB

    return {"model": {"name": args.model, "kind": "reference", "vocab_size": VOCAB, "seq_len": args.seq,
                      **MODELS[args.model]},
            "data": {"name": "chat", "path": str(data), "tokenizer": str(tokenizer), "cache_dir": str(cache),
                     "packing": packing, "num_workers": 0},
            "train": {"max_steps": 0, "epochs": 1, "micro_batch_size": args.micro_batch, "log_every": 1},
            "optim": {"warmup_steps": 2}, "logger": {"jsonl": {}}}


def rows_and_lengths(cfg: dict) -> tuple[int, list[int]]:
    """The rows of an epoch, and each conversation's length in tokens (from the trainer's cache)."""
    import numpy as np

    from trainer.config import to_config
    from trainer.data import load_data
    from trainer.data.read import the_source, token_cache

    c = to_config(cfg)
    tokens, _ = token_cache(c, the_source(c), c.data.path, "data.path").tokens()
    return len(load_data(c, local_rank=0)[0]), np.diff(np.append(tokens.doc_starts, len(tokens.ids))).tolist()


def epoch(run_dir: Path, rows: int, filled: float) -> dict:
    import statistics

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step_time_s" in r]
    step_s = statistics.median(r["step_time_s"] for r in steps)
    return {"rows": rows, "steps": len(steps), "filled": filled, "target_tokens": steps[-1]["tokens"],
            "epoch_s": step_s * len(steps), "step_s": step_s,
            "target_tokens_per_s": steps[-1]["tokens"] / (step_s * len(steps))}


def main() -> None:
    import statistics

    from trainer import distributed
    from trainer.training.run import in_group, train_configs

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, tokenizer = make_data(root, args.conversations)
        modes = {mode: config(args, data, tokenizer, root / "cache", mode == "packed") for mode in ("packed", "padded")}
        runs = [(mode, f"{mode}_{r}") for r in range(args.rounds) for mode in (sorted, reversed)[r % 2](modes)]
        distributed.launch_local(1, in_group, train_configs, {run: modes[mode] for mode, run in runs},
                                 str(root / "runs"))
        rows = {mode: rows_and_lengths(cfg)[0] for mode, cfg in modes.items()}
        sizes = rows_and_lengths(modes["packed"])[1]
        # Each conversation fills its length - 1 positions (cut to seq_len), in either mode.
        used = sum(min(n - 1, args.seq) for n in sizes)
        rounds = {mode: [epoch(root / "runs" / run, rows[mode], used / (rows[mode] * args.seq))
                         for m, run in runs if m == mode] for mode in modes}
        results = {mode: {**max(epochs, key=lambda e: e["target_tokens_per_s"]),
                          "rounds_target_tokens_per_s": [e["target_tokens_per_s"] for e in epochs]}
                   for mode, epochs in rounds.items()}
    spread = sorted(sizes)
    summary = {
        "model": args.model, "seq_len": args.seq, "micro_batch": args.micro_batch, "rounds": args.rounds,
        "conversations": len(sizes),
        "conversation_tokens": {"min": spread[0], "median": statistics.median(spread), "max": spread[-1],
                                "p5": spread[len(spread) // 20], "p95": spread[len(spread) * 19 // 20]},
        **results,
        "speedup": results["packed"]["target_tokens_per_s"] / results["padded"]["target_tokens_per_s"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    c = summary["conversation_tokens"]
    print(f"{len(sizes)} conversations of {c['min']}-{c['max']} tokens (median {c['median']}, p5-p95 "
          f"{c['p5']}-{c['p95']}); model={args.model} seq_len={args.seq} micro_batch={args.micro_batch}, one rank, "
          f"best of {args.rounds} epochs each")
    print(f"{'':8}{'rows':>6}{'steps':>7}{'filled':>8}{'targets':>9}{'epoch s':>9}{'step s':>8}{'targets/s':>11}")
    for mode, r in results.items():
        print(f"{mode:8}{r['rows']:>6}{r['steps']:>7}{r['filled']:>8.0%}{r['target_tokens']:>9}{r['epoch_s']:>9.1f}"
              f"{r['step_s']:>8.3f}{r['target_tokens_per_s']:>11.0f}")
    print(f"packed/padded target tokens per second: {summary['speedup']:.2f}x; written {args.out}")


if __name__ == "__main__":
    main()
