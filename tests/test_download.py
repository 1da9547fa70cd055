"""HTTP delivery: streamed to disk, resumed with a Range request, size-limited, hash-checked."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from device_agent.updates.download import Bounds, DownloadError, allowed_origins, download
from sdk.deploy import ArtifactServer


@pytest.fixture()
def served(tmp_path):
    data = np.random.default_rng(0).bytes(3 * 1024 * 1024 + 17)
    source = tmp_path / "a.edgepkg"
    source.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    server = ArtifactServer(source, sha)
    yield server, data, sha
    server.stop()


def test_download_resumes_a_partial_file_with_a_range_request(served, tmp_path):
    server, data, sha = served
    target = tmp_path / "dl" / "x.edgepkg"
    target.parent.mkdir()
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data[:1_000_000])  # what an interrupted download left
    requests: list[str] = []
    original = server.RequestHandlerClass.do_GET

    def spy(handler):
        requests.append(handler.headers.get("Range", ""))
        original(handler)

    server.RequestHandlerClass.do_GET = spy
    try:
        result = download(server.url, target, size=len(data), sha256=sha, bounds=_bounds(server.url, 10 * 1024 * 1024))
    finally:
        server.RequestHandlerClass.do_GET = original
    assert result.read_bytes() == data
    assert requests == ["bytes=1000000-"], "only the missing part was fetched"
    assert not partial.exists()


def _bounds(url: str, max_bytes: int) -> Bounds:
    return Bounds(origins=allowed_origins([url.rsplit("/", 1)[0]]), max_bytes=max_bytes)


def test_download_over_the_size_limit_is_refused_before_fetching(served, tmp_path):
    server, data, sha = served
    with pytest.raises(DownloadError, match="over the download limit"):
        download(server.url, tmp_path / "x", size=len(data), sha256=sha, bounds=_bounds(server.url, 1024))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()


def test_download_with_a_wrong_hash_is_discarded(served, tmp_path):
    server, data, _ = served
    with pytest.raises(DownloadError, match="sha256"):
        download(server.url, tmp_path / "x", size=len(data), sha256="0" * 64,
                 bounds=_bounds(server.url, 10 * 1024 * 1024))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()


def test_server_sending_more_than_announced_is_cut_off(served, tmp_path):
    server, data, sha = served
    with pytest.raises(DownloadError):
        download(server.url, tmp_path / "x", size=len(data) - 100, sha256=sha,
                 bounds=_bounds(server.url, 10 * 1024 * 1024), attempts=1)
