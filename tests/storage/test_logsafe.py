"""No secret in the DEBUG logs of the libraries the I/O layer drives (fsspec, botocore, ...), captured
from real reads on 127.0.0.1: URLs with ``user:password@`` and presigned query strings, S3 request
signatures, session tokens and Authorization headers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from servers import FaultyHTTPServer, make_bucket, remote_guard, s3_server, s3_storage_options  # noqa: F401 (remote_guard: a module-wide autouse fixture)

from mixer import storage as mio
from mixer.storage import logsafe
from mixer.storage.filesystems import close_filesystems

SECRETS = ("PASSWORD9", "SIGSECRET9", "AKIAKEY9", "SESSIONTOKEN9", "SECRETKEY9")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("logsafe")
    (folder / "d").mkdir()
    (folder / "d" / "a.tar").write_bytes(bytes(1024))  # an empty archive
    return folder


def texts(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> list[str]:
    """Every captured record as its message and as the handler formatted it, plus what reached the
    process's stdout/stderr."""
    out, err = capfd.readouterr()
    return [r.getMessage() for r in caplog.records] + caplog.text.splitlines() + [out, err]


def test_fsspec_http_debug_log_of_a_url_with_credentials(
    root: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)  # the root logger and the capturing handler: everything
    with FaultyHTTPServer(root) as http:
        base = http.url("d/").replace("127.0.0.1", "user:PASSWORD9@127.0.0.1")
        query = "?X-Amz-Credential=AKIAKEY9&X-Amz-Signature=SIGSECRET9"
        assert [u for u, _ in mio.expand_urls(base)] == [base + "a.tar"]  # fsspec lists the prefix
        with mio.open_shard(base + "a.tar" + query) as stream:
            assert stream.read() == bytes(1024)
        # fsspec driven directly, once the I/O layer is in use, is covered as well
        import fsspec

        assert fsspec.filesystem("http", skip_instance_cache=True).cat(base + "a.tar" + query) == bytes(1024)
        port = http.port
    close_filesystems()
    fsspec_records = [r.getMessage() for r in caplog.records if r.name.startswith("fsspec")]
    # fsspec did log the URLs it fetched (else this test would prove nothing), without the secrets
    assert f"http://127.0.0.1:{port}/d/" in fsspec_records
    assert f"http://127.0.0.1:{port}/d/a.tar" in fsspec_records
    for text in texts(caplog, capfd):
        assert not any(s in text for s in SECRETS), text


def test_botocore_debug_log_of_signed_s3_requests(
    root: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("moto.server", reason="the S3 tests need the test extra (moto[server])")
    with s3_server() as endpoint:
        make_bucket(endpoint, "logs", {"d/a.tar": bytes(1024)})
        options = {**s3_storage_options(endpoint), "key": "AKIAKEY9", "secret": "SECRETKEY9", "token": "SESSIONTOKEN9"}
        caplog.set_level(logging.DEBUG)
        assert [u for u, _ in mio.expand_urls("s3://logs/d/", storage_options=options)] == ["s3://logs/d/a.tar"]
        with mio.open_shard("s3://logs/d/a.tar", storage_options=options) as stream:
            assert stream.read() == bytes(1024)
        close_filesystems()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("botocore")]
    # botocore logged the signatures, canonical requests and headers, each masked
    assert "Signature:\n***" in messages
    assert any("x-amz-security-token:***" in m for m in messages)
    assert any("'Authorization': b'***'" in m for m in messages)
    for text in texts(caplog, capfd):
        assert not any(s in text for s in SECRETS), text


@pytest.mark.parametrize(
    ("text", "clean"),
    [
        # a value that begins with "b" is not a bytes literal: all of it is masked (a hex signature
        # starts with b one time in 16; it leaked that character before)
        ("Signature:\nb3c1f00d", "Signature:\n***"),
        ("'Authorization': b'AWS4-HMAC-SHA256 Credential=K/x'", "'Authorization': b'***'"),
        ("authorization: bearer-token-9", "authorization: ***"),
        ("https://u:PASSWORD9@h/a.tar?X-Amz-Signature=SIGSECRET9", "https://h/a.tar"),
        (
            '127.0.0.1:9 "GET /b/k.tar?X-Amz-Credential=AKIAKEY9&X-Amz-Signature=SIGSECRET9 HTTP/1.1" 200 5',
            '127.0.0.1:9 "GET /b/k.tar?X-Amz-Credential=***&X-Amz-Signature=*** HTTP/1.1" 200 5',
        ),
        (
            "headers={'Authorization': 'Basic dXNlcjpQQVNTV09SRDk=', 'Range': 'bytes=0-'}",
            "headers={'Authorization': '***', 'Range': 'bytes=0-'}",
        ),
        (
            "{'aws_secret_access_key': 'SECRETKEY9', 'region_name': 'us-east-1'}",
            "{'aws_secret_access_key': '***', 'region_name': 'us-east-1'}",
        ),
        ("x-amz-security-token:SESSIONTOKEN9\nhost:127.0.0.1", "x-amz-security-token:***\nhost:127.0.0.1"),
        ("Calculating signature using v4 auth.", "Calculating signature using v4 auth."),
        ("Sample of length 12 at offset 512", "Sample of length 12 at offset 512"),
    ],
)
def test_scrub(text: str, clean: str) -> None:
    assert logsafe.scrub(text) == clean


def test_only_the_libraries_records_are_rewritten(caplog: pytest.LogCaptureFixture) -> None:
    logsafe.install()
    logsafe.install()  # idempotent: one wrapper
    caplog.set_level(logging.DEBUG)
    url = "https://u:PASSWORD9@h/a.tar"
    try:
        raise OSError(f"cannot reach {url}")
    except OSError as exc:
        logging.getLogger("fsspec.example").debug("fetching %s", url, exc_info=exc)
    logging.getLogger("myapp.io").debug("fetching %s", url)  # the application's own: untouched
    ours, theirs = caplog.records[-2:]
    assert ours.getMessage() == "fetching https://h/a.tar" and ours.args is None
    assert (
        ours.exc_text is not None
        and "cannot reach https://h/a.tar" in ours.exc_text
        and "PASSWORD9" not in caplog.text.split("myapp")[0]
    )
    assert theirs.getMessage() == f"fetching {url}" and theirs.args == (url,)
