"""Packed vs unpacked rows: activation bytes per rank and tokens/s (not a test: prints a table).

    python bench/packed_rows.py [--models small,qwen2] [--seqs 2048,8192] [--sp 1,2] [--documents 8] [--steps 3]

`small` is the built-in preset (conf/model/small.yaml: 6 layers, width 384, 6 heads); `qwen2` a tiny Qwen2 (2 layers, 4 heads, 2 key/value heads) built on
the spot from a config (random weights), built as the trainer builds it for packed data or plain data
(`build_model(..., packed=...)`: at sp=1 transformers' own attention for plain rows).

Each cell runs forward and backward of one row of `seq` tokens, fp32 on the CPU, in this process (sp=1)
or on `sp` gloo ranks launched as `nproc=sp` does, as the loop runs a micro-batch: inside
`sequence.sharded` with the whole row's position ids, each rank on its share. A packed row holds
`documents` documents of equal length (position ids restarting at each); an unpacked row is one
document without position ids (at sp > 1 a share carries its positions in the whole row). `activations` is rank 0's `SavedBytes` (what mem.activations measures), tokens/s the median
of the steps after the first, of the whole row (all ranks of a group together).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_node(name: str, seq: int, folder: Path) -> dict:
    if name != "qwen2":  # a built-in preset, as `model=NAME` reads it
        return {**yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text()), "seq_len": seq}
    from trainer.demo import make_model_dir

    path = make_model_dir(folder / "qwen2", "qwen2", weights=False, max_position_embeddings=seq)
    return {"name": "hf", "kind": "hf", "path": str(path), "seq_len": seq}


def cell(env, node: dict, seq: int, documents: int, steps: int) -> tuple[int, float]:
    import torch.distributed as dist

    from trainer.config import to_config
    from trainer.models import build_model, logits_of, resolve_model, sequence
    from trainer.saved_bytes import SavedBytes

    sp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = resolve_model(to_config({"model": node}).model)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"), sp=sp, packed=documents > 1)
    group = sequence.SequenceGroup(dist.group.WORLD if sp > 1 else None, sp, dist.get_rank() if sp > 1 else 0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(seq) % (seq // documents))[None]
    whole = positions if documents > 1 else None  # as the loop runs it: plain rows carry no position ids
    local = group.local(positions) if whole is not None or sp > 1 else None
    kept, times = 0, []
    for _ in range(steps):
        start = time.perf_counter()
        with sequence.sharded(group, whole), SavedBytes() as saved:
            loss = logits_of(model(group.local(ids), position_ids=local)).float().square().mean()
        loss.backward()
        times.append(time.perf_counter() - start)
        kept = saved.bytes
    return kept, seq / statistics.median(times[1:] or times)


def main() -> None:
    from tests.harness import on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,qwen2")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--sp", default="1,2")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'model':<7}{'seq':>6}{'sp':>4}{'rows':>10}{'activations MB':>16}{'tokens/s':>10}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model, seq in itertools.product(args.models.split(","), (int(s) for s in args.seqs.split(","))):
            node = model_node(model, seq, Path(tmp))
            for sp in (int(n) for n in args.sp.split(",")):
                for name, documents in (("unpacked", 1), ("packed", args.documents)):
                    if sp == 1:
                        kept, rate = cell(None, node, seq, documents, args.steps)
                    else:
                        kept, rate = on_ranks(sp, cell, node, seq, documents, args.steps)[0]
                    print(f"{model:<7}{seq:>6}{sp:>4}{name:>10}{kept / 1e6:>16.1f}{rate:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
