"""Session-wide shard fixtures (written once with `webdataset.ShardWriter`; treat them as read-only)."""

from __future__ import annotations

import fcntl
import gc
import re
from collections.abc import Callable, Mapping

import pytest
from shardutil import LogNormal, Sources, write_sources

#: Test modules whose tests pytest-xdist keeps together on one worker, and the part of a test's id that
#: groups them ("" for the whole module): they share an expensive fixture that each worker would
#: otherwise build again. test_service.py: one Ray cluster per test session; test_distributed.py: two
#: torchrun jobs per world size (a module fixture with params "2proc" and "3proc"), each ~25 s.
TOGETHER = {"test_service.py": "", "test_distributed.py": r"\[(\d+proc)"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``-n N`` (``--dist load``, the default): every test on its own, as ``load`` does, except
    that the tests of each group of :data:`TOGETHER` go to one worker together. (pytest-xdist's
    ``xdist_group`` marks do not group under pytest 9, whose node ids they can no longer rename.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            pattern = TOGETHER.get(path.rsplit("/", 1)[-1])
            if pattern is None:
                return nodeid
            if not pattern:
                return path
            found = re.search(pattern, nodeid)  # a test without the param (no fixture to share) goes alone
            return f"{path}::{found.group(1)}" if found else nodeid

    return Scheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collected: every test module, torch and the rest are imported. Their objects (~1M) are left
    out of this process's garbage collections from now on (``gc.freeze``). A full collection walks
    every tracked object and writes to its header; while forked DataLoader workers share this
    process's pages, each such write also copies a page. Measured on test_resume + test_many_sources,
    serial, back to back: 92 -> 83 CPU-s (system time 42 -> 29 s). What the tests create is
    collected as before."""
    gc.collect()
    gc.freeze()


def pytest_addoption(parser: pytest.Parser) -> None:
    # For an intended change of output only: the golden files are what a refactor is checked against.
    parser.addoption(
        "--regen-golden",
        action="store_true",
        default=False,
        help="tests/project/test_golden.py: rewrite tests/project/golden/*.json from the current code instead of "
        "comparing with them",
    )


# Clearly different length distributions.
THREE_SOURCES = {
    "web": LogNormal(shards=8, samples=512, median=200, sigma=0.7, lo=8, hi=2048, seed=0),
    "code": LogNormal(shards=4, samples=192, median=600, sigma=1.0, lo=16, hi=8192, seed=1),
    "books": LogNormal(shards=2, samples=24, median=4000, sigma=0.4, lo=1024, hi=16384, seed=2),
}


@pytest.fixture(scope="session")
def make_sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Mapping[str, LogNormal]], Sources]:
    """The one source factory: ``make_sources({name: LogNormal(...)})`` is
    ``{name: (brace pattern, {key: length})}`` (see `shardutil.write_sources`), written once per
    session for each distinct spec; tokens are `shardutil.expected_tokens(key, length)`."""
    written: dict[tuple[tuple[str, LogNormal], ...], Sources] = {}

    def make(spec: Mapping[str, LogNormal]) -> Sources:
        key = tuple(spec.items())
        if key not in written:
            written[key] = write_sources(tmp_path_factory.mktemp("sources"), spec)
        return written[key]

    return make


@pytest.fixture(scope="session")
def three_sources(make_sources: Callable[[Mapping[str, LogNormal]], Sources]) -> Sources:
    """``{name: (brace pattern, {key: length})}`` for 'web', 'code' and 'books' (`THREE_SOURCES`)."""
    return make_sources(THREE_SOURCES)


@pytest.fixture(scope="session")
def demo_shards(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`mixer.cli.demo.ensure_demo_shards()` in a cache folder of this run: ``{source: brace pattern}``.

    Under pytest-xdist the processes share one folder (their temporary folders sit side by side in
    the run's): generating the demo data takes ~8 CPU-s, which each process would spend again. A lock
    makes the others wait for the first and reuse what it wrote (reuse reads, never writes), instead of
    generating beside it and losing the race."""
    from mixer.cli.demo import ensure_demo_shards  # here, so a broken `mixer` import fails tests, not collection

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if hasattr(request.config, "workerinput") else base) / "demo_cache"
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_demo_shards(root)
