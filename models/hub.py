"""`--model ORG/NAME[@REVISION]`: a Hugging Face hub id, resolved to a checkpoint directory in the
local hub cache.

Offline (`HF_HUB_OFFLINE=1`, or when the hub cannot be reached) the snapshot comes from the cache
alone. Online the files a checkpoint is served from are fetched into the cache first, with
progress through the `ProgressSink`: configs, the tokenizer, the chat template and safetensors
weights at the top of the repository. Nothing else is ever fetched: no pickled weights (`.bin`,
`.pt`), no code (`.py`), no subfolders (`original/` copies of the weights).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.progress import ProgressSink, task
from models.registry import ModelLoadError

log = logging.getLogger(__name__)

# What a checkpoint directory is served from (models/checkpoint.py, models/hf_tokenizer.py).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
)
# fnmatch's `*` crosses `/`: this keeps every pattern to the repository's top level.
IGNORE_PATTERNS = ("*/*",)
FETCH_HINT = "--include '*.json' --include '*.safetensors' --include '*.jinja' --exclude '*/*'"

# The hub's own rules: letters, digits, '-', '_', '.'; one '/' between owner and name.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True, slots=True)
class HubRef:
    repo_id: str
    revision: str | None

    @property
    def spelled(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    def fetch_command(self) -> str:
        revision = "" if self.revision is None else f" --revision {self.revision}"
        return f"hf download {self.repo_id}{revision} {FETCH_HINT}"


def parse_hub_id(spec: str) -> HubRef | None:
    """`ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit); None for anything else."""
    repo_id, at, revision = spec.partition("@")
    if not _HUB_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id or (at and not revision):
        return None
    return HubRef(repo_id, revision or None)


def hub_cache_dir() -> Path:
    """The hub cache as huggingface-hub finds it, read now (a test or a shell may set it late)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(env["HF_HUB_CACHE"])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ
    flags = (env.get("HF_HUB_OFFLINE", ""), env.get("TRANSFORMERS_OFFLINE", ""))
    return bool(constants.HF_HUB_OFFLINE) or any(flag.strip().lower() in _TRUE for flag in flags)


def resolve_hub_checkpoint(spec: str, progress: ProgressSink) -> Path | None:
    """The cached snapshot directory `spec` names, fetched first when online; None when `spec` is
    not a hub id. Raises `ModelLoadError` (one line) when the snapshot cannot be had."""
    ref = parse_hub_id(spec)
    if ref is None:
        return None
    cache = hub_cache_dir()
    reason = "HF_HUB_OFFLINE is set"
    if not hub_offline():
        try:
            _fetch(ref, cache, progress)
        except _not_found_errors() as exc:
            raise ModelLoadError(
                f"--model {ref.spelled}: the hub has no such model or revision, or it is gated "
                f"(`hf auth login` for a gated one): {_one_line(exc)}"
            ) from exc
        except _unreachable_errors() as exc:
            reason = f"the hub could not be reached ({type(exc).__name__}: {_one_line(exc)})"
            log.warning("%s: %s; looking in the cache %s", ref.spelled, reason, cache)
    return _cached(ref, cache, reason)


def _cached(ref: HubRef, cache: Path, reason: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=str(cache),
            local_files_only=True,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except LocalEntryNotFoundError as exc:
        incomplete = type(exc).__name__ == "IncompleteSnapshotError"
        state = "is incomplete in" if incomplete else "is not in"
        raise ModelLoadError(
            f"--model {ref.spelled}: {state} the Hugging Face cache {cache} and {reason}; "
            f"fetch it with `{ref.fetch_command()}`"
        ) from exc
    return Path(found)


def _fetch(ref: HubRef, cache: Path, progress: ProgressSink) -> None:
    """Download the served files into the cache, then record the revision's ref (and the file
    listing) the way `snapshot_download` does, so that a later offline run finds this snapshot."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    info = HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
    wanted = sorted(
        filter_repo_objects(sizes, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS))
    )
    if not any(name.endswith(".safetensors") for name in wanted):
        raise ModelLoadError(
            f"--model {ref.spelled}: the repository has no safetensors weights at its top level "
            "(infer loads no pickled .bin/.pt weights)"
        )
    with task(progress, f"{ref.repo_id}: {len(wanted)} files", sum(sizes[n] for n in wanted)):
        for name in wanted:
            reported = [0]
            hf_hub_download(
                ref.repo_id,
                name,
                revision=info.sha,
                cache_dir=str(cache),
                tqdm_class=_sink_bar(progress, name, reported),
            )
            # A file already in the cache reports nothing: count it whole once it is there.
            progress.advance(name, sizes[name] - reported[0])
    snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=str(cache), allow_patterns=wanted)


def _sink_bar(progress: ProgressSink, filename: str, reported: list[int]) -> type:
    """A tqdm stand-in that hands a file's downloaded bytes to `progress`. huggingface-hub builds
    its bar from the class it is given and calls tqdm's drawing methods on it as well: those do
    nothing here. `update_transfer` marks it as one bar for both network and disk bytes (only the
    bytes written, `update`, are counted)."""

    class SinkBar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = 0
            self.total = kwargs.get("total")

        def __enter__(self) -> SinkBar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            amount = int(n or 0)
            self.n += amount
            reported[0] += amount
            progress.advance(filename, amount)

        def update_transfer(self, n: float | None = 1) -> None:
            pass

        def close(self) -> None:
            pass

        def __getattr__(self, name: str) -> Callable[..., None]:
            return _ignore

    return SinkBar


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _not_found_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    return (RepositoryNotFoundError, RevisionNotFoundError)


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """Errors after which the cache may still serve: the hub down or refusing (OSError covers
    huggingface-hub's HTTP errors and its offline error), or no connection at all, which it
    raises as its HTTP client's own transport error (httpx2 in huggingface-hub 2, httpx in 1)."""
    errors: list[type[BaseException]] = [OSError]
    for module_name in ("httpx2", "httpx"):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        transport = getattr(module, "TransportError", None)
        if isinstance(transport, type) and issubclass(transport, BaseException):
            errors.append(transport)
    return tuple(errors)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
