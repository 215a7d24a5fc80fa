"""Parameters that transformers makes from several stored tensors as it loads a checkpoint: a
mixture-of-experts model's fused experts (`experts.gate_up_proj` [E, 2I, H] from every expert's
`gate_proj` and `up_proj`, `experts.down_proj` from every `down_proj`). transformers' conversion
mapping (`get_model_conversion_mapping`) names the source keys of each target and the ops that make
it, in order (`MergeModulelist(dim=0)`, then `Concatenate(dim=1)`).

Those ops only stack and concatenate, so the flattened target is the stored tensors' flattened
values in some order: a `Layout`, a list of (file, key, flat start, length) pieces, worked out once
from the shapes alone. A rank's range of the target then reads only the source rows that range
covers: no rank ever holds a whole fused tensor, as no rank holds a whole plain one. Ops that do
more than reorder (Transpose, Interleave) or that make several targets from one tensor (Chunk,
Split) are refused, naming the op and the family.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError

Piece = tuple[Path, str, int, int]  # a stored tensor's flat values [start, start + numel): (file, key, start, numel)


@dataclass
class Layout:
    """A tensor whose flattened values are its pieces' values, one after another."""
    shape: tuple[int, ...]
    pieces: list[Piece]

    def cut(self, start: int, numel: int) -> list[Piece]:
        """The pieces that hold the flat range [start, start + numel), trimmed to it."""
        out, offset = [], 0
        for path, key, begin, length in self.pieces:
            lo, hi = max(start, offset), min(start + numel, offset + length)
            if lo < hi:
                out.append((path, key, begin + lo - offset, hi - lo))
            offset += length
            if offset >= start + numel:
                break
        return out


def joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one stored tensor as one (a whole expert's gate rows: one read)."""
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1][:2] == piece[:2] and out[-1][2] + out[-1][3] == piece[2]:
            out[-1] = (*piece[:2], out[-1][2], out[-1][3] + piece[3])
        else:
            out.append(piece)
    return out


def merge_module_list(op, tensors: dict[str, list[Layout]], order: list[str]) -> dict[str, list[Layout]]:
    """MergeModulelist(dim=0): per source pattern, torch.stack of its tensors (the experts, in order)."""
    if op.dim != 0 or any(len({t.shape for t in found}) != 1 for found in tensors.values()):
        raise NotImplementedError
    return {pattern: [Layout((len(found), *found[0].shape), joined([p for t in found for p in t.pieces]))]
            for pattern, found in tensors.items()}


def concatenate(op, tensors: dict[str, list[Layout]], order: list[str]) -> dict[str, list[Layout]]:
    """Concatenate(dim=d): torch.cat of every tensor, in the converter's order of source patterns;
    each outer index (the dims before d) takes each tensor's slab in turn."""
    found = [t for pattern in order for t in tensors.get(pattern, [])]
    d = op.dim
    if len({t.shape[:d] + t.shape[d + 1:] for t in found}) != 1:
        raise NotImplementedError
    pieces = []
    for i in range(math.prod(found[0].shape[:d])):
        for t in found:
            slab = math.prod(t.shape[d:])
            pieces += t.cut(i * slab, slab)
    shape = list(found[0].shape)
    shape[d] = sum(t.shape[d] for t in found)
    return {"": [Layout(tuple(shape), joined(pieces))]}



class Conversions:
    """The fused targets of one model: which stored keys feed each (`claim`), and their `Layout`s
    once every key has been seen (`layouts`)."""

    def __init__(self, model, shapes: dict[str, tuple[int, ...]]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.prefix = getattr(model, "base_model_prefix", None) or None
        self.shapes = shapes
        self.family = model.config.model_type
        # target name -> (converter, source pattern -> [(key, file, shape)])
        self.sources: dict[str, tuple[object, dict[str, list]]] = {}

    def claim(self, key: str, path: Path, shape: tuple[int, ...]) -> str | None:
        """The parameter `key` is a source of (recorded), or None when no converter takes it."""
        from transformers.core_model_loading import rename_source_key

        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.shapes)
        if pattern is None:
            return None
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        by_pattern = self.sources.setdefault(name, (converter, defaultdict(list)))[1]
        by_pattern[pattern].append((key, path, shape))
        return name

    def layouts(self) -> dict[str, Layout]:
        """Each target's Layout: transformers' ops, in order, on the sources in its order (by key,
        expert numbers as numbers), applied to shapes and pieces instead of values."""
        from transformers.core_model_loading import dot_natural_key

        out = {}
        for name, (converter, by_pattern) in self.sources.items():
            tensors = {pattern: [Layout(tuple(shape), [(path, key, 0, math.prod(shape))])
                                 for key, path, shape in sorted(found, key=lambda k: dot_natural_key(k[0]))]
                       for pattern, found in by_pattern.items()}
            for op in converter.operations:
                if type(op).__name__ not in OPS:
                    raise ConfigError(f"model.path: transformers makes {name} of this {self.family} model with "
                                      f"{op!r} (of {converter.operations}), which the trainer does not apply range "
                                      f"by range; it loads what {' and '.join(OPS)} make")
                try:
                    tensors = OPS[type(op).__name__](op, tensors, converter.source_patterns)
                except NotImplementedError:
                    raise ConfigError(f"model.path: transformers makes {name} of this {self.family} model with "
                                      f"{op!r} (of {converter.operations}) on tensors of shapes the trainer does "
                                      "not join range by range") from None
            made = [t for found in tensors.values() for t in found]
            if len(made) != 1:
                raise ConfigError(f"model.path: transformers makes {name} of this {self.family} model from "
                                  f"{len(made)} tensors that its ops {converter.operations} do not join into one")
            out[name] = made[0]
        return out


OPS = {"MergeModulelist": merge_module_list, "Concatenate": concatenate}
