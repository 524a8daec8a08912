"""Models from the Hugging Face Hub: downloads against a local stand-in for the Hub's HTTP API.

The stand-in implements the few endpoints huggingface_hub calls to download a snapshot (model info,
the file tree, HEAD/GET of /resolve/) with the headers it checks, and answers 401/403/404 the way the
Hub does (X-Error-Code). The library itself is not mocked: in-process tests point it at the stand-in
by its endpoint constants (read from HF_ENDPOINT at import), the CLI test by HF_ENDPOINT in a subprocess.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file, save_file

from superinfer.cli.main import build_parser, main
from superinfer.engine.download import (
    METADATA_FILES,
    HubRef,
    ModelDownloadError,
    hf_hub_cache,
    hub_ref,
    is_repo_id,
    model_snapshot,
)
from superinfer.engine.engine import EngineCore
from superinfer.engine.flags import engine_config
from superinfer.engine.model.loader import load_model
from superinfer.engine.model.tiny import ensure_tiny_model

TOKEN = "hf_test_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    tags: dict[str, str] = field(default_factory=dict)  # tag -> commit
    private: bool = False  # only TOKEN sees it
    gated: bool = False  # metadata public, files for TOKEN only


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class StandInHub:
    """The Hub endpoints of a snapshot download, over `repos`; every request is recorded."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._model_info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def add(self, repo: str, files: dict[str, bytes], **kw: object) -> Repo:
        sha = hashlib.sha1(repo.encode() + json.dumps(sorted(files)).encode()).hexdigest()
        self.repos[repo] = Repo(files, sha, **kw)  # type: ignore[arg-type]
        return self.repos[repo]

    def file_requests(self) -> list[Request]:
        return [r for r in self.requests if "/resolve/" in r.path]

    # --- the Hub's answers -----------------------------------------------------------------
    @staticmethod
    def _error(status: int, code: str, message: str, **headers: str) -> web.HTTPException:
        kind = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound}[status]
        return kind(text=message, headers={"X-Error-Code": code, "X-Error-Message": message, **headers})

    def _lookup(self, request: web.Request, for_files: bool) -> tuple[str, Repo, str]:
        """(repo id, repo, commit) of a request, or the HTTP error the Hub answers with."""
        self.requests.append(Request(request.method, request.path, request.headers.get("Authorization")))
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        authorized = request.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo is None or (repo.private and not authorized):
            # As the Hub: 401 to anonymous callers (the repo may exist), 404 to authenticated ones.
            status = 404 if "Authorization" in request.headers else 401
            raise self._error(status, "RepoNotFound", "Repository not found")
        if repo.gated and for_files and not authorized:
            status = 403 if "Authorization" in request.headers else 401
            raise self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted.")
        rev = request.match_info["rev"]
        commit = (
            repo.sha if rev in ("main", repo.sha) else repo.tags.get(rev, rev if rev in repo.tags.values() else None)
        )
        if commit is None:
            raise self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo_id, repo, commit

    async def _model_info(self, request: web.Request) -> web.Response:
        repo_id, repo, commit = self._lookup(request, for_files=False)
        siblings = [{"rfilename": name} for name in sorted(repo.files)]
        return web.json_response(
            {"id": repo_id, "sha": commit, "siblings": siblings, "private": repo.private, "gated": repo.gated}
        )

    async def _tree(self, request: web.Request) -> web.Response:
        _, repo, _ = self._lookup(request, for_files=False)
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for name, data in sorted(repo.files.items())
        ]
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        _, repo, commit = self._lookup(request, for_files=True)
        data = repo.files.get(request.match_info["path"])
        if data is None:
            raise self._error(404, "EntryNotFound", "Entry not found", **{"X-Repo-Commit": commit})
        etag = hashlib.sha256(data).hexdigest()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"'}
        if request.method == "HEAD":
            response = web.StreamResponse(headers={**headers, "X-Linked-Size": str(len(data))})
            response.content_length = len(data)
            await response.prepare(request)
            return response
        return web.Response(body=data, headers=headers, content_type="application/octet-stream")

    async def _unknown(self, request: web.Request) -> web.Response:
        self.requests.append(Request(request.method, request.path, request.headers.get("Authorization")))
        return web.Response(status=404, text=f"the stand-in hub has no {request.method} {request.path}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("superinfer-cache"))


@pytest.fixture(scope="module")
def tiny_files(tiny_dir: Path) -> dict[str, bytes]:
    """The built-in tiny model's folder, which the stand-in hub serves as repos."""
    return {f.name: f.read_bytes() for f in tiny_dir.iterdir()}


def sharded(files: dict[str, bytes], tmp: Path) -> dict[str, bytes]:
    """`files` with model.safetensors split into two shards and an index."""
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(files["model.safetensors"])
    tensors = load_file(tmp / "model.safetensors")
    names = sorted(tensors)
    out = {k: v for k, v in files.items() if k != "model.safetensors"}
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp / shard), metadata={"format": "pt"})
        out[shard] = (tmp / shard).read_bytes()
        weight_map.update(dict.fromkeys(part, shard))
    out["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return out


def point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """What HF_ENDPOINT does when huggingface_hub is imported: its endpoint and the file URL template."""
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[StandInHub]:
    """A running stand-in hub that this process's huggingface_hub talks to, with no token and no login."""
    stand_in = StandInHub()
    await stand_in.start()
    point_hf_at(monkeypatch, stand_in.url)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    yield stand_in
    await stand_in.runner.cleanup()


async def fetch(ref: HubRef, cache: Path, offline: bool = False) -> Path:
    return await asyncio.to_thread(model_snapshot, ref, cache_dir=cache, offline=offline)


def tensors_of(spec: str, **kw: object) -> dict[str, torch.Tensor]:
    return dict(load_model(spec, **kw).model.checkpoint_tensors())  # type: ignore[arg-type]


def cached_files(snapshot: Path) -> set[str]:
    return {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------------------------
# The command line, end to end: `superinfer download` as the operator's init container runs it.


def run_download(hub_url: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("superinfer", path=str(Path(sys.executable).parent)) or "superinfer"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_ENDPOINT": hub_url, "HF_TOKEN": TOKEN, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run([exe, "download", *args], env=env, capture_output=True, text=True, timeout=60)


async def test_download_command_then_serve_offline_from_the_download_dir(
    hub: StandInHub, tiny_dir: Path, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    repo = hub.add("acme/tiny", {**tiny_files, "README.md": b"# tiny\n"}, private=True)
    cache = tmp_path / "model-cache"
    args = ("--model", "hf://acme/tiny", "--download-dir", str(cache))

    first = await asyncio.to_thread(run_download, hub.url, tmp_path / "home", *args)
    assert first.returncode == 0, first.stderr
    snapshot = Path(first.stdout.strip())
    assert snapshot == cache / "models--acme--tiny" / "snapshots" / repo.sha
    assert cached_files(snapshot) == set(tiny_files)  # README.md is not read by the engine
    assert hub.requests and {r.authorization for r in hub.requests} == {f"Bearer {TOKEN}"}  # HF_TOKEN

    hub.requests.clear()
    again = await asyncio.to_thread(run_download, hub.url, tmp_path / "home", *args)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert hub.file_requests() == []  # everything was cached: no HEAD or GET of a file

    # `superinfer serve --model acme/tiny --download-dir ... --offline`, up to a loaded engine.
    hub.requests.clear()
    config = engine_config(
        build_parser().parse_args(["serve", "--model", "acme/tiny", "--download-dir", str(cache), "--offline"]),
        device="cpu",
        max_model_len=256,
        num_gpu_blocks=16,
    )
    core = await asyncio.to_thread(EngineCore, config)
    assert core.model_path == snapshot and core.tokenizer is not None
    assert hub.requests == []
    expected = tensors_of(str(tiny_dir))
    for name, tensor in core.runner.model.checkpoint_tensors():
        torch.testing.assert_close(tensor, expected[name])


async def test_download_command_failure_exits_non_zero_with_the_reason(hub: StandInHub, tmp_path: Path) -> None:
    result = await asyncio.to_thread(
        run_download, hub.url, tmp_path / "home", "--model", "acme/absent", "--download-dir", str(tmp_path / "c")
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "hf://acme/absent was not found" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------------------------
# What is downloaded, and from where.


async def test_only_the_files_the_engine_reads_are_downloaded(
    hub: StandInHub, tiny_dir: Path, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    files = sharded(tiny_files, tmp_path / "shards")
    extras = {
        "consolidated.safetensors": b"another copy of the weights",
        "original/model.safetensors": b"and another",
        "pytorch_model.bin": b"pickle",
        "model.gguf": b"gguf",
        "README.md": b"# readme",
    }
    repo = hub.add("acme/sharded", {**files, **extras})
    snapshot = await fetch(HubRef("acme/sharded"), tmp_path)
    assert cached_files(snapshot) == set(files)
    assert not any(name in r.path for r in hub.file_requests() for name in extras)
    assert (tmp_path / "models--acme--sharded" / "refs" / "main").read_text() == repo.sha
    got = tensors_of("hf://acme/sharded", download_dir=str(tmp_path), offline=True)
    expected = tensors_of(str(tiny_dir))
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name])


async def test_revision_pins_a_tag_or_a_commit(hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path) -> None:
    repo = hub.add("acme/tiny", tiny_files, tags={"v1": "0" * 40})
    hub.repos["acme/tiny"].sha = "f" * 40  # main has moved on since v1; both serve the same files here
    snapshot = await fetch(hub_ref("hf://acme/tiny@v1"), tmp_path)
    assert snapshot.name == "0" * 40
    assert (tmp_path / "models--acme--tiny" / "refs" / "v1").read_text() == "0" * 40
    assert await fetch(hub_ref("acme/tiny", "v1"), tmp_path, offline=True) == snapshot  # --revision v1
    assert (await fetch(hub_ref("acme/tiny@" + repo.sha), tmp_path)).name == "f" * 40
    with pytest.raises(ModelDownloadError, match=r"revision 'v2' does not exist"):
        await fetch(hub_ref("acme/tiny@v2"), tmp_path)
    with pytest.raises(ValueError, match="give one"):
        hub_ref("hf://acme/tiny@v1", "v2")


@pytest.mark.parametrize(
    "repo_kw, token, message",
    [
        ({}, None, r"hf://acme/absent was not found on .* \(HTTP 401\).*set HF_TOKEN"),
        ({}, TOKEN, r"hf://acme/absent was not found on .* \(HTTP 404\).*has no access"),
        ({"private": True}, None, r"was not found on .* \(HTTP 401\): check the name.*set HF_TOKEN"),
        ({"gated": True}, None, r"is a gated model \(HTTP 401\).*set HF_TOKEN"),
        ({"gated": True}, "hf_someone_else", r"is a gated model \(HTTP 403\).*token in use .* has no access"),
    ],
    ids=["missing-anonymous", "missing-with-token", "private-without-token", "gated-without-token", "gated-no-access"],
)
async def test_hub_refusals_say_what_to_do(
    hub: StandInHub,
    tiny_files: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    repo_kw: dict[str, bool],
    token: str | None,
    message: str,
) -> None:
    name = "acme/absent"
    if repo_kw:
        name = "acme/locked"
        hub.add(name, tiny_files, **repo_kw)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(ModelDownloadError, match=message):
        await fetch(HubRef(name), tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    if repo_kw:  # the right token opens it
        assert (await fetch(HubRef(name), tmp_path)).name == hub.repos[name].sha


async def test_a_repo_without_safetensors_is_refused(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    hub.add("acme/pickled", {**files, "pytorch_model.bin": b"pickle", "model.gguf": b"gguf"})
    with pytest.raises(ModelDownloadError, match=r"hf://acme/pickled has no safetensors weights .*\.bin, \.pt and"):
        await fetch(HubRef("acme/pickled"), tmp_path)
    assert not any(r.path.endswith((".bin", ".gguf")) for r in hub.file_requests())
    argv = ["serve", "--model", "acme/pickled", "--download-dir", str(tmp_path), "--device", "cpu"]
    assert await asyncio.to_thread(main, argv) == 1
    assert "has no safetensors weights" in capsys.readouterr().err


async def test_an_unreachable_hub_uses_the_cache_or_says_so(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add("acme/tiny", tiny_files)
    snapshot = await fetch(HubRef("acme/tiny"), tmp_path / "cache")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    point_hf_at(monkeypatch, dead)
    assert await fetch(HubRef("acme/tiny"), tmp_path / "cache") == snapshot
    with pytest.raises(ModelDownloadError, match=r"could not be reached \(Connect.*not \(completely\) in the cache"):
        await fetch(HubRef("acme/tiny"), tmp_path / "empty")


# ----------------------------------------------------------------------------------------------
# Offline: the cache alone.


async def test_offline_with_an_empty_cache_names_what_is_missing(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    hub.add("acme/tiny", tiny_files)
    with pytest.raises(FileNotFoundError, match=r"hf://acme/tiny is not in the local Hugging Face cache .*empty"):
        await fetch(HubRef("acme/tiny"), tmp_path / "empty", offline=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="superinfer download --model hf://acme/tiny"):
        await fetch(HubRef("acme/tiny"), tmp_path / "empty")
    assert hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    argv = ["serve", "--model", "acme/tiny", "--offline", "--download-dir", str(tmp_path / "empty"), "--device", "cpu"]
    assert await asyncio.to_thread(main, argv) == 2
    err = capsys.readouterr().err
    assert "'acme/tiny' is not a local folder" in err and "not in the local Hugging Face cache" in err
    assert hub.requests == []


# ----------------------------------------------------------------------------------------------
# Model specs.


def test_which_specs_are_hub_ids() -> None:
    assert is_repo_id("Qwen/Qwen3-8B") and is_repo_id("meta-llama/Llama-3.1-8B-Instruct@main")
    assert not any(is_repo_id(s) for s in ("tiny", "llama-3-8b", "/models/x", "./a/b", "a/b/c", "hf://a/b", "a/b@"))
    assert hub_ref("hf://org/name@v1") == HubRef("org/name", "v1") == hub_ref("org/name", "v1")
    assert str(hub_ref("org/name")) == "hf://org/name"
    with pytest.raises(ValueError, match="not a Hugging Face model id"):
        hub_ref("tiny")
    with pytest.raises(ValueError, match="--revision is for Hugging Face models"):
        load_model("llama-3-8b", device="meta", revision="v1")


def test_the_cache_folder_is_where_huggingface_hub_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert hf_hub_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert hf_hub_cache() == Path("/xdg/huggingface/hub")
    monkeypatch.setenv("HF_HOME", "/models/.hf")  # what the operator sets
    assert hf_hub_cache() == Path("/models/.hf/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/cache")
    assert hf_hub_cache() == Path("/cache")


def test_download_command_refuses_what_is_not_a_hub_id(capsys) -> None:
    assert main(["download", "--model", "/models/llama"]) == 2
    assert "not a Hugging Face model id" in capsys.readouterr().err


def test_metadata_files_are_what_the_engine_reads() -> None:
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(METADATA_FILES)
    assert not any(name.endswith((".bin", ".pt", ".gguf", ".safetensors")) for name in METADATA_FILES)
