"""Models and data by their Hugging Face Hub names (`model.path=Qwen/Qwen2.5-0.5B`,
`data.path=org/dataset`), as transformers and datasets take them: resolved to a snapshot folder of
the Hugging Face cache (`$HF_HOME/hub`, or `$HF_HUB_CACHE`) with huggingface_hub's own
`snapshot_download`, which downloads what the cache lacks, honours `HF_HUB_OFFLINE=1` and the
token of `hf auth login` / `HF_TOKEN`. The rest of the trainer then reads a local folder, as before.

A name is resolved before any rank starts (the launching process of nproc=N), or under an external
launcher by every process before the process group is up, so a download never runs inside a
collective's timeout. The processes of a node take turns on a lock file in the cache: the first
downloads, the others then find the files there (one download per node; a shared cache, once).
"""
from __future__ import annotations

import fcntl
import re
from pathlib import Path

from trainer.errors import ConfigError
from trainer.extras import require_hf
from trainer.log import log

# owner/name, as the Hub spells repository ids (letters, digits, `-`, `_`, `.`)
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a model=hf run reads: config, weights (safetensors only), tokenizer and generation files.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# What data=hf|chat read (trainer/data/tokenized.py: BUILDERS), and a save_to_disk folder's files.
DATA_FILES = ["*.parquet", "*.jsonl", "*.json", "*.csv", "*.txt", "*.arrow"]


def is_hub_name(value: str | None) -> bool:
    """A repository id that is not a local path: `org/name` with no such file or folder here."""
    return bool(value) and REPO_ID.fullmatch(value) is not None and not Path(value).exists()


def local_folder(name: str, key: str, repo_type: str = "model", revision: str | None = None) -> str:
    """The snapshot folder of Hub repository `name` (`revision`: a branch, tag or commit; None: main)
    in the Hugging Face cache, downloaded into it where it is not there yet. Every failure (offline
    and not cached, no such repository or revision, a gated one without access) is one line that
    names `key`."""
    require_hf(key, "huggingface_hub")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{name}@{revision}" if revision else name
    cache = Path(constants.HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    lock_path = cache / f".trainer-{repo_type}s--{name.replace('/', '--')}.lock"
    patterns = MODEL_FILES if repo_type == "model" else DATA_FILES
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's first process downloads; the others wait here
        try:
            return snapshot_download(name, repo_type=repo_type, revision=revision, allow_patterns=patterns)
        except GatedRepoError:
            raise ConfigError(f"{key}: {at} is a gated repository on the Hugging Face Hub: accept its terms on its "
                              "page, then log in (hf auth login) or set HF_TOKEN") from None
        except RevisionNotFoundError:
            raise ConfigError(f"{key}: the Hugging Face Hub repository {name} has no revision {revision!r}") from None
        except RepositoryNotFoundError:
            raise ConfigError(f"{key}: {name} is neither a local path nor a {repo_type} repository on the Hugging Face "
                              "Hub (or a private one: log in with hf auth login, or set HF_TOKEN)") from None
        except LocalEntryNotFoundError:
            why = ("HF_HUB_OFFLINE=1 forbids a download" if constants.HF_HUB_OFFLINE else
                   "and the Hub could not be reached")
            raise ConfigError(f"{key}: {at} is not a local path, the Hugging Face cache ({cache}) has no copy of it, "
                              f"{why}") from None
        except OSError as e:  # the network, the disk: huggingface_hub's own words, on one line
            raise ConfigError(f"{key}: {at} could not be fetched from the Hugging Face Hub: "
                              f"{' '.join(str(e).split())}") from None


def resolve_names(cfg, data_too: bool = True) -> None:
    """Replace the Hub names among the settings that name folders (model.path, data.path,
    data.val_path, data.tokenizer, a mixture source's path and val_path) with their snapshot
    folders, in `cfg` (Hydra's, which the ranks get): everything after reads local files.
    `model.revision` / `data.revision` pick the revision. `data_too=False`: the model alone (the
    planner reads no data)."""
    model, data = cfg.model, cfg.data
    if model.get("kind") == "hf" and is_hub_name(model.get("path")):
        name = model.path
        model.path = local_folder(name, "model.path", "model", model.get("revision"))
        if not any(Path(model.path).glob("*.safetensors")):  # *.bin alone: nothing the trainer reads was fetched
            raise ConfigError(f"model.path: the Hugging Face Hub repository {name} has no *.safetensors weights; "
                              "the trainer reads safetensors only")
        log.info(f"model.path: {name} is {model.path}")
    if data_too and is_hub_name(data.get("tokenizer")):  # a tokenizer's repository is a model repository
        data.tokenizer = local_folder(data.tokenizer, "data.tokenizer", "model")
    if not data_too:
        return
    # the data sets read with `datasets` (tokenized.py); a mixture's sources of those kinds
    read = ("hf", "chat", "preference")
    folders = [(data, "data")] if data.get("name") in read else []
    folders += [(source, f"data.sources[{i}]") for i, source in enumerate(data.get("sources") or [])
                if source.get("kind") in read]
    for node, where in folders:
        for key in ("path", "val_path"):
            if is_hub_name(node.get(key)):
                name = node[key]
                node[key] = local_folder(name, f"{where}.{key}", "dataset", data.get("revision"))
                log.info(f"{where}.{key}: {name} is {node[key]}")
