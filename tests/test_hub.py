"""`-m org/name`: a Hugging Face Hub id read from the repository's config.json through huggingface_hub,
offline against a fake Hub cache (the snapshot layout huggingface_hub writes), and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from huggingface_hub import errors

from memplan.analytic.params import count_params
from memplan.presets import hub, load_model_preset
from tests.test_hf_config import LLAMA_3_8B

SHA = "8cde5ca8380496c9a6cc7ef3a8b46a0372a1d920"


def fake_cache(root: Path, repo_id: str, files: dict[str, Any]) -> Path:
    """A Hub cache as huggingface_hub lays it out: ``models--org--name/refs/main`` holds the commit,
    ``snapshots/<commit>/`` the files (real caches link them to ``blobs/``; plain files read the same)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        (snapshot / name).write_text(json.dumps(content))
    return root


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    fake_cache(cache, "meta-llama/Meta-Llama-3-8B", {"config.json": LLAMA_3_8B})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no file named like the id
    return cache


def test_hub_id_reads_the_cached_config(offline_cache: Path) -> None:
    preset = load_model_preset("meta-llama/Meta-Llama-3-8B")
    assert preset.name == "meta-llama/Meta-Llama-3-8B" and preset.published_params is None
    assert preset.source == f"https://huggingface.co/meta-llama/Meta-Llama-3-8B (config.json at {SHA})"
    # The same count as the shipped llama-3-8b preset: its model page's 8,030,261,248 (8.03B).
    assert count_params(preset.model).total == 8_030_261_248
    assert (preset.model.num_kv_heads, preset.model.rope_theta) == (8, 500000.0)


def test_only_config_json_is_asked_for(offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    asked: list[tuple[str, str, dict[str, Any]]] = []
    real = huggingface_hub.hf_hub_download

    def spy(repo_id: str, filename: str, **kwargs: Any) -> str:
        asked.append((repo_id, filename, kwargs))
        return str(real(repo_id, filename, **kwargs))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    load_model_preset("meta-llama/Meta-Llama-3-8B")
    assert [(r, f) for r, f, _ in asked] == [("meta-llama/Meta-Llama-3-8B", "config.json")]
    assert asked[0][2] == {"cache_dir": str(offline_cache), "local_files_only": True}


def test_a_file_of_the_same_name_wins(offline_cache: Path) -> None:
    """A relative path that exists is a file, not a Hub id."""
    (offline_cache.parent / "meta-llama").mkdir()
    (offline_cache.parent / "meta-llama" / "Meta-Llama-3-8B").write_text(json.dumps(LLAMA_3_8B))
    assert load_model_preset("meta-llama/Meta-Llama-3-8B").source == "meta-llama/Meta-Llama-3-8B"


@pytest.mark.parametrize(
    ("text", "is_id"),
    [
        ("meta-llama/Meta-Llama-3-8B", True),
        ("Qwen/Qwen3-30B-A3B", True),
        ("google/gemma-2-9b", True),
        ("org/config.json", False),  # a path by its suffix
        ("./org/name", False),
        ("/abs/name", False),
        ("a/b/c", False),
        ("llama-3-8b", False),
    ],
)
def test_what_counts_as_a_hub_id(
    text: str, is_id: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id(text) is is_id


def test_not_cached_offline(offline_cache: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_model_preset("Qwen/Qwen3-8B")
    assert str(info.value) == (
        "model Qwen/Qwen3-8B: config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
        "fetch it once online (`hf download Qwen/Qwen3-8B config.json`) or pass a config.json path"
    )


def _raising(exc: Exception) -> Any:
    def download(*args: object, **kwargs: object) -> str:
        raise exc

    return download


def _http(cls: type[errors.HfHubHTTPError], status: int) -> errors.HfHubHTTPError:
    response = httpx.Response(status, request=httpx.Request("HEAD", "https://huggingface.co/x/y"))
    return cls("answer", response=response)


@pytest.mark.parametrize(
    ("exc", "needle"),
    [
        (
            lambda: _http(errors.GatedRepoError, 401),
            "a gated repository; accept its licence on https://huggingface.co/org/name and set HF_TOKEN",
        ),
        (lambda: _http(errors.RepositoryNotFoundError, 404), "no such repository on the Hugging Face Hub"),
        (lambda: _http(errors.RemoteEntryNotFoundError, 404), "the repository has no config.json"),
        (lambda: _http(errors.HfHubHTTPError, 503), "the Hugging Face Hub answered HTTP 503"),
        (
            lambda: errors.LocalEntryNotFoundError("no network"),
            "cannot reach the Hugging Face Hub and config.json is not in its cache",
        ),
        (lambda: ConnectionError("down"), "cannot reach the Hugging Face Hub (ConnectionError)"),
    ],
)
def test_hub_errors_are_one_line(
    exc: Any, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "offline", lambda: False)
    monkeypatch.setattr(hub, "unresolvable", lambda: False)  # as online: the download is asked
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _raising(exc()))
    with pytest.raises(ValueError) as info:
        load_model_preset("org/name")
    msg = str(info.value)
    assert msg.startswith("model org/name: ") and needle in msg and "\n" not in msg, msg


def _no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """No name resolves (no network), and nothing may try the network."""
    import socket

    from huggingface_hub.utils import _http

    def gai(*args: object, **kwargs: object) -> Any:
        raise socket.gaierror(-2, "Name or service not known")

    def no_request(*args: object, **kwargs: object) -> Any:
        raise AssertionError("the network was tried")

    monkeypatch.setattr(socket, "getaddrinfo", gai)
    monkeypatch.setattr(_http, "http_backoff", no_request)
    for name in (*hub.PROXIES, "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "offline", lambda: False)  # huggingface_hub read HF_HUB_OFFLINE at import


def test_without_dns_the_cache_is_read_at_once(offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub's host does not resolve: the cached config.json is read as under HF_HUB_OFFLINE, without
    huggingface_hub's five retries (about 24 s and a warning each, measured here), and a config that is
    not cached is one line at once."""
    import huggingface_hub

    _no_dns(monkeypatch)
    assert hub.unresolvable()
    asked: list[dict[str, Any]] = []
    real = huggingface_hub.hf_hub_download

    def spy(repo_id: str, filename: str, **kwargs: Any) -> str:
        asked.append(kwargs)
        return str(real(repo_id, filename, **kwargs))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    preset = load_model_preset("meta-llama/Meta-Llama-3-8B")
    assert count_params(preset.model).total == 8_030_261_248
    assert asked[0]["local_files_only"] is True  # the cache alone: no request, no retry
    with pytest.raises(ValueError) as info:
        load_model_preset("Qwen/Qwen3-8B")
    assert str(info.value) == (
        "model Qwen/Qwen3-8B: cannot reach the Hugging Face Hub (its host name does not resolve) and "
        "config.json is not in its cache; check the network, or fetch it elsewhere (`hf download "
        "Qwen/Qwen3-8B config.json`) and pass its path"
    )


def test_a_proxy_resolves_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    _no_dns(monkeypatch)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert not hub.unresolvable()  # the proxy is asked, not the local resolver
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    assert not hub.unresolvable()  # it resolves: online, huggingface_hub asks the Hub


def test_without_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ValueError, match=r"needs huggingface_hub; pip install 'memplan\[hf\]'"):
        load_model_preset("org/name")


def test_cli_estimate_with_a_hub_id(offline_cache: Path) -> None:
    from typer.testing import CliRunner

    from memplan.cli.app import app

    result = CliRunner().invoke(app, ["estimate", "-m", "meta-llama/Meta-Llama-3-8B", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["params"]["total"] == 8_030_261_248
    missing = CliRunner().invoke(app, ["estimate", "-m", "meta-llama/Llama-3.1-8B"])
    assert missing.exit_code == 2 and missing.stdout == ""
    assert missing.stderr.startswith(
        "error: model meta-llama/Llama-3.1-8B: config.json is not in the Hugging"
    )
    assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr
