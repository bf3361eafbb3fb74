"""`--model ORG/NAME[@REVISION]` against a hub cache the test builds itself, offline: the snapshot
`refs/<revision>` names is served; a miss is one line naming the id, the cache and the command
that fetches it; a directory that exists wins over a hub id."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import EngineConfig
from engine.progress import SILENT
from infer_cli.main import app
from models.hub import ALLOW_PATTERNS, IGNORE_PATTERNS, parse_hub_id, resolve_hub_checkpoint
from models.registry import ModelLoadError, ModelOptions, load_model

MAIN = "0" * 39 + "1"
V2 = "0" * 39 + "2"
OPTIONS = ModelOptions(engine=EngineConfig(num_kv_pages=32), device="cpu")


def _snapshot(cache: Path, repo_id: str, commit: str, checkpoint: Path, *refs: str) -> Path:
    """The hub cache layout: files in blobs/, the snapshot's entries link to them, refs/ name
    commits."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for source in sorted(checkpoint.iterdir()):
        blob = repo / "blobs" / f"{commit[-4:]}-{source.name}"
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    return cache


def test_parse_hub_id() -> None:
    ref = parse_hub_id("Qwen/Qwen3-4B")
    assert ref is not None and (ref.repo_id, ref.revision) == ("Qwen/Qwen3-4B", None)
    ref = parse_hub_id("google/gemma-3-270m@refs/pr/1")
    assert ref is not None and (ref.repo_id, ref.revision) == ("google/gemma-3-270m", "refs/pr/1")
    for not_an_id in ("sim", "gpt2", "a/b/c", "/abs/path", "./rel", "a/b@", "a--b/c", "a/b..c", "a b/c"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_only_configs_tokenizer_and_safetensors_are_fetched() -> None:
    from huggingface_hub.utils import filter_repo_objects

    listing = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "consolidated.pt",
        "modeling_custom.py",
        "tokenizer.model",
        "original/model.safetensors",
        "original/params.json",
        "README.md",
        ".gitattributes",
    ]
    fetched = set(
        filter_repo_objects(
            listing, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)
        )
    )
    assert fetched == set(listing[:9])


def test_a_cached_hub_id_serves_offline(offline_cache: Path, tiny_qwen3: Path) -> None:
    _snapshot(offline_cache, "acme/tiny-qwen3", MAIN, tiny_qwen3, "main")
    loaded = load_model("acme/tiny-qwen3", OPTIONS)
    assert loaded.name == "acme/tiny-qwen3"
    from infer_cli.http.app import ServerSettings, create_app
    from infer_cli.http.server import BackgroundServer

    with BackgroundServer(create_app(loaded, ServerSettings(served_model_name=loaded.name))) as server:
        import httpx

        body = {"model": "acme/tiny-qwen3", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 3, answer


def test_revision_picks_its_snapshot(offline_cache: Path, tiny_qwen3: Path, tiny_gemma4: Path) -> None:
    main = _snapshot(offline_cache, "acme/tiny", MAIN, tiny_qwen3, "main")
    v2 = _snapshot(offline_cache, "acme/tiny", V2, tiny_gemma4, "v2")
    assert resolve_hub_checkpoint("acme/tiny", SILENT) == main
    assert resolve_hub_checkpoint("acme/tiny@main", SILENT) == main
    assert resolve_hub_checkpoint("acme/tiny@v2", SILENT) == v2
    assert resolve_hub_checkpoint(f"acme/tiny@{V2}", SILENT) == v2
    # The gemma4 snapshot: its tokenizer prepends <bos> (id 2), the qwen3 one has none.
    loaded = load_model("acme/tiny@v2", OPTIONS)
    assert loaded.name == "acme/tiny@v2" and loaded.tokenizer.encode("hi")[0] == 2
    with pytest.raises(ModelLoadError, match=r"acme/tiny@v3: is not in the Hugging Face cache"):
        load_model("acme/tiny@v3", OPTIONS)


def test_an_offline_miss_is_one_line_naming_id_cache_and_command(offline_cache: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model("Qwen/Qwen3-4B", OPTIONS)
    message = str(caught.value)
    assert "\n" not in message
    assert "Qwen/Qwen3-4B" in message and str(offline_cache) in message
    assert "HF_HUB_OFFLINE" in message and "hf download Qwen/Qwen3-4B --include" in message
    with pytest.raises(ModelLoadError, match=r"hf download Qwen/Qwen3-4B --revision v1\.0 "):
        load_model("Qwen/Qwen3-4B@v1.0", OPTIONS)


def test_infer_serve_reports_an_offline_miss(offline_cache: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", "Qwen/Qwen3-4B", "--port", "0"])
    assert result.exit_code == 2
    flat = " ".join(result.output.split())
    assert "Qwen/Qwen3-4B: is not in the Hugging Face cache" in flat and "hf download Qwen/Qwen3-4B" in flat


def test_a_directory_that_exists_wins_over_the_hub_id(offline_cache: Path, tiny_qwen3: Path) -> None:
    # The cached snapshot would load; the directory ./acme/tiny names a model type none serves, so
    # its refusal shows which of the two was taken.
    _snapshot(offline_cache, "acme/tiny", MAIN, tiny_qwen3, "main")
    local = Path("acme/tiny")
    shutil.copytree(tiny_qwen3, local)
    (local / "config.json").write_text(
        (local / "config.json").read_text().replace('"qwen3"', '"no-such-type"')
    )
    with pytest.raises(ModelLoadError, match=r"acme/tiny: model_type 'no-such-type'"):
        load_model("acme/tiny", OPTIONS)


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path: Path) -> None:
    """Online, but the endpoint refuses connections (a loopback port nothing listens on)."""
    import socket
    import subprocess
    import sys

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--x" / "snapshots" / MAIN
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--acme--x" / "refs").mkdir()
    (cache / "models--acme--x" / "refs" / "main").write_text(MAIN)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HUB_CACHE=str(cache), HF_HUB_ETAG_TIMEOUT="5")
    script = (
        "from engine.progress import SILENT\n"
        "from models.hub import resolve_hub_checkpoint\n"
        "from models.registry import ModelLoadError\n"
        "print(resolve_hub_checkpoint('acme/x', SILENT))\n"
        "try:\n    resolve_hub_checkpoint('acme/y', SILENT)\n"
        "except ModelLoadError as exc:\n    print(exc)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    found, miss = run.stdout.splitlines()
    assert Path(found) == snapshot, run.stderr
    assert "acme/y: is not in the Hugging Face cache" in miss and "the hub could not be reached" in miss
    assert "could not be reached" in run.stderr, "the fallback is logged"


class _Sibling:
    def __init__(self, name: str, size: int) -> None:
        self.rfilename, self.size = name, size


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self.started: list[tuple[str, float]] = []

    def start(self, label: str, total: float) -> None:
        self.started.append((label, total))

    def advance(self, detail: str = "", amount: float = 1) -> None:
        self.events.append((detail, amount))

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        pass


def test_online_fetch_takes_only_served_files_with_byte_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download step against a stand-in for huggingface-hub's network calls: which files are
    asked for, and the progress the sink hears (bytes as they arrive; a cached file whole)."""
    import huggingface_hub

    listing = {
        "config.json": 100,
        "model.safetensors": 1000,
        "pytorch_model.bin": 1000,
        "setup.py": 10,
        "tokenizer.json": 50,
    }
    asked: list[str] = []
    snapshots: list[dict[str, object]] = []

    class FakeApi:
        def model_info(self, repo_id: str, revision: str | None, files_metadata: bool) -> object:
            assert (repo_id, revision, files_metadata) == ("acme/x", None, True)
            return type("Info", (), {"sha": MAIN, "siblings": [_Sibling(n, s) for n, s in listing.items()]})

    def fake_download(repo_id: str, filename: str, *, revision: str, cache_dir: str, tqdm_class: type) -> str:
        asked.append(filename)
        assert revision == MAIN and cache_dir == str(tmp_path)
        if filename == "model.safetensors":  # streamed in two chunks; the others are cached
            with tqdm_class(total=listing[filename], desc=filename) as bar:
                bar.update(600)
                bar.set_postfix_str("1 MB/s")
                bar.update(400)
        return str(tmp_path / filename)

    def fake_snapshot(repo_id: str, **kwargs: object) -> str:
        snapshots.append(kwargs)
        return str(tmp_path)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    progress = _Recorder()
    assert resolve_hub_checkpoint("acme/x", progress) == tmp_path

    assert asked == ["config.json", "model.safetensors", "tokenizer.json"]
    assert progress.started == [("acme/x: 3 files", 1150)]
    assert [e for e in progress.events if e[1]] == [
        ("config.json", 100),
        ("model.safetensors", 600),
        ("model.safetensors", 400),
        ("tokenizer.json", 50),
    ]
    # Then the ref is recorded for the fetched files, and the snapshot found as an offline run would.
    recorded, found = snapshots
    assert recorded["allow_patterns"] == asked and recorded["revision"] is None
    assert found["local_files_only"] is True
