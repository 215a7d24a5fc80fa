"""The time to fingerprint a pretrained folder (what a LoRA checkpoint records of its frozen base).

    python bench/fingerprint.py [--gb 3] [--shards 4] [--tensors-per-shard 700] [--out FILE]

Writes a folder of random bf16 tensors in safetensors shards on /tmp, flushes it out of the page
cache (posix_fadvise DONTNEED, so reads come from the disk), and times
`trainer.models.weights.fingerprint` cold and warm, against reading every byte once (sha256).
The fingerprint reads a fixed sample per tensor (SAMPLE_WINDOWS x SAMPLE_BYTES) by seeking, so its
time follows the number of tensors, not the bytes: the extrapolation to a 70B folder (140 GB in
bf16) is given per tensor count, for Llama-2-70B's 723 tensors in 29 shards and for a
pessimistic 700 tensors in each of 29 shards.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_folder(root: Path, gb: float, shards: int, per_shard: int) -> tuple[list[Path], dict, dict]:
    import numpy as np
    import torch

    from trainer.models.weights import save_safetensors

    rng = np.random.default_rng(0)
    row = 1024  # bf16 values per row
    rows = max(1, int(gb * 2 ** 30 / shards / per_shard / (2 * row)))
    files, shapes, where = [], {}, {}
    for s in range(shards):
        tensors = {}
        for t in range(per_shard):
            name = f"layers.{s}.w{t}"
            tensors[name] = torch.frombuffer(bytearray(rng.bytes(rows * row * 2)), dtype=torch.bfloat16).view(rows, row)
        path = root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors(tensors, path)
        files.append(path)
        shapes.update({n: [rows, row] for n in tensors})
        where.update({n: (path, n) for n in tensors})
    return files, shapes, where


def drop_from_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_all(files: list[Path]) -> None:
    for f in files:
        digest = hashlib.sha256()
        with open(f, "rb") as handle:
            while chunk := handle.read(2 ** 24):
                digest.update(chunk)


def main() -> None:
    from trainer.models.weights import SAMPLE_BYTES, SAMPLE_WINDOWS, fingerprint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--tensors-per-shard", type=int, default=700)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fingerprint_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        files, shapes, where = write_folder(Path(tmp), args.gb, args.shards, args.tensors_per_shard)
        size = sum(f.stat().st_size for f in files) / 1e9
        tensors = len(shapes)
        drop_from_page_cache(files)
        cold = timed(lambda: fingerprint(files, shapes, where))
        warm = timed(lambda: fingerprint(files, shapes, where))
        drop_from_page_cache(files)
        full = timed(lambda: read_all(files))
    per_tensor = cold / tensors
    result = {
        "folder_gb": round(size, 3), "shards": len(files), "tensors": tensors,
        "sample_bytes_per_tensor": SAMPLE_WINDOWS * SAMPLE_BYTES,
        "fingerprint_cold_s": round(cold, 3), "fingerprint_warm_s": round(warm, 3),
        "fingerprint_cold_s_per_gb": round(cold / size, 4), "read_every_byte_s_per_gb": round(full / size, 3),
        "cold_ms_per_tensor": round(1e3 * per_tensor, 3),
        "70b_llama2_723_tensors_s": round(723 * per_tensor, 2),
        "70b_700_tensors_in_each_of_29_shards_s": round(29 * 700 * per_tensor, 1),
        "70b_reading_every_byte_s": round(140 * full / size),
    }
    for key, value in result.items():
        print(f"{key:40s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
