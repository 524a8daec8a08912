"""Models from the Hugging Face Hub: `org/name[@revision]` ids, their snapshots in the HF cache, downloads.

A model is downloaded into the Hugging Face cache layout (`models--org--name/snapshots/<commit>`) with
`huggingface_hub`, which reads `HF_TOKEN`, `HF_ENDPOINT` and proxy settings itself. Only the files the
engine reads are fetched: config.json, generation_config.json, the tokenizer and chat template files,
and the safetensors weights (the index and its shards, else model.safetensors, else the top-level
*.safetensors); never .bin, .pt or .gguf. Offline (`offline=True`, `HF_HUB_OFFLINE=1`) the cache
alone is used.

Torch-free, so `superinfer download` (an init container filling a shared model cache) starts fast.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HF_PREFIX = "hf://"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Everything besides the weights that the loader, ModelConfig and Tokenizer read from a model folder.
METADATA_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    INDEX_FILE,
)
_OFFLINE_VALUES = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub counts as true
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
# A bare Hub id: `org/name`, optionally `@revision`; both parts as the Hub allows them.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[^\s@]+)?")


class ModelDownloadError(RuntimeError):
    """The Hub refused the model or could not be reached; the message says what to do about it."""


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: `repo` is `org/name`; `revision` a branch, tag or commit (None: the default branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo}" + (f"@{self.revision}" if self.revision else "")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` reads as a bare Hub id, `org/name[@revision]`."""
    return _REPO_ID.fullmatch(spec) is not None


def parse_hf_id(ref: str) -> HubRef:
    """`org/name[@revision]` (the part after `hf://`) as a HubRef."""
    repo, _, revision = ref.partition("@")
    if not repo or repo.count("/") > 1 or repo.startswith("/") or repo.endswith("/") or (not revision and "@" in ref):
        raise ValueError(f"bad hf:// model id {ref!r}; expected hf://org/name[@revision]")
    return HubRef(repo, revision or None)


def hub_ref(spec: str, revision: str | None = None) -> HubRef:
    """The HubRef of `hf://org/name[@rev]` or a bare `org/name[@rev]`, with `revision` (--revision) merged in."""
    if spec.startswith(HF_PREFIX):
        ref = parse_hf_id(spec.removeprefix(HF_PREFIX))
    elif is_repo_id(spec):
        ref = parse_hf_id(spec)
    else:
        raise ValueError(f"{spec!r} is not a Hugging Face model id; expected org/name or hf://org/name[@revision]")
    if revision and ref.revision and revision != ref.revision:
        raise ValueError(f"{spec!r} names revision {ref.revision!r} but --revision says {revision!r}; give one")
    return HubRef(ref.repo, ref.revision or revision or None)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, resolved the way huggingface_hub does."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).expanduser() / "huggingface" / "hub"


def offline_mode(offline: bool = False) -> bool:
    """`offline`, or HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return offline or env.upper() in _OFFLINE_VALUES


def repo_cache_dir(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}"


def shard_names(index: Path) -> list[str]:
    """The safetensors files that `model.safetensors.index.json` maps tensors to."""
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: from model.safetensors.index.json, else model.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        files = [path / n for n in shard_names(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no safetensors weights in {path} (pytorch .bin checkpoints are not supported)")


def cached_snapshot(ref: HubRef, cache: Path) -> Path:
    """Snapshot folder of `ref` in the HF cache `cache`, without any network access."""
    repo_dir = repo_cache_dir(cache, ref.repo)
    hint = (
        f"{HF_PREFIX}{ref.repo} is not in the local Hugging Face cache ({cache}) and the Hub is not contacted "
        "offline (--offline or HF_HUB_OFFLINE=1). Download it where there is network access "
        f"(`superinfer download --model {ref} --download-dir {cache}`, or `hf download {ref.repo}` with "
        "HF_HUB_CACHE pointing at this cache), or pass a local model folder."
    )
    if not repo_dir.is_dir():
        raise FileNotFoundError(hint)
    snapshots = repo_dir / "snapshots"
    available = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    ref_file = repo_dir / "refs" / (ref.revision or "main")
    if ref_file.is_file():
        snapshot = snapshots / ref_file.read_text().strip()
    elif ref.revision and (snapshots / ref.revision).is_dir():
        snapshot = snapshots / ref.revision
    elif not ref.revision and len(available) == 1:
        snapshot = snapshots / available[0]
    else:
        wanted = ref.revision or "main"
        raise FileNotFoundError(f"revision {wanted!r} of hf://{ref.repo} is not in the local cache; have {available}")
    if not (snapshot / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{snapshot} has no config.json (incomplete download?). {hint}")
    return snapshot


def resolve_hf(ref: str, cache: Path | None = None) -> Path:
    """Snapshot folder of `org/name[@revision]` in the local HF cache (revision: branch, tag or commit)."""
    return cached_snapshot(parse_hf_id(ref), cache or hf_hub_cache())


def _snapshot(repo: str, revision: str | None, cache: Path, allow: list[str], ignore: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download

    kwargs = {"cache_dir": cache, "allow_patterns": allow, "ignore_patterns": ignore, "library_name": "superinfer"}
    return Path(snapshot_download(repo, revision=revision, **kwargs))


def _fetch(ref: HubRef, cache: Path) -> Path:
    # The metadata first: it pins the commit (the snapshot folder's name) and holds the index that
    # says which shards to fetch, so a repo carrying other checkpoints too (consolidated.safetensors,
    # original/*) costs only what the loader reads.
    snapshot = _snapshot(ref.repo, ref.revision, cache, list(METADATA_FILES))
    if not (snapshot / CONFIG_FILE).is_file():
        return snapshot  # not a transformers model: download() says so before any weights are fetched
    commit = snapshot.name
    if (snapshot / INDEX_FILE).is_file():
        _snapshot(ref.repo, commit, cache, shard_names(snapshot / INDEX_FILE))
        return snapshot
    _snapshot(ref.repo, commit, cache, [SINGLE_FILE])
    if not (snapshot / SINGLE_FILE).is_file():
        _snapshot(ref.repo, commit, cache, ["*.safetensors"], ignore=["*/*"])  # top level only
    return snapshot


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _token_hint() -> str:
    from huggingface_hub import get_token

    if get_token():
        return "the Hugging Face token in use (HF_TOKEN, else the saved login) has no access to it"
    return "no Hugging Face token is set: set HF_TOKEN to the token of an account with access"


def _explain(exc: BaseException, ref: HubRef, cache: Path) -> str:
    """What went wrong fetching `ref`, and what to do, from a huggingface_hub error."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = constants.ENDPOINT
    chain = _chain(exc)
    http = next((e for e in chain if isinstance(e, HfHubHTTPError)), None)
    status = http.response.status_code if http is not None and http.response is not None else None
    if isinstance(http, GatedRepoError):
        return (
            f"{ref} is a gated model (HTTP {status}): accept its terms at {endpoint}/{ref.repo} while logged in; "
            f"{_token_hint()}"
        )
    if isinstance(http, RevisionNotFoundError):
        return f"{ref}: revision {ref.revision!r} does not exist in {ref.repo} on {endpoint} (HTTP {status})"
    if isinstance(http, RepositoryNotFoundError) or status == 401:
        return (
            f"{ref} was not found on {endpoint} (HTTP {status}): check the name; if the model is private or "
            f"gated, {_token_hint()}"
        )
    if status == 403:
        return f"{endpoint} refused access to {ref} (HTTP 403): {_token_hint()}"
    if http is not None:
        return f"{endpoint} answered HTTP {status} for {ref}: {str(http).splitlines()[0]}"
    disk = next((e for e in chain if isinstance(e, OSError) and e.errno in _DISK_ERRNOS), None)
    if disk is not None:
        return f"could not write {ref} into the cache {cache}: {disk}"
    # The Hub library wraps the failure (connect error, timeout, proxy...) in its own errors.
    cause = next((e for e in chain if not type(e).__module__.startswith("huggingface_hub")), chain[-1])
    return (
        f"could not download {ref}: the Hugging Face Hub at {endpoint} could not be reached "
        f"({type(cause).__name__}: {cause}) and the model is not (completely) in the cache {cache}. Check the "
        "network (HF_ENDPOINT, HTTPS_PROXY), or download it where there is network access "
        f"(`superinfer download --model {ref} --download-dir <cache>`) and serve from that cache with --offline."
    )


def download(ref: HubRef, cache: Path) -> Path:
    """Snapshot folder of `ref` in `cache`, downloading what the engine reads unless it is already there.

    When the Hub cannot be reached, a complete cached snapshot is used as it is.
    """
    log.info("fetching %s into the Hugging Face cache %s", ref, cache)
    try:
        snapshot = _fetch(ref, cache)
    except Exception as exc:
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(exc, ValueError) and not isinstance(exc, HfHubHTTPError):
            raise  # a malformed id or argument: the message is already about the input
        raise ModelDownloadError(_explain(exc, ref, cache)) from exc
    if not (snapshot / CONFIG_FILE).is_file():
        raise ModelDownloadError(f"{ref} has no config.json at commit {snapshot.name}; is it a transformers model?")
    try:
        weight_files(snapshot)
    except FileNotFoundError as exc:
        if (snapshot / INDEX_FILE).is_file():
            raise ModelDownloadError(f"{ref}: {exc}") from exc
        raise ModelDownloadError(
            f"{ref} has no safetensors weights at commit {snapshot.name} (SuperInfer loads safetensors only; "
            ".bin, .pt and .gguf checkpoints are not supported)"
        ) from exc
    return snapshot


def model_snapshot(ref: HubRef, *, cache_dir: str | Path | None = None, offline: bool = False) -> Path:
    """Local folder of `ref`: from the cache offline, else downloaded into it when missing or stale.

    `cache_dir` (--download-dir) overrides the Hugging Face cache folder.
    """
    cache = (Path(cache_dir).expanduser() if cache_dir else hf_hub_cache()).absolute()
    if offline_mode(offline):
        return cached_snapshot(ref, cache)
    return download(ref, cache)
