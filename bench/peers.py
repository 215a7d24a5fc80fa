"""The trainer against the programs users would pick instead, on the same model, data and batch
(not a test: prints a markdown table, writes JSON). `make bench-peers` runs it.

    python bench/peers.py                                   # ~30M Llama, 30 steps, every cell (long)
    python bench/peers.py --layers 2 --hidden 128 --steps 8 --strategies ddp,zero3   # quick check
    python bench/peers.py --device cuda                     # bench/gpu.sh: the same on one node of GPUs

Made on the spot: a byte-level BPE (with ChatML's markers) trained on the bundled license texts,
a Llama-style model with random weights saved with `save_pretrained` (fp32), the texts as token
windows of seq_len + 1, and chat conversations of the same texts. Per strategy (ddp, fsdp, zero2,
zero3) and data:
- text: `trainer nproc=R model=hf data=tokens` against HF `Trainer` under torchrun
  (bench/peers_hf.py). The Trainer reads the same windows in the trainer's rank order
  (`train_sampling_strategy="sequential"` over rows laid out so that Accelerate's shards are the
  trainer's), with the trainer's targets (the next token at every position, `shift_labels`):
  the same math, so the step losses are compared.
- chat: `data=chat` (packed, train_on=all) against TRL's `SFTTrainer(packing=True)` (best-fit
  packing, padding-free): the rows differ (their packing and order), so only the losses' trend.
  Both with activation checkpointing: TRL's SFTConfig turns it on by default (its peer records it).
Both: seq_len, micro-batch, fp32, AdamW (betas 0.9/0.999, no decay), constant lr, clip 1.0, one
thread per rank. Cells, each measured by this process around the command:
- tokens/s: input tokens of a step over its median time after the first 5 steps (the trainer's
  `step_time_s`; the peer's time between step ends), target tokens alike;
- peak RSS per rank: VmHWM of the command's processes, read every 50 ms, the R largest;
- first step: seconds from the command to the first step's record appearing (polled);
- checkpoint (with --checkpoint): a save at the last step (the trainer: its record to its
  `latest` file; the peer: on_step_end to on_save), its bytes on disk, and a second command
  that resumes from it: its seconds to its first step;
- the loss at the last step, and the mean of the last LAST_STEPS steps' (chat: the sides' rows differ).
A command that fails fills its cells with the first line of its error.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
WARMUP = 5  # steps left out of the median


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, batch and ranks of the bench (bench/feature_costs.py takes the same)."""
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary (the model's)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)


def llama_config(args, vocab: int, **extra):
    """The bench's Llama-style config: untied, as many key/value heads as heads."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=args.seq, tie_word_embeddings=False, **extra)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--strategies", default="ddp,fsdp,zero2,zero3")
    p.add_argument("--data", default="text,chat")
    p.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=str(REPO / "bench/results/peers_cpu.json"))
    return p.parse_args()


def prepare(args, root: Path) -> dict:
    """Tokenizer, model folder, text windows (the trainer's file; the peer's rows in the trainer's
    rank order) and chat rows, in `root`."""
    import numpy as np
    import torch
    from torch.utils.data import DistributedSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.demo import conversations, documents, train_chat_tokenizer, write_rows

    texts = documents()
    tokenizer_dir = train_chat_tokenizer(root / "tokenizer", texts, vocab=args.vocab)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = llama_config(args, len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(root / "model"), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())

    per_step = args.micro_batch * args.ranks
    rows_needed = per_step * (args.steps + 3)  # one epoch covers the run and its resumed steps
    ids = [i for t in texts for i in tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]]
    ids = ids * (rows_needed * args.seq // len(ids) + 2)
    np.array(ids, dtype=np.uint16).tofile(root / "train.bin")
    n = (len(ids) - 1) // args.seq
    windows = torch.tensor([ids[i * args.seq:(i + 1) * args.seq + 1] for i in range(n)])
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=1234)  # the trainer's
    order = list(sampler)
    # The trainer's rank r reads positions c + r, c + r + R, ... of a step's c..c + per_step; Accelerate
    # gives rank r the r-th micro-batch of per_step sequential rows.
    peer = [order[k + r + args.ranks * j] for k in range(0, n - per_step + 1, per_step)
            for r in range(args.ranks) for j in range(args.micro_batch)]
    torch.save(windows[peer], root / "windows.pt")
    convs = conversations(texts, 6 * rows_needed)
    write_rows(root / "chat.jsonl", convs)
    return {"params": params, "vocab": len(tokenizer), "text_rows": n, "chat_conversations": len(convs)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(args, root: Path, strategy: str, data: str, run: Path, steps: int, save: bool) -> list[str]:
    # chat: activation checkpointing on, as TRL's SFTConfig has it by default (gradient_checkpointing=True)
    data_args = (["data=tokens", f"data.path={root / 'train.bin'}"] if data == "text" else
                 ["data=chat", f"data.path={root / 'chat.jsonl'}", f"data.tokenizer={root / 'tokenizer'}",
                  "data.train_on=all", f"data.cache_dir={root / 'cache'}", "train.activation_checkpointing=true"])
    ckpt = [f"checkpoint.dir={root / 'ckpt' / f'ours-{strategy}-{data}'}", f"checkpoint.every_steps={args.steps}",
            "checkpoint.keep_last=1"] if save else []
    return [str(BIN / "trainer"), f"nproc={args.ranks}", f"strategy={strategy}", "model=hf",
            f"model.path={root / 'model'}", f"model.seq_len={args.seq}", *data_args,
            f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={steps}", "train.log_every=1",
            "train.precision=fp32", f"train.device={args.device}", f"optim.lr={args.lr}", "optim.weight_decay=0",
            "optim.betas=[0.9,0.999]", "optim.warmup_steps=0", "optim.schedule=constant", "train.grad_clip=1.0",
            f"hydra.run.dir={run}", *ckpt]


def peer_command(args, root: Path, strategy: str, data: str, run: Path, steps: int, save: bool,
                 resume: str | None) -> list[str]:
    settings = {"strategy": strategy, "data": data, "model": str(root / "model"), "tokenizer": str(root / "tokenizer"),
                "windows": str(root / "windows.pt"), "chat": str(root / "chat.jsonl"), "seq_len": args.seq,
                "micro_batch": args.micro_batch, "max_steps": steps, "lr": args.lr, "seed": 1234,
                "save_steps": args.steps if save else 0, "resume": resume, "block": "LlamaDecoderLayer",
                "output_dir": str(root / "ckpt" / f"peer-{strategy}-{data}"), "records": str(run / "records.jsonl")}
    (run / "settings.json").write_text(json.dumps(settings))
    return [str(BIN / "torchrun"), f"--nproc_per_node={args.ranks}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(REPO / "bench/peers_hf.py"), str(run / "settings.json")]


def peak_rss(pid: int, peaks: dict[int, int]) -> None:
    """The VmHWM of `pid`'s descendants, into peaks (by pid)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM"):
                    peaks[child.pid] = max(peaks.get(child.pid, 0), int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def is_step(record: dict) -> bool:
    return "loss" in record and "step" in record and "event" not in record


def launch(command: list[str], records: Path, ranks: int, latest: Path | None = None) -> dict:
    """Run `command`, polling its records (the first step's appearance), its processes' RSS and,
    for the trainer's save, its `latest` file. The command's output goes to records' folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    out = records.parent / "output.txt"
    start = time.perf_counter()
    seen: dict[int, float] = {}  # step -> seconds since the command when its record was first seen
    peaks: dict[int, int] = {}
    latest_at = None
    with open(out, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=records.parent)
        while process.poll() is None:
            peak_rss(process.pid, peaks)
            now = time.perf_counter() - start
            for r in filter(is_step, read_jsonl(records)):
                seen.setdefault(r["step"], now)
            if latest is not None and latest_at is None and latest.exists():
                latest_at = now
            time.sleep(0.05)
    text = out.read_text()
    if process.returncode:
        errors = [line for line in text.splitlines() if "Error" in line or "error:" in line]
        return {"error": (errors[-1] if errors else text.strip().splitlines()[-1] if text.strip() else
                          f"exit {process.returncode}").strip()[:300]}
    steps = list(filter(is_step, read_jsonl(records)))
    return {"records": steps, "first_step_s": min(seen.values()) if seen else None, "seen": seen,
            "peak_rss_per_rank": sorted(peaks.values(), reverse=True)[:ranks], "latest_at": latest_at,
            "saves": [r for r in read_jsonl(records) if "save_s" in r]}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def summarise(run: dict, ours: bool, seq_targets: bool) -> dict:
    """tokens/s (median of the steps after the first WARMUP), losses, first step and RSS of one run."""
    if "error" in run:
        return run
    recs = run["records"]
    tokens = [b["input_tokens"] - a["input_tokens"] for a, b in zip(recs, recs[1:])]
    if ours:
        times = [r["step_time_s"] for r in recs[1:]]
        targets = [b["tokens"] - a["tokens"] for a, b in zip(recs, recs[1:])]
    else:
        times = [b["t"] - a["t"] for a, b in zip(recs, recs[1:])]
        targets = tokens if seq_targets else None  # the peer's targets are all inputs' next tokens (text)
    steady = range(WARMUP - 1, len(times))  # pairs (k, k+1) from step WARMUP + 1 on
    rate = statistics.median(tokens[i] / times[i] for i in steady) if len(steady) else None
    return {"tokens_per_s": rate, "step_time_s": statistics.median(times[i] for i in steady) if len(steady) else None,
            "target_tokens_per_s": statistics.median(targets[i] / times[i] for i in steady)
            if targets and len(steady) else None,
            "peak_rss_per_rank": run["peak_rss_per_rank"], "first_step_s": run["first_step_s"],
            "losses": [r["loss"] for r in recs], "final_loss": recs[-1]["loss"] if recs else None}


def one_side(args, root: Path, side: str, strategy: str, data: str) -> dict:
    """A run of `args.steps` (saving at its last step with --checkpoint), then one that resumes from it."""
    runs = root / "runs"
    run = runs / f"{side}-{strategy}-{data}"
    run.mkdir(parents=True)
    ours = side == "ours"
    save = args.checkpoint
    if ours:
        ckpt = root / "ckpt" / f"ours-{strategy}-{data}"
        result = launch(ours_command(args, root, strategy, data, run, args.steps, save), run / "metrics.jsonl",
                        args.ranks, ckpt / "latest" if save else None)
    else:
        ckpt = root / "ckpt" / f"peer-{strategy}-{data}"
        result = launch(peer_command(args, root, strategy, data, run, args.steps, save, None), run / "records.jsonl",
                        args.ranks)
    row = summarise(result, ours, data == "text")
    if not ours:  # what Accelerate made of the strategy (on CPU: DDP, whatever was asked)
        setup = [r for r in read_jsonl(run / "records.jsonl") if r.get("event") == "setup"]
        row["ran_as"] = setup[0]["distributed_type"] if setup else None
        row["activation_checkpointing"] = setup[0].get("gradient_checkpointing") if setup else None
    if not save or "error" in result:
        return row
    if ours:
        step_dir = ckpt / f"step_{args.steps:08d}"
        row["save_s"] = result["latest_at"] - result["seen"][args.steps] if result["latest_at"] else None
        row["checkpoint_bytes"] = dir_bytes(step_dir) if step_dir.exists() else None
        resumed_run = runs / f"{run.name}-resumed"
        resumed_run.mkdir()
        resumed = launch(ours_command(args, root, strategy, data, resumed_run, args.steps + 2, True),
                         resumed_run / "metrics.jsonl", args.ranks)
    else:
        step_dir = ckpt / f"checkpoint-{args.steps}"
        row["save_s"] = result["saves"][0]["save_s"] if result["saves"] else None
        row["checkpoint_bytes"] = dir_bytes(step_dir) if step_dir.exists() else None
        resumed_run = runs / f"{run.name}-resumed"
        resumed_run.mkdir()
        resumed = launch(peer_command(args, root, strategy, data, resumed_run, args.steps + 2, False, str(step_dir)),
                         resumed_run / "records.jsonl", args.ranks)
    row["resume_first_step_s"] = resumed.get("first_step_s", resumed.get("error"))
    return row


LAST_STEPS = 10  # one step's loss on packed chat rows moves by 0.4 from step to step: their mean compares
CELLS = [("tokens/s", "tokens_per_s", "{:.0f}"), ("target tokens/s", "target_tokens_per_s", "{:.0f}"),
         ("peak RSS/rank MB", "peak_rss_mb", "{:.0f}"), ("first step s", "first_step_s", "{:.1f}"),
         ("save s", "save_s", "{:.2f}"), ("checkpoint MB", "checkpoint_mb", "{:.1f}"),
         ("resume to first step s", "resume_first_step_s", "{:.1f}"), ("loss at the end", "final_loss", "{:.4f}"),
         (f"mean loss, last {LAST_STEPS} steps", "mean_last_loss", "{:.4f}")]


def cell(ours: dict, peer: dict, key: str, fmt: str) -> str:
    def value(row: dict):
        if "error" in row:
            return row["error"]
        v = row.get(key)
        if key == "peak_rss_mb" and row.get("peak_rss_per_rank"):
            v = max(row["peak_rss_per_rank"]) / 1e6
        if key == "checkpoint_mb" and row.get("checkpoint_bytes"):
            v = row["checkpoint_bytes"] / 1e6
        if key == "mean_last_loss" and row.get("losses"):
            v = statistics.mean(row["losses"][-LAST_STEPS:])
        return v
    a, b = value(ours), value(peer)
    show = [fmt.format(v) if isinstance(v, (int, float)) else (v or "-").replace("|", "/") for v in (a, b)]
    ratio = f" ({a / b:.2f}x)" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""
    return f"{show[0]} / {show[1]}{ratio}"


def table(results: list[dict]) -> str:
    lines = ["| data | strategy | peer (Accelerate ran) | " + " | ".join(name for name, _, _ in CELLS)
             + " | step losses max abs diff |", "|---" * (len(CELLS) + 4) + "|"]
    fell_back = False  # a row whose peer ran DDP for another strategy
    for r in results:
        ours, peer = r["ours"], r["peer"]
        diff = r.get("loss_max_abs_diff")
        ran = peer.get("ran_as")
        fell_back |= r["strategy"] != "ddp" and ran in ("MULTI_CPU", "NO")
        how = f"{ran or '-'}{', AC' if peer.get('activation_checkpointing') else ''}"
        lines.append(f"| {r['data']} | {r['strategy']} | {r['peer_name']} ({how}) | "
                     + " | ".join(cell(ours, peer, key, fmt) for _, key, fmt in CELLS)
                     + f" | {'-' if diff is None else f'{diff:.1e}'} |")
    if any(r["peer"].get("activation_checkpointing") for r in results):
        lines.append("\nAC: the peer checkpointed activations (TRL's SFTConfig does by default); ours too in "
                     "those rows (`train.activation_checkpointing=true`).")
    if fell_back:
        lines.append("\nMULTI_CPU: the peer trained with DDP, not the strategy asked for: Accelerate enables FSDP on "
                     "accelerators only (its state.py), silently; in those rows ours is the strategy against the "
                     "peer's DDP. `bench/gpu.sh peers` compares them strategy for strategy.")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    root = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    # Both sides start with cold data caches (the trainer's in data.cache_dir; `datasets`' here), and
    # load DeepSpeed's CPU ops from where the trainer builds them (a peer's first run would build its own).
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf_datasets")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    facts = prepare(args, root)
    print(f"[bench] Llama-style {facts['params'] / 1e6:.1f}M params, vocab {facts['vocab']}, {facts['text_rows']} text "
          f"windows, {facts['chat_conversations']} conversations ({root})", flush=True)
    results = []
    for data in args.data.split(","):
        for strategy in args.strategies.split(","):
            row = {"data": data, "strategy": strategy,
                   "peer_name": "HF Trainer" if data == "text" else "TRL SFTTrainer"}
            for side in ("ours", "peer"):
                row[side] = one_side(args, root, side, strategy, data)
                print(f"[bench] {data} {strategy} {side}: {json.dumps({k: v for k, v in row[side].items() if k != 'losses'})}",
                      flush=True)
            a, b = row["ours"].get("losses"), row["peer"].get("losses")
            if data == "text" and a and b:  # the same rows in the same order: the same math
                row["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
            results.append(row)
    import accelerate
    import deepspeed
    import trl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "accelerate": accelerate.__version__, "trl": trl.__version__, "deepspeed": deepspeed.__version__}
    machine = (f"{os.cpu_count()} CPUs" if args.device == "cpu" else torch.cuda.get_device_name()) + f", {args.ranks} ranks"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": started, "machine": machine, "versions": versions, "settings": vars(args),
                               **facts, "results": results}, indent=1))
    print(f"\n{started}, {machine}, " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"cells: ours / peer (ratio ours/peer); {facts['params'] / 1e6:.1f}M-param Llama, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.steps} steps, fp32\n")
    print(table(results))
    print(f"\n[bench] results: {out}")


if __name__ == "__main__":
    main()
