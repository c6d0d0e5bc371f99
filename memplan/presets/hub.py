"""Hugging Face Hub ids (``-m org/name``): the repository's ``config.json``, fetched through
``huggingface_hub`` as transformers would fetch it — from its cache (``HF_HUB_CACHE``, ``HF_HOME``), not
at all under ``HF_HUB_OFFLINE``, with the token of the environment (``HF_TOKEN``, or the one
``hf auth login`` stored) for gated and private repositories. Only ``config.json`` is downloaded: no
weights, no tokenizer, no model code (``trust_remote_code`` is never involved).

Every failure is one line naming the id and the fix: not cached while offline, a gated or missing
repository, a repository without ``config.json``, no network, ``huggingface_hub`` not installed.

Known limitations:
- NB: the repository's default branch only (no ``org/name@revision``).
- NB: ``huggingface_hub`` retries an unreachable Hub five times (its backoff: about 24 s, with a warning
  each) before memplan answers "cannot reach". Where the Hub's host name does not resolve — no network, no
  DNS — memplan reads the cache alone at once (``unresolvable``), as under ``HF_HUB_OFFLINE=1``; a proxy in
  the environment (``HTTPS_PROXY``, ``ALL_PROXY``) resolves names itself, so no such check is made there.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""``org/name`` as the Hub spells repository ids (letters, digits, ``-``, ``_``, ``.``; one slash)."""

_TRUE = {"1", "ON", "YES", "TRUE"}
"""The values huggingface_hub reads as true in its environment switches (``constants._is_true``)."""


def is_hub_id(text: str) -> bool:
    """Whether ``text`` names a Hub repository rather than a file: ``org/name`` that is no existing path
    and does not end in a preset or config suffix (``.toml`` / ``.json``)."""
    text = text.strip()
    if not HUB_ID.match(text) or text.lower().endswith((".toml", ".json")):
        return False
    return not Path(text).expanduser().exists()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, looked up now (the library reads it at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
"""The proxy settings httpx reads for the Hub's https requests: with one, the proxy resolves the host."""


def unresolvable() -> bool:
    """The Hub's host name (``constants.ENDPOINT``'s) does not resolve here, and no proxy would resolve
    it: no network to try, so no retries to wait for (module NB)."""
    from huggingface_hub import constants

    if any(os.environ.get(name) for name in PROXIES):
        return False
    host = urlsplit(constants.ENDPOINT).hostname
    if not host:
        return False
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror:
        return True
    except OSError:
        return False
    return False


def hub_config(repo_id: str) -> Path:
    """The local path of ``repo_id``'s ``config.json`` (downloaded into the Hub cache if it is not there
    and the Hub may be reached). Raises a one-line ``ValueError``."""
    where = f"model {repo_id}"
    try:
        from huggingface_hub import errors, hf_hub_download
    except ImportError:
        raise ValueError(
            f"{where}: reading a Hugging Face Hub id needs huggingface_hub; "
            "pip install 'memplan[hf]', or pass the path of its config.json"
        ) from None
    is_offline = offline()
    no_dns = not is_offline and unresolvable()
    try:
        path = hf_hub_download(
            repo_id,
            "config.json",
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # now, not as the library read it at import
            local_files_only=is_offline or no_dns,
        )
    except errors.GatedRepoError:
        raise ValueError(
            f"{where}: a gated repository; accept its licence on https://huggingface.co/{repo_id} and set "
            "HF_TOKEN (or run `hf auth login`)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"{where}: no such repository on the Hugging Face Hub (nor a file of that name); check the id, "
            "or set HF_TOKEN if it is private"
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise ValueError(f"{where}: the repository has no config.json; pass a config.json path") from None
    except errors.LocalEntryNotFoundError:
        raise ValueError(_not_cached(where, repo_id, is_offline, no_dns)) from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no"
        raise ValueError(
            f"{where}: the Hugging Face Hub answered HTTP {status}; try again later, "
            "or pass a config.json path"
        ) from None
    except (errors.HFValidationError, ValueError) as exc:
        raise ValueError(f"{where}: not a valid Hub id ({' '.join(str(exc).split())[:120]})") from None
    except OSError as exc:  # a network error outside huggingface_hub's own classes
        raise ValueError(
            f"{where}: cannot reach the Hugging Face Hub ({exc.__class__.__name__}); check the network, "
            "or pass a config.json path"
        ) from None
    return Path(str(path))


def _not_cached(where: str, repo_id: str, is_offline: bool, no_dns: bool = False) -> str:
    if is_offline:
        return (
            f"{where}: config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"fetch it once online (`hf download {repo_id} config.json`) or pass a config.json path"
        )
    why = " (its host name does not resolve)" if no_dns else ""
    return (
        f"{where}: cannot reach the Hugging Face Hub{why} and config.json is not in its cache; check the "
        f"network, or fetch it elsewhere (`hf download {repo_id} config.json`) and pass its path"
    )


def snapshot_of(path: Path) -> str | None:
    """The commit of a Hub cache snapshot (``…/snapshots/<sha>/config.json``), None elsewhere."""
    return path.parent.name if path.parent.parent.name == "snapshots" else None
