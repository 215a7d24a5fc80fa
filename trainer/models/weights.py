"""Where a model's first weights come from, and how each rank gets only its own part of them.

A model is built with its parameters on the meta device (ZeRO-3: partitioned by `zero.Init`);
the strategy allocates what the rank holds and asks a WeightSource for exactly those ranges:
- `InitWeights`: the model's own initialisation, run per module on a full-size CPU tensor of
  that module only, seeded by the module's name, so every strategy, world size and activation
  checkpointing setting starts from the same values.
- `SafetensorsWeights`: pretrained weights, read from the safetensors files' memory maps, so no
  rank ever copies more than its own part.
Both answer `read(name, start, numel, block)`: the fp32 values [start, start + numel) of a flattened
parameter (of a `Block` of its columns, a rank's part that is no run of those values), named as in
the plain model (`canonical_name`). Files are read as checkpoints are (`read_part`): only the values
asked, a block's row segments.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import warnings
import zlib
from contextlib import ExitStack, contextmanager
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.models.converted import Conversions

# activation checkpointing, torch.compile, and peft's LoRA layer around the layer it adapts
WRAPPER_PARTS = {"_checkpoint_wrapped_module", "_orig_mod", "base_layer"}


def canonical_name(name: str) -> str:
    """The parameter's (or module's) name in the plain model, whatever wraps its modules. An
    adapter of peft's inner ParamWrapper (two stacked expert parameters of one module, adapted:
    `experts.base_layer.lora_A...`) keeps the `base_layer` before its `lora_A`/`lora_B`, as peft
    names it; it would otherwise have the outer one's name."""
    parts = name.split(".")
    adapter = next((i for i, part in enumerate(parts) if part in ("lora_A", "lora_B")), -1)
    return ".".join(part for i, part in enumerate(parts)
                    if part not in WRAPPER_PARTS or (part == "base_layer" and i < adapter))


ShapeOf = Callable[[torch.Tensor], tuple[int, ...]]


def tensor_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape where the tensor has it (a DTensor's is global); a backend that
    partitions parameters as they are built answers for them (`Strategy.full_shape`)."""
    return tuple(p.shape)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (`register_buffer(..., persistent=True)`: BatchNorm's running
    statistics, Gemma4's `layer_scalar`), by canonical name; recomputed ones are left out."""
    return {canonical_name(f"{prefix}.{name}" if prefix else name): b
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, b in module._buffers.items() if b is not None and name not in module._non_persistent_buffers_set}


class WeightSource(Protocol):
    description: str
    fingerprint: str | None  # pretrained files: their layout and sampled values (`fingerprint`)

    def read(self, name: str, start: int, numel: int, block: Block | None = None) -> torch.Tensor:
        """fp32 values [start, start + numel) of parameter `name`, flattened (of a `block` of it, in its order)."""

    def read_buffer(self, name: str) -> torch.Tensor | None:
        """The whole value of persistent buffer `name`; None: keep the one the model computed."""


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Build a module with its parameters on the meta device and its buffers real: buffers that
    __init__ computes (a rotary `inv_freq`) keep their values, which `to_empty` would turn into
    garbage. A parameter registered again (tied embeddings) stays the same parameter, a tie that
    accelerate's `init_empty_weights` breaks. Through torch's public parameter registration hook."""
    def on_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if param.device.type != "meta":
            return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return None

    hook = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        hook.remove()


class Block(NamedTuple):
    """A rank's part of a tensor that is no run of its flat values: the columns [column, column +
    width) of the tensor seen as rows of `columns` values (strategy.ep: peft's lora_B of a module of
    experts, [out, r x E], whose fastest index is the expert; strategy.tp: a rowwise layer's columns,
    and a packed layer's chunk of each of its K parts, the tensor seen as K rows). Ranges of such a part
    count in its own flat order, its rows one after another, as the rank holds it."""
    column: int
    width: int
    columns: int

    def positions(self, start: int, numel: int) -> torch.Tensor:
        """Where the part's values [start, start + numel) lie in the whole flat tensor (increasing)."""
        k = torch.arange(start, start + numel)
        return k // self.width * self.columns + self.column + k % self.width

    def apart(self, other: Block) -> bool:
        """Whether two blocks of the tensor seen alike share no column (two tensor ranks' parts)."""
        return self.columns == other.columns and (self.column + self.width <= other.column
                                                  or other.column + other.width <= self.column)


class Run(NamedTuple):
    """The values [start, start + numel) of a part of a flat tensor: a run of it (`block` None), or of
    a `Block` of it, counted in the block's own order."""
    start: int
    numel: int
    block: Block | None = None

    def positions(self) -> torch.Tensor:
        """Where the values of a block's run lie in the whole flat tensor (increasing)."""
        return self.block.positions(self.start, self.numel)

    def span(self) -> tuple[int, int]:
        """The places of the flat tensor from the run's first value to past its last."""
        if self.block is None:
            return self.start, self.start + self.numel
        return int(self.block.positions(self.start, 1)), int(self.block.positions(self.start + self.numel - 1, 1)) + 1

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """These values of the whole flat tensor `flat` (only they are copied)."""
        if self.block is None:
            return flat[self.start:self.start + self.numel]
        return flat[self.positions()]


class Overlap(NamedTuple):
    """The values two runs of one flat tensor share: their indices among the first's values and among
    the second's (slices, or index tensors in the same order), and how many."""
    ours: slice | torch.Tensor
    theirs: slice | torch.Tensor
    count: int


def overlap(want: Run, held: Run) -> Overlap | None:
    """What `held` (a stored run) holds of `want` (a run a rank reads); None: nothing."""
    if not want.numel or not held.numel:
        return None
    (want_first, want_end), (held_first, held_end) = want.span(), held.span()
    if want_end <= held_first or held_end <= want_first:  # cheap, before any positions: another rank's rows
        return None
    if want.block and held.block and want.block.apart(held.block):  # another tensor rank's columns
        return None
    if want.block == held.block:  # two runs of the flat tensor, or of one block (a resume at the same degree)
        lo, hi = max(want.start, held.start), min(want.start + want.numel, held.start + held.numel)
        if lo >= hi:
            return None
        return Overlap(slice(lo - want.start, hi - want.start), slice(lo - held.start, hi - held.start), hi - lo)
    if want.block is None:  # the same, seen from the other side
        found = overlap(held, want)
        return None if found is None else Overlap(found.theirs, found.ours, found.count)
    at = want.positions()
    if held.block is None:  # a flat run: a range of `at`, by bisection, never the run's own positions
        lo, hi = (int(i) for i in torch.searchsorted(at, torch.tensor([held.start, held.start + held.numel])))
        return Overlap(slice(lo, hi), at[lo:hi] - held.start, hi - lo) if lo < hi else None
    stored = held.positions()
    index = torch.searchsorted(stored, at).clamp_(max=len(stored) - 1)
    hit = stored[index] == at
    count = int(hit.sum())
    return Overlap(hit.nonzero().squeeze(1), index[hit], count) if count else None


def read_part(want: Run, stored: Iterable[tuple[Run, Callable[[], torch.Tensor]]]) -> tuple[torch.Tensor, int]:
    """The fp32 values of `want`, from stored runs of the flat tensor, each with what gives its values
    (a `MappedFile`'s: indexing it copies only the values asked, a rowwise part's row segments, not
    its rows whole); and how many of them the runs held. A run that holds none is never opened."""
    out = torch.empty(want.numel, dtype=torch.float32)
    found = 0
    for held, values in stored:
        if (common := overlap(want, held)) is not None:
            out[common.ours] = values()[common.theirs]
            found += common.count
    return out, found


SAFETENSORS_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                     "U8": torch.uint8}  # what is read: float weights, a checkpoint's fp32 pieces and RNG states


def safetensors_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header (8 bytes of its length, little-endian, then JSON): where its
    tensors' bytes start, and each tensor's dtype, shape and `data_offsets` counted from there."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


class MappedFile:
    """A safetensors file over its memory map, read-only. `file[key]` is a tensor flattened, of which no
    byte is read until indexed, and indexing copies only the values it names; the map closes with this
    and the last of those tensors, so the pages read do not stay resident."""

    def __init__(self, path: Path):
        self.begin, self.header = safetensors_header(path)
        with open(path, "rb") as f:  # read-only, as safetensors maps: a private writable map would count the
            self.memory = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # whole file against the commit limit

    def __contains__(self, key: str) -> bool:
        return key in self.header

    def __getitem__(self, key: str) -> torch.Tensor:
        dtype = SAFETENSORS_TORCH[self.header[key]["dtype"]]
        first, end = self.header[key]["data_offsets"]
        if first == end:
            return torch.empty(0, dtype=dtype)
        with warnings.catch_warnings():  # "the given buffer is not writable": these tensors are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.memory, dtype=dtype, offset=self.begin + first,
                                    count=(end - first) // dtype.itemsize)


def whole(p: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The local range of a parameter every rank holds whole."""
    return 0, p.detach().view(-1)


@torch.no_grad()
def allocate_params(model: nn.Module, device: torch.device) -> None:
    """Give meta parameters real, uninitialised storage on `device`; ties and buffers are kept."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    aliases = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) in owners:
                    aliases.append((module, name, owners[id(p)]))
                else:
                    owners[id(p)] = (module, name)
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None]
    model.to_empty(device=device)  # one new tensor per module attribute: ties are broken here ...
    for module, name, (owner, owner_name) in aliases:  # ... and restored here
        module._parameters[name] = owner._parameters[owner_name]
    for module, name, b in buffers:  # the values __init__ computed, where they were
        module._buffers[name] = b


@torch.no_grad()
def fill(model: nn.Module, weights: WeightSource, local_range: Callable[[torch.Tensor], tuple] = whole) -> None:
    """Copy into every parameter's local range (start, flat view[, its `Block`]) its values from
    `weights`, and into every persistent buffer (whole on every rank) its value where `weights` has one."""
    for name, p in model.named_parameters():  # a tied parameter once
        start, local, *block = local_range(p)
        if local.numel():
            local.copy_(weights.read(canonical_name(name), start, local.numel(), *block))
    for name, buffer in persistent_buffers(model).items():
        value = weights.read_buffer(name)
        if value is not None:
            buffer.copy_(value.view_as(buffer))


def module_seed(seed: int, module_name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2 ** 63)


class InitWeights:
    """The model's own initialisation, module by module, as `from_config` runs it: `reset_parameters()`
    (torch's layers; `_reset_parameters()` for MultiheadAttention), then the model's `_init_weights`
    (Hugging Face, nanoGPT) on the module and then on each of its ancestors, nearest first, as
    transformers' post-order walk does (GPT-2's attention and MLP rescale their `c_proj` from
    there). Values are made for one module at a time, on full-size CPU tensors swapped in for its
    parameters; every other parameter an ancestor's init reaches is a meta stand-in, which draws
    no random numbers."""

    description = "initialised by the model's own init (reset_parameters, _init_weights), seeded by train.seed"
    fingerprint = None

    def __init__(self, model: nn.Module, seed: int, shape_of: ShapeOf = tensor_shape):
        self.seed, self.shape_of = seed, shape_of
        self.owner: dict[str, tuple[str, nn.Module, str]] = {}  # param name -> (module name, module, attr)
        self.init_fn: dict[str, Callable[[nn.Module], None] | None] = {}
        self.modules: dict[str, nn.Module] = {}
        seen = set()
        for module_name, module in model.named_modules():
            module_name = canonical_name(module_name)
            self.modules.setdefault(module_name, module)  # a LoRA layer, not the layer it wraps (same name)
            parent = self.init_fn.get(module_name.rpartition(".")[0]) if module_name else None
            # A Hugging Face sub-model (a PreTrainedModel inside) brings its own _init_weights.
            self.init_fn[module_name] = getattr(module, "_init_weights", None) or parent
            for attr, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self.owner[f"{module_name}.{attr}" if module_name else attr] = (module_name, module, attr)
        self.cached: tuple[str, dict[str, torch.Tensor]] = ("", {})

    def read(self, name: str, start: int, numel: int, block: Block | None = None) -> torch.Tensor:
        module_name, module, attr = self.owner[name]
        if self.cached[0] != module_name or attr not in self.cached[1]:
            self.cached = (module_name, self._initialise(module_name, module))
        return Run(start, numel, block).of(self.cached[1][attr].view(-1))

    def read_buffer(self, name: str) -> None:
        return None  # the values the model's __init__ computed

    def ancestors(self, module_name: str) -> Iterator[tuple[str, nn.Module]]:
        """The modules above `module_name`, nearest first, the root last."""
        while module_name:
            module_name = module_name.rpartition(".")[0]
            yield module_name, self.modules[module_name]

    def _initialise(self, module_name: str, module: nn.Module) -> dict[str, torch.Tensor]:
        own = {attr: p for attr, p in module._parameters.items() if p is not None}
        plain = {attr: nn.Parameter(torch.full(self.shape_of(p), math.nan)) for attr, p in own.items()}
        module._parameters.update(plain)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, module_name))
                for reset in ("reset_parameters", "_reset_parameters"):  # torch's layers; MultiheadAttention
                    if hasattr(module, reset):
                        getattr(module, reset)()
                        break
                if self.init_fn[module_name] is not None:
                    self.init_fn[module_name](module)
                for ancestor_name, ancestor in self.ancestors(module_name):
                    if self.init_fn[ancestor_name] is not None:
                        with meta_stand_ins(ancestor, module, self.shape_of):
                            self.init_fn[ancestor_name](ancestor)
        finally:
            module._parameters.update(own)
        for attr, value in plain.items():
            if torch.isnan(value).any():
                where = f"{module_name}.{attr}" if module_name else attr
                raise ConfigError(f"model: {where} ({type(module).__name__}) has no initialiser: neither "
                                  "reset_parameters() nor the model's _init_weights(module) sets it; give its "
                                  "module a reset_parameters(), or start from weights (model=hf with *.safetensors)")
        return {attr: value.detach() for attr, value in plain.items()}


@contextmanager
def meta_stand_ins(root: nn.Module, keep: nn.Module, shape_of: ShapeOf) -> Iterator[None]:
    """Every parameter under `root`, but those of `keep`, replaced by a meta tensor of its full
    shape (a ZeRO-3 partition or an FSDP2 shard is not what an initialiser expects to see)."""
    swapped = []
    for module in root.modules():
        if module is keep:
            continue
        for attr, p in module._parameters.items():
            if p is not None:
                swapped.append((module, attr, p))
                module._parameters[attr] = nn.Parameter(torch.empty(shape_of(p), device="meta"),
                                                        requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for module, attr, p in swapped:
            module._parameters[attr] = p


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the file mode the umask allows (save_file makes it 0600, which
    the rest of a group on a shared cluster cannot read)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: the index's files, else every *.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(directory.glob("*.safetensors"))


SAMPLE_WINDOWS, SAMPLE_BYTES = 8, 4096  # per tensor: 8 windows of 4 KiB, evenly spread (all of a smaller one)


def byte_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file (`safetensors_header`)."""
    begin, header = safetensors_header(path)
    return {key: (begin + spec["data_offsets"][0], begin + spec["data_offsets"][1]) for key, spec in header.items()}


def sampled_bytes(f, begin: int, end: int) -> Iterator[bytes]:
    """A fixed sample of the bytes [begin, end) of an open file: SAMPLE_WINDOWS windows of SAMPLE_BYTES
    from the first byte to the last, by seeking (a 70B folder is not read whole to fingerprint it)."""
    if end - begin <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        f.seek(begin)
        yield f.read(end - begin)
        return
    for i in range(SAMPLE_WINDOWS):
        f.seek(begin + i * (end - begin - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1))
        yield f.read(SAMPLE_BYTES)


def fingerprint(files: list[Path], shapes: dict[str, list[int]], where: dict[str, tuple[Path, str]]) -> str:
    """What a checkpoint that does not save pretrained weights (frozen under LoRA) records of them:
    `layout+values`, where layout hashes the tensors' names and shapes and the files' sizes (all a
    checkpoint recorded before values were sampled: `check_base` accepts those, with a warning) and
    values hashes a fixed sample of each tensor's stored bytes, so a base and its fine-tuned variant
    (same names, shapes and sizes) differ. `where`: a tensor's name -> (file, key)."""
    layout = hashlib.sha256(json.dumps({f.name: f.stat().st_size for f in files} | shapes,
                                       sort_keys=True).encode()).hexdigest()[:16]
    values = hashlib.sha256()
    ranges = {f: byte_ranges(f) for f in files}
    with ExitStack() as files_open:
        handles = {f: files_open.enter_context(open(f, "rb")) for f in files}
        for handle in handles.values():  # no read-ahead around each window: 1.6-2.7x faster from a cold disk here
            if hasattr(os, "posix_fadvise"):  # Linux
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        for name in sorted(where):
            path, key = where[name]
            values.update(name.encode())
            for sample in sampled_bytes(handles[path], *ranges[path][key]):
                values.update(sample)
    return f"{layout}+{values.hexdigest()[:16]}"


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names; others hold quantised values
QUANTISATION_SUFFIXES = ("_scale_inv", "_scale", ".absmax", ".quant_map", ".quant_state")


class SafetensorsWeights:
    """Pretrained weights from safetensors files, read by row ranges (never a whole file).
    `rename` maps a key of the files to the model's parameter name; `buffers`: the model's persistent
    buffers (read where the files have them); `also_known` says whether another key is still the
    model's (a tied alias, a key the model's class ignores). Any other key, and any quantised
    tensor, is refused."""

    def __init__(self, directory: Path, shapes: dict[str, tuple[int, ...]], rename: Callable[[str], str] = str,
                 buffers: dict[str, tuple[int, ...]] | None = None, also_known: Callable[[str], bool] = lambda name: False,
                 conversions: Conversions | None = None):
        from safetensors import safe_open

        self.files = safetensors_files(directory)
        self.description = f"weights from {directory} ({len(self.files)} safetensors file(s))"
        stored: dict[str, tuple[Path, str, tuple[int, ...]]] = {}  # model name -> (file, key, shape)
        buffers = buffers or {}
        quantised, unknown = [], []
        for f in self.files:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    stored_slice = handle.get_slice(key)
                    # a source of a fused parameter (an expert's matrix): kept by its own key, read through the
                    # fused parameter's Layout
                    target = conversions.claim(key, f, tuple(stored_slice.get_shape())) if conversions else None
                    name = target or rename(key)
                    if stored_slice.get_dtype() not in FLOAT_DTYPES or (
                            name not in shapes and key.endswith(QUANTISATION_SUFFIXES)):
                        quantised.append(f"{key} ({stored_slice.get_dtype()})")
                    elif name not in shapes and name not in buffers and not also_known(name):
                        unknown.append(key)
                    stored[key if target else name] = (f, key, tuple(stored_slice.get_shape()))
        if quantised:
            raise ConfigError(f"model.path: {directory} holds quantised weights ({len(quantised)} tensors, e.g. "
                              f"{', '.join(quantised[:3])}); the trainer trains from float weights only: "
                              "dequantise them first")
        if unknown:
            raise ConfigError(f"model.path: {len(unknown)} tensors in {directory} are neither a parameter nor a "
                              f"persistent buffer of the model built from its config.json: {', '.join(unknown[:10])}")
        self.converted = conversions.layouts() if conversions else {}
        stored.update({name: (None, None, layout.shape) for name, layout in self.converted.items()})
        problems = [f"{name}: not in the files" if name not in stored else
                    f"{name}: files {list(stored[name][2])}, model {list(shape)}"
                    for name, shape in shapes.items() if stored.get(name, (None, None, shape))[2] != shape]
        problems += [f"{name} (a buffer): files {list(stored[name][2])}, model {list(shape)}"
                     for name, shape in buffers.items() if name in stored and stored[name][2] != shape]
        if problems:
            raise ConfigError(f"model.path: the weights in {directory} do not fit the model built from its "
                              f"config.json ({len(problems)} parameters):\n  " + "\n  ".join(problems[:10]))
        # each parameter's stored tensors as runs of its flat values: its own tensor, or a converted one's pieces
        self.runs = {name: [(Run(0, math.prod(shape)), (*stored[name][:2], 0, math.prod(shape)))]
                     for name, shape in shapes.items() if name not in self.converted}
        for name, layout in self.converted.items():
            starts = accumulate((numel for *_, numel in layout.pieces), initial=0)
            self.runs[name] = [(Run(start, piece[3]), piece) for start, piece in zip(starts, layout.pieces)]
        stored = {name: found for name, found in stored.items() if name not in self.converted}  # as stored, by key
        self.fingerprint = fingerprint(self.files, {name: list(stored[name][2]) for name in stored},
                                       {name: stored[name][:2] for name in stored})
        self.buffers = {name: stored[name][:2] for name in buffers if name in stored}

    def read_buffer(self, name: str) -> torch.Tensor | None:
        from safetensors import safe_open

        if name not in self.buffers:
            return None
        path, key = self.buffers[name]
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(key)

    def read(self, name: str, start: int, numel: int, block: Block | None = None) -> torch.Tensor:
        # Mapped per read: a map kept open would keep every page read so far in this process's resident memory.
        files: dict[Path, MappedFile] = {}

        def values(path: Path, key: str, begin: int, numel: int) -> torch.Tensor:
            if path not in files:
                files[path] = MappedFile(path)
            return files[path][key][begin:begin + numel]

        return read_part(Run(start, numel, block), ((held, partial(values, *piece)) for held, piece in self.runs[name]))[0]
