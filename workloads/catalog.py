"""Named public traces, fetched on first use and cached, as dataset libraries do.

``rose-sim --trace azure-conv-2023`` (or ``load_trace("azure-conv-2023")``) reads
the published file: the first use downloads it from its source (a URL pinned to
the upstream commit, so the bytes never change), checks its SHA-256, and keeps it
in the cache; later uses read the cached copy (its checksum checked again).

- Cache: ``$ROSEINFER_TRACE_CACHE``, else ``$XDG_CACHE_HOME/roseinfer/traces``,
  else ``~/.cache/roseinfer/traces``.
- Mirror: ``$ROSEINFER_TRACE_MIRROR``, a folder or a base URL holding the files
  under their upstream names (an air-gapped machine, a local copy); the checksum
  is checked all the same.

A download is written to a temporary file beside the cache entry, read at most
to the catalogued size, checked, then renamed into place (an interrupted or
corrupt download never becomes a cache entry). Offline, the error names the URL
and how to pass a local copy instead.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from roseinfer.workloads.errors import WorkloadError

CACHE_ENV = "ROSEINFER_TRACE_CACHE"
"""Environment variable: the folder that holds downloaded traces."""
MIRROR_ENV = "ROSEINFER_TRACE_MIRROR"
"""Environment variable: a folder or base URL to fetch the files from instead of upstream."""
DOWNLOAD_TIMEOUT_S = 60.0
"""Seconds a stalled connection may stay silent before the download is abandoned."""
_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class PublicTrace:
    """One published trace.

    Attributes:
        name: the catalogue name (``--trace NAME``).
        url: where the file is downloaded from, pinned to an upstream commit.
        sha256: hex SHA-256 of the file as published.
        num_bytes: the file's size in bytes.
        format: its loader (``azure`` or ``mooncake``; see :mod:`.traces`).
        licence: SPDX identifier of the licence it is published under.
        licence_url: the licence text.
        description: rows, span and what the requests are.
        attribution: whom to cite when using it.
    """

    name: str
    url: str
    sha256: str
    num_bytes: int
    format: str
    licence: str
    licence_url: str
    description: str
    attribution: str

    @property
    def file_name(self) -> str:
        """The upstream file name (the cache and a mirror keep it)."""
        return self.url.rsplit("/", 1)[-1]


_AZURE = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/790921015d50dd6aae7f7e47f39ba0e235ad6b08/data"
_AZURE_LICENCE = "https://github.com/Azure/AzurePublicDataset/blob/master/LICENSE"
_AZURE_CITE = (
    "Patel et al., Splitwise: Efficient generative LLM inference using phase splitting, "
    "ISCA 2024 (Azure LLM inference trace 2023)"
)
_MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/FAST25-release/traces"
_MOONCAKE_LICENCE = "https://github.com/kvcache-ai/Mooncake/blob/main/LICENSE-APACHE"
_MOONCAKE_CITE = "Qin et al., Mooncake: Trading More Storage for Less Computation, FAST 2025 (kvcache-ai/Mooncake)"

CATALOGUE: dict[str, PublicTrace] = {
    t.name: t
    for t in (
        PublicTrace(
            "azure-conv-2023",
            f"{_AZURE}/AzureLLMInferenceTrace_conv.csv",
            "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
            719_188,
            "azure",
            "CC-BY-4.0",
            _AZURE_LICENCE,
            "Azure conversation service, 2023-11-16: 19,366 requests over 58 min (5.5 req/s, "
            "close to Poisson); prompts mean 1,155 tokens, outputs mean 211",
            _AZURE_CITE,
        ),
        PublicTrace(
            "azure-code-2023",
            f"{_AZURE}/AzureLLMInferenceTrace_code.csv",
            "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
            320_117,
            "azure",
            "CC-BY-4.0",
            _AZURE_LICENCE,
            "Azure coding service, 2023-11-16: 8,819 requests over 57 min (2.6 req/s, very "
            "bursty); prompts mean 2,048 tokens, outputs mean 28",
            _AZURE_CITE,
        ),
        PublicTrace(
            "mooncake-conversation",
            f"{_MOONCAKE}/conversation_trace.jsonl",
            "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
            3_029_533,
            "mooncake",
            "Apache-2.0",
            _MOONCAKE_LICENCE,
            "Kimi conversation requests sampled from one hour online: 12,031 requests, prompts "
            "mean 12,035 tokens, outputs mean 343, prefix blocks as hash_ids",
            _MOONCAKE_CITE,
        ),
        PublicTrace(
            "mooncake-synthetic",
            f"{_MOONCAKE}/synthetic_trace.jsonl",
            "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
            1_136_313,
            "mooncake",
            "Apache-2.0",
            _MOONCAKE_LICENCE,
            "built from public datasets with Poisson arrivals (not a production trace): 3,993 "
            "requests over 17 min, prompts mean 15,325 tokens, heavy prefix reuse (hash_ids)",
            _MOONCAKE_CITE,
        ),
    )
}
"""The named traces, by name. Sizes and checksums are of the files as published."""


def is_catalogued(name: str | os.PathLike[str]) -> bool:
    """True when ``name`` is a catalogue name (and no file of that name exists here,
    which a user meant instead)."""
    return str(name) in CATALOGUE and not Path(name).exists()


def cache_dir() -> Path:
    """The folder downloaded traces are kept in (see the module docstring)."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "roseinfer" / "traces"


def fetch_trace(name: str, *, cache: Path | None = None) -> Path:
    """The local path of the catalogued trace ``name``, downloading it on first use.

    Args:
        name: a :data:`CATALOGUE` key.
        cache: the cache folder (default :func:`cache_dir`).

    Returns:
        The cached file, whose SHA-256 matches the catalogue.

    Raises:
        WorkloadError: an unknown name (listing the known ones), a download that
            fails (naming the URL and how to pass a local copy), or a file whose
            checksum or size is not the catalogued one.
    """
    trace = CATALOGUE.get(name)
    if trace is None:
        raise WorkloadError(f"no trace named {name!r}; known: {', '.join(CATALOGUE)}")
    folder = cache or cache_dir()
    path = folder / trace.file_name
    if path.is_file() and _sha256(path) == trace.sha256:
        return path
    url = _source_url(trace)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _download(trace, url, path)
    except OSError as err:
        raise WorkloadError(
            f"cannot write trace {name!r} to {folder} ({err.strerror or err}); set "
            f"{CACHE_ENV} to a writable folder"
        ) from None
    return path


def _source_url(trace: PublicTrace) -> str:
    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        return trace.url
    if "://" in mirror:
        return f"{mirror.rstrip('/')}/{trace.file_name}"
    return (Path(mirror).expanduser().resolve() / trace.file_name).as_uri()


def _download(trace: PublicTrace, url: str, path: Path) -> None:
    """Download ``url`` to a temporary file beside ``path``, check it, rename it into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{trace.file_name}.", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest, size = _copy(trace, url, out)
        if size != trace.num_bytes or digest != trace.sha256:
            raise WorkloadError(
                f"trace {trace.name!r} from {url} has {size} bytes with SHA-256 {digest[:16]}..., "
                f"expected {trace.num_bytes} bytes with {trace.sha256[:16]}...; the source "
                "changed or the download was cut: retry, or pass a checked local copy (--trace PATH)"
            )
        tmp.chmod(0o644)  # mkstemp makes it private; a cache entry is a public file
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _copy(trace: PublicTrace, url: str, out: BinaryIO) -> tuple[str, int]:
    """Stream ``url`` into ``out``: (hex SHA-256, bytes), reading at most one byte past
    the catalogued size (a source that sends more fails the size check, unread)."""
    import urllib.request  # NOTE: here, not at the top: http and ssl cost a short run 10 ms

    digest, size = hashlib.sha256(), 0
    try:
        response = urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S)  # noqa: S310
    except (OSError, ValueError) as err:  # URLError is an OSError
        raise _unreachable(trace, url, err) from None
    with response:
        while size <= trace.num_bytes:
            try:
                chunk = response.read(min(_CHUNK_BYTES, trace.num_bytes + 1 - size))
            except (OSError, ValueError) as err:
                raise _unreachable(trace, url, err) from None
            if not chunk:
                break
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _unreachable(trace: PublicTrace, url: str, err: Exception) -> WorkloadError:
    reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or err
    return WorkloadError(
        f"cannot download trace {trace.name!r} from {url} ({reason}); download that file "
        f"yourself and pass its path (--trace PATH), or set {MIRROR_ENV} to a folder "
        f"holding {trace.file_name}"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def describe_catalogue() -> str:
    """One line per named trace: name, format, size, licence and description."""
    return "\n".join(
        f"{t.name:<22} {t.format:<9} {t.num_bytes / 1e6:5.1f} MB  {t.licence:<11} {t.description}"
        for t in CATALOGUE.values()
    )
