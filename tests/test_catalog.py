"""Named public traces: fetched once (checksum checked, renamed into place), then
read from the cache; offline or corrupt sources give one line naming the URL."""

from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

import pytest

from roseinfer import workloads
from roseinfer.workloads import catalog
from roseinfer.workloads.catalog import CATALOGUE, PublicTrace, fetch_trace
from roseinfer.workloads.errors import WorkloadError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
ROWS = "arrival_s,prompt_tokens,output_tokens\n0,5,3\n0.5,7,2\n"


@pytest.fixture()
def tiny(tmp_path: Path, monkeypatch) -> PublicTrace:
    """A catalogued trace whose source is a local file (file:// URL); the cache in tmp."""
    source = tmp_path / "upstream" / "tiny_trace.csv"
    source.parent.mkdir()
    source.write_text(ROWS)
    trace = PublicTrace("tiny-trace", source.as_uri(), hashlib.sha256(ROWS.encode()).hexdigest(),
                        len(ROWS), "plain", "CC0-1.0", "https://example.org", "two rows", "nobody")  # fmt: skip
    monkeypatch.setitem(CATALOGUE, trace.name, trace)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(catalog.MIRROR_ENV, raising=False)
    return trace


def test_first_use_downloads_checks_and_caches(tiny, tmp_path: Path, monkeypatch) -> None:
    path = fetch_trace("tiny-trace")
    assert path == tmp_path / "cache" / "tiny_trace.csv" and path.read_text() == ROWS
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny_trace.csv"]  # no temp left
    # a cache hit opens no URL
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded again"))
    assert fetch_trace("tiny-trace") == path
    reqs = workloads.load_trace("tiny-trace")  # wherever a path is accepted
    assert [(r.num_prompt_tokens, r.max_output_tokens) for r in reqs] == [(5, 3), (7, 2)]
    assert workloads.detect_format("tiny-trace") == "plain"


def test_a_corrupt_cache_entry_is_fetched_again(tiny) -> None:
    path = fetch_trace("tiny-trace")
    path.write_text(ROWS.replace("5", "6"))
    assert fetch_trace("tiny-trace").read_text() == ROWS


@pytest.mark.parametrize("published", [ROWS.replace("7", "8"), ROWS + "1,1,1\n" * 1000])
def test_a_checksum_or_size_mismatch_leaves_no_cache_entry(tiny, published: str) -> None:
    Path(tiny.url.removeprefix("file://")).write_text(published)
    with pytest.raises(WorkloadError) as err:
        fetch_trace("tiny-trace")
    message = str(err.value)
    assert (
        "\n" not in message
        and tiny.url in message
        and f"expected {tiny.num_bytes} bytes" in message
    )
    assert not any((catalog.cache_dir()).iterdir())  # neither the file nor a temp file


def test_offline_is_one_line_naming_the_url_and_the_way_round(tiny, monkeypatch) -> None:
    def offline(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(WorkloadError) as err:
        workloads.load_trace("tiny-trace")
    message = str(err.value)
    assert message.startswith(f"cannot download trace 'tiny-trace' from {tiny.url} (")
    assert "pass its path (--trace PATH)" in message and catalog.MIRROR_ENV in message


def test_a_mirror_folder_replaces_upstream(tiny, tmp_path: Path, monkeypatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "tiny_trace.csv").write_text(ROWS)
    Path(tiny.url.removeprefix("file://")).unlink()  # upstream gone
    monkeypatch.setenv(catalog.MIRROR_ENV, str(mirror))
    assert fetch_trace("tiny-trace").read_text() == ROWS


def test_a_local_file_of_that_name_wins_and_unknown_names_say_what_exists(
    tiny, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("tiny-trace").write_text("arrival_s,prompt_tokens,output_tokens\n0,9,9\n")
    assert workloads.load_trace("tiny-trace")[0].num_prompt_tokens == 9
    with pytest.raises(WorkloadError, match="no such file; .* public trace .*azure-conv-2023"):
        workloads.load_trace("azure-conv-2032")


def test_cache_dir_follows_xdg(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(catalog.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert catalog.cache_dir() == tmp_path / "roseinfer" / "traces"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is not on this machine")
@pytest.mark.parametrize("name", [n for n in CATALOGUE if n != "mooncake-conversation"])
def test_the_catalogue_checksums_are_the_published_files(name: str) -> None:
    """The local copies under ../shared are byte-for-byte the published files."""
    trace = CATALOGUE[name]
    data = (SHARED / trace.file_name).read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (trace.num_bytes, trace.sha256)
    assert workloads.detect_format(SHARED / trace.file_name) == trace.format


def test_cluster_routing_names_a_missing_trace_in_one_line(tmp_path: Path) -> None:
    """Before: without ../shared the benchmark died with a traceback."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "cluster_routing.py"),
                           "--trace", str(tmp_path / "gone.jsonl")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert (
        lines[0].startswith("cluster_routing.py: error: ")
        and "gone.jsonl: no such file" in lines[0]
    )
