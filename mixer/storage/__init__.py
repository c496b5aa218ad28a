"""Storage: shard URLs as byte streams. Local paths, ``file://``, ``s3://``, ``http(s)://`` and other
installed fsspec protocols; listing and expanding shard patterns; redacting URLs for messages.

One concern per module, from the bottom up:

* `registry`: `SCHEMES`, the one table of schemes (scheme name → backend); every other module asks
  it what a scheme means. `schemes`: one module per scheme (local files, ``http(s)``, ``s3``, ``pipe:``,
  every other fsspec protocol), each declaring its `backend.Backend`: extra, URL rule, filesystem,
  listing, error classification, whether it may be written to.
* `urls`: validation at the door (`check_url`), redaction (`redact`).
* `faults`: transient or permanent, and the one retry loop (backoff with jitter).
* `options`: `IOOptions`, how a source reads its remote shards.
* `filesystems`: the fsspec filesystems remote shards are read through (one per process and options).
* `backend`: `Backend`, what a scheme declares; `FsspecBackend`, the schemes read through fsspec.
* `listing`: `expand_urls`, the shards of a pattern, folder or prefix; `shard_list`: `ShardList`,
  the listed URLs held compactly (prefix, suffix, and a run of numbers or packed parts).
* `streams`, `remote`, `pump`: `RemoteStream`, which resumes at the byte after a fault; the async
  pump that reads a response ahead (HTTP and S3).
* `windows`: `WindowedStream`, a shard as ranged requests with an end byte (about what is read).
* `pool`: `ConnectionPool`, at most ``max_connections`` open responses per process for all sources.
* `compressed`: ``.tar.gz`` / ``.tgz`` / ``.tar.xz`` shards, decompressed as they stream.
* `shard`: `open_shard` and `ReadAhead`, what the readers call.
* `open_shards`: `OpenShards`, at most ``max_open_shards`` shards open per reader (an LRU).
* `logsafe`: secrets out of the DEBUG logs of the libraries underneath.

fsspec, s3fs and aiohttp are optional (the ``s3`` / ``http`` extras) and imported only when needed.
"""

from mixer.storage.compressed import codec_of
from mixer.storage.listing import expand_urls
from mixer.storage.open_shards import OpenShards
from mixer.storage.options import IOOptions
from mixer.storage.shard import ReadAhead, open_shard, stream_size
from mixer.storage.shard_list import ShardList
from mixer.storage.urls import check_url, redact

__all__ = [
    "IOOptions",
    "OpenShards",
    "ReadAhead",
    "ShardList",
    "check_url",
    "codec_of",
    "expand_urls",
    "open_shard",
    "redact",
    "stream_size",
]
