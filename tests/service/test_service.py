"""Mixing as a service (mixer.service) on a real local Ray cluster: the remote loader hands out the
in-process loader's batches, in its order, with its state format, through resume, a killed reader,
two torchrun trainers, a change in the number of readers and a lost node.

**Loopback only.** Ray does not stay on 127.0.0.1 (it replaces it by the machine's address, and its
GCS and raylet listen on every interface), so the session's cluster runs in a network namespace
that has only loopback: the ``cluster`` fixture starts tests/support/ray_driver.py under ``unshare -n``
(root, as in CI), and that process refuses to start Ray unless ``lo`` is its only interface; the
fixture fails, and starts nothing, when the namespace cannot be made. One cluster (``num_cpus=2``)
for the whole session, stopped after it. Tests send the driver functions of this module to run
there (``cluster.run(fn, ...)``); the in-process references run here, in the test process.

Services are kept in the driver between tests (``_SERVICES``), because a reader actor costs ~2-3 s
to start (it imports torch). Readers ask for a quarter CPU, so that a 2-CPU cluster holds them all.
Under pytest-xdist the module's tests all go to one worker (tests/conftest.py, ``TOGETHER``), so
a test run has one cluster.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shardutil
from shardutil import LogNormal, expected_tokens

import mixer

ray = pytest.importorskip("ray", reason="the service tests need the ray extra (pip install -e '.[ray]')")

from mixer.service import MixerService, make_remote_loader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tests" / "support"
SOURCES = {
    "web": LogNormal(shards=6, samples=480, median=120, sigma=0.8, lo=2, hi=2048, seed=30),
    "code": LogNormal(shards=3, samples=160, median=400, sigma=1.0, lo=2, hi=2048, seed=31),
    "tiny": LogNormal(shards=2, samples=30, median=60, sigma=0.5, lo=2, hi=2048, seed=32),
}
READERS = {"num_cpus": 0.25}

# mixture(shards, **options): the one mixture of these tests (stop, schedule and world vary)
mixture = functools.partial(
    shardutil.mixture,
    weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
    batching=mixer.TokenBudget(max_tokens=2048),
    stop="all_exhausted",
    seed=5,
    shuffle_buffer=32,
    state_every=4,
)


def view(batch: mixer.Batch) -> tuple[Any, ...]:
    """What must be identical: keys, the whole buffer, the step and the reader."""
    if batch.filler:
        return ("filler",)
    digest = hashlib.blake2b(batch.buffer.cpu().numpy().tobytes(), digest_size=10).hexdigest()
    return (tuple(batch.keys), digest, batch.meta.step, batch.meta.worker)


def plain(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def take(loader: Any, n: int | None) -> list[Any]:
    """The first ``n`` batches' views (all with None), fetching no batch more."""
    out: list[Any] = []
    if n == 0:
        return out
    for b in loader:
        out.append(view(b))
        if len(out) == n:
            break
    return out


# ---- the cluster: a driver process in a loopback-only network namespace --------------------------


class Cluster:
    """The session's Ray driver (tests/support/ray_driver.py); ``run(fn, *args, **kwargs)`` runs ``fn`` there."""

    def __init__(self, proc: subprocess.Popen[bytes], requests: Connection, answers: Connection, log: Path) -> None:
        self.proc, self.requests, self.answers, self.log = proc, requests, answers, log
        self.address = ""

    def receive(self, timeout: float) -> Any:
        if not self.answers.poll(timeout):
            pytest.fail(f"the Ray driver did not answer within {timeout:g} s; its log ends:\n{self.tail()}")
        try:
            return self.answers.recv()
        except EOFError:
            pytest.fail(f"the Ray driver exited (status {self.proc.poll()}); its log ends:\n{self.tail()}")

    def run(self, fn: Any, *args: Any, timeout: float = 180, **kwargs: Any) -> Any:
        self.requests.send((fn, args, kwargs))
        answer = self.receive(timeout)
        if answer[0] == "err":
            _, exc, text = answer
            raise exc from RuntimeError(f"in the Ray driver:\n{text}")
        return answer[1]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            pytest.fail(f"the service tests need {tool!r} to run Ray in a loopback-only network namespace")
    log = tmp_path_factory.mktemp("ray") / "driver.log"
    temp = Path(tempfile.mkdtemp(prefix="mxray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    to_driver, from_test = os.pipe()
    to_test, from_driver = os.pipe()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(REPO), str(HERE), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        OMP_NUM_THREADS="1",
        RAY_USAGE_STATS_ENABLED="0",
        # Token authentication on, with a token of this session's (nothing written to ~/.ray).
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    cmd += [sys.executable, str(HERE / "ray_driver.py"), str(to_driver), str(from_driver), str(temp)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            pass_fds=(to_driver, from_driver),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    os.close(to_driver)
    os.close(from_driver)
    c = Cluster(proc, Connection(from_test, readable=False), Connection(to_test, writable=False), log)
    try:
        first = c.receive(180)
        if first[0] != "ready":
            pytest.fail(f"the Ray driver refused to start Ray: {first[1]}")
        c.address = first[1]["address"]
        yield c
    finally:
        try:
            c.requests.send(None)
            proc.wait(timeout=60)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)  # the session's own process group (the driver and Ray's processes)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def shards(make_sources: Any) -> Any:
    return make_sources(SOURCES)


def every_key(shards: Any) -> set[str]:
    return {k for _, lengths in shards.values() for k in lengths}


# ---- what runs in the driver ------------------------------------------------------------------

_SERVICES: dict[str, MixerService] = {}


def _service(key: str, shards: Any, *, readers: int, world: int = 1, **options: Any) -> MixerService:
    if key not in _SERVICES:
        _SERVICES[key] = MixerService(
            mixture(shards, **options), world_size=world, readers_per_trainer=readers, name=key, reader_options=READERS
        )
    return _SERVICES[key]


def _close(key: str) -> None:
    service = _SERVICES.pop(key, None)
    if service is not None:
        service.close()


def _remote(
    key: str,
    shards: Any,
    *,
    readers: int,
    options: dict[str, Any] | None = None,
    n: int | None = None,
    state: Any = None,
    loader: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A remote loader's batches (views), then its state, counters and transport report."""
    service = _service(key, shards, readers=readers, **(options or {}))
    remote = make_remote_loader(service, rank=0, **(loader or {}))
    if state is not None:
        remote.load_state_dict(state)
    views = take(remote, n)
    return {
        "views": views,
        "state": plain(remote.state_dict()),
        "counters": remote.counters(),
        "report": remote.service_report(),
    }


def _local(shards: Any, *, workers: int, n: int | None = None, state: Any = None, **options: Any) -> dict[str, Any]:
    loader = mixer.make_loader(mixture(shards, **options), num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    views = take(loader, n)
    return {"views": views, "state": plain(loader.state_dict()), "counters": loader.counters()}


def _where() -> dict[str, Any]:
    return {
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "gcs": ray.get_runtime_context().gcs_address,
        "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
    }


# ---- the namespace ------------------------------------------------------------------------------


def test_the_driver_refuses_to_start_ray_where_it_sees_more_than_loopback() -> None:
    seen = sorted(name for _, name in socket.if_nameindex())
    if seen == ["lo"]:
        pytest.skip("this machine has only loopback: there is nothing to refuse")
    to_driver, from_test = os.pipe()
    to_test, from_driver = os.pipe()
    cmd = [sys.executable, str(HERE / "ray_driver.py"), str(to_driver), str(from_driver), "/nonexistent"]
    proc = subprocess.Popen(cmd, pass_fds=(to_driver, from_driver), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(to_driver)
    os.close(from_driver)
    answers = Connection(to_test, writable=False)
    assert answers.poll(60)
    kind, reason = answers.recv()
    assert proc.wait(timeout=60) == 0 and not proc.stderr.read()
    os.close(from_test)
    assert kind == "refused" and "not a loopback-only namespace; Ray not started" in reason


@pytest.mark.slow
def test_the_cluster_lives_on_loopback_only(cluster: Cluster) -> None:
    where = cluster.run(_where)
    assert where["interfaces"] == ["lo"]
    assert where["gcs"].startswith("127.0.0.1:") and where["nodes"] == ["127.0.0.1"]


def test_no_service_without_a_ray_connection_made_by_the_caller(shards: Any) -> None:
    # This process never called ray.init: mixer must not start a cluster on the host's interfaces.
    assert not ray.is_initialized()
    with pytest.raises(mixer.ConfigError, match=r"not connected to a Ray cluster; call ray.init"):
        MixerService(mixture(shards), readers_per_trainer=1)
    assert not ray.is_initialized()


# ---- the parts that need no cluster --------------------------------------------------------------


def test_a_group_crosses_as_one_buffer_and_gives_back_the_same_batches(shards: Any) -> None:
    from mixer.plan.world import World
    from mixer.service.groups import GroupBuffer, pack, unpack

    mix = mixture(shards)
    alone = [b for _, b in zip(range(12), mix.open_reader(World()))]
    group = GroupBuffer(np.dtype(mix.dtype))
    group.reset(3 * mix.max_batch_elements)  # room for a few: the later batches are collated outside it
    made = [b for _, b in zip(range(12), mix.open_reader(World(), pool=group))]
    assert group.used > 0 and any(
        not 0 <= b.buffer.data_ptr() - group.buffer.ctypes.data < group.buffer.nbytes for b in made
    )
    data, entries = pack(made, group)
    assert len(data) == sum(b.buffer.numel() for b in made)
    data.flags.writeable = False  # as Ray hands it out: a view of its object store
    back = unpack(data, entries, pin=False)
    assert [view(b) for b in back] == [view(b) for b in alone]
    assert [b.meta for b in back] == [b.meta for b in alone]
    back[0].tokens[0, 0] = -1  # the trainer's own copy
    assert back[0].buffer.data_ptr() != data.ctypes.data


def test_a_shares_table_replica_receives_what_the_loader_published() -> None:
    from mixer.runtime.feedback import SharesTable

    loader_side = SharesTable(2, update_every=4, lag=3, capacity=3)
    for j in range(5):
        loader_side.publish(j, np.array([j, 1.0]))
    first, rows = loader_side.rows_since(0)
    assert first == 2 and rows == [[2, 1], [3, 1], [4, 1]]  # what the ring still holds
    reader_side = SharesTable(2, update_every=4, lag=3, capacity=3)
    reader_side.extend(first, rows)
    loader_side.publish(5, np.array([5, 1.0]))
    reader_side.extend(*loader_side.rows_since(reader_side.published))
    for step in range(19, 31):  # the steps that updates 3, 4 and 5 (those the ring holds) apply to
        np.testing.assert_array_equal(reader_side.shares_at(step, wait=False), loader_side.shares_at(step, wait=False))


# ---- the same batches -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["all_exhausted", "never"])
@pytest.mark.parametrize("readers", [0, 2])
def test_the_same_batches_as_the_in_process_loader(cluster: Cluster, shards: Any, readers: int, stop: str) -> None:
    """``readers_per_trainer=N`` is ``make_loader(num_workers=N)``: 0 is one reader asked only when a
    batch is needed, as the main process reads. The states after the same batches are identical too."""
    n = None if stop == "all_exhausted" else 150
    key = f"eq-{readers}-{stop}"
    local = _local(shards, workers=readers, n=n, stop=stop)
    loader = {"device": "cpu"} if readers == 2 else {}  # the device feed on the way too
    try:
        got = cluster.run(_remote, key, shards, readers=readers, options={"stop": stop}, n=n, loader=loader)
    finally:
        if (readers, stop) != (2, "all_exhausted"):  # that one serves the tests below
            cluster.run(_close, key)
    assert len(got["views"]) == len(local["views"]) > 100
    assert got["views"] == local["views"]
    assert got["state"] == local["state"] and got["counters"] == local["counters"]
    assert got["report"]["readers"] == max(readers, 1) and got["report"]["restarts"] == 0
    # groups of up to 32 batches: far fewer calls than batches
    assert got["report"]["calls"] < len(got["views"]) / 4


def _every_sample(shards: Any) -> dict[str, Any]:
    remote = make_remote_loader(_service("eq-2-all_exhausted", shards, readers=2), rank=0)
    seen: Counter[str] = Counter()
    wrong = 0
    for b in remote:
        for k, key in enumerate(b.keys):
            n = int(b.lengths[k])
            wrong += not np.array_equal(b.tokens[k, :n].numpy(), expected_tokens(key, n))
            seen[key] += 1
        b.tokens[0, 0] = -1  # a batch handed out is the trainer's own memory, writable
    return {"seen": dict(seen), "wrong": wrong}


@pytest.mark.slow
def test_every_sample_exactly_once_over_a_pass(cluster: Cluster, shards: Any) -> None:
    got = cluster.run(_every_sample, shards)
    assert got["wrong"] == 0
    assert set(got["seen"]) == every_key(shards) and set(got["seen"].values()) == {1}


# ---- resume ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_in_all_four_directions(cluster: Cluster, shards: Any) -> None:
    """A state saved by either loader resumes on either, batch for batch: remote -> remote, remote ->
    in-process, in-process -> remote, in-process -> in-process; at the start, mid-pass (between
    snapshots: replays) and in the pass's tail, where readers have ended."""
    key = "eq-2-all_exhausted"
    reference = _local(shards, workers=2)["views"]
    for cut in (0, 37, 102, len(reference) - 5, len(reference) - 1):
        saved_remote = cluster.run(_remote, key, shards, readers=2, n=cut)["state"]
        saved_local = _local(shards, workers=2, n=cut)["state"]
        assert saved_remote == saved_local, cut
        for state in (saved_remote, saved_local):
            assert cluster.run(_remote, key, shards, readers=2, state=state)["views"] == reference[cut:], cut
            assert _local(shards, workers=2, state=state)["views"] == reference[cut:], cut


# ---- a reader dies --------------------------------------------------------------------------------


def _kill_readers_mid_pass(shards: Any) -> dict[str, Any]:
    """Reader 1's process is SIGKILLed after 40 batches (Ray restarts the actor); reader 0 is killed
    for good through Ray after 80 (the service makes a new actor). Small groups, so that both
    readers still have batches to make when they die."""
    service = _service("eq-2-all_exhausted", shards, readers=2)
    pids = [ray.get(h.describe.remote())["pid"] for h in service.handles(0)]
    remote = make_remote_loader(service, rank=0, timeout=60, batches_per_call=4)
    views = []
    for b in remote:
        views.append(view(b))
        if len(views) == 40:
            os.kill(pids[1], signal.SIGKILL)
        if len(views) == 80:
            ray.kill(service.handles(0)[0], no_restart=True)
    after = [ray.get(h.describe.remote())["pid"] for h in service.handles(0)]
    return {"views": views, "report": remote.service_report(), "pids": (pids, after)}


@pytest.mark.slow
def test_readers_killed_mid_pass_are_started_again_and_the_stream_continues_exactly(
    cluster: Cluster, shards: Any
) -> None:
    reference = _local(shards, workers=2)["views"]
    got = cluster.run(_kill_readers_mid_pass, shards)
    before, after = got["pids"]
    assert before[0] != after[0] and before[1] != after[1]  # both readers run in new processes
    assert got["report"]["restarts"] == 2
    assert got["views"] == reference  # no sample twice, none lost, the same order


# ---- the number of readers changes between checkpoints ----------------------------------------------


def _rescaled(shards: Any, *, state: Any, readers: int) -> dict[str, Any]:
    service = _service("eq-2-all_exhausted", shards, readers=2)
    service.resize(readers)
    try:
        remote = make_remote_loader(MixerService.connect(service.name), rank=0)
        remote.load_state_dict([state])  # the list of the saved ranks' states: elastic resume
        return {"views": take(remote, None), "readers": remote.service_report()["readers"]}
    finally:
        service.resize(2)


@pytest.mark.slow
def test_two_readers_saved_three_continue_every_sample_once(cluster: Cluster, shards: Any) -> None:
    key = "eq-2-all_exhausted"
    before = cluster.run(_remote, key, shards, readers=2, n=45)
    after = cluster.run(_rescaled, shards, state=before["state"], readers=3)
    assert after["readers"] == 3
    # the in-process loader's elastic resume gives the same batches
    local = mixer.make_loader(mixture(shards), num_workers=3)
    local.load_state_dict([before["state"]])
    assert after["views"] == take(local, None)
    seen = Counter(k for v in before["views"] + after["views"] for k in v[0])
    assert set(seen) == every_key(shards) and set(seen.values()) == {1}


# ---- adaptive mixing: feedback reaches remote readers ------------------------------------------------


def _adaptive_views(shards: Any, *, remote: bool) -> dict[str, Any]:
    options = {"stop": "never", "schedule": mixer.Adaptive(update_every=8)}
    if remote:
        loader: Any = make_remote_loader(_service("adaptive", shards, readers=2, **options), rank=0)
    else:
        loader = mixer.make_loader(mixture(shards, **options), num_workers=2)
    views = []
    for b in loader:
        # a loss that differs per source, so the shares move
        loss = b.lengths.double() / 1000 + b.source.double()
        loader.feedback(b, loss)
        views.append(view(b))
        if len(views) == 120:
            break
    return {"views": views, "state": plain(loader.state_dict()), "adaptive": loader.stats()["adaptive"]}


@pytest.mark.slow
def test_adaptive_feedback_gives_the_same_batches(cluster: Cluster, shards: Any) -> None:
    local = _adaptive_views(shards, remote=False)
    try:
        got = cluster.run(_adaptive_views, shards, remote=True)
    finally:
        cluster.run(_close, "adaptive")
    assert local["adaptive"]["updates"] >= 10
    assert got["views"] == local["views"] and got["state"] == local["state"]


# ---- two trainers under torchrun, and a trainer restart -------------------------------------------


def _torchrun(spec: Path, out: Path) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={port}", str(HERE / "service_worker.py"), str(spec), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def _two_trainers(shards: Any, spec: Path, out: Path) -> None:
    _service("world2", shards, readers=1, world=2)
    try:
        # each rank stops part-way, saves its state and leaves the cluster; then it joins again as a
        # new Ray job and resumes from the file against the same running service
        _torchrun(spec, out)
    finally:
        _close("world2")


@pytest.mark.slow
def test_two_torchrun_trainers_share_one_service_and_restart_against_it(
    cluster: Cluster, shards: Any, tmp_path: Path
) -> None:
    spec = tmp_path / "spec.json"
    cuts = [9, 14]
    spec.write_text(json.dumps({"service": "world2", "address": cluster.address, "cuts": cuts}))
    cluster.run(_two_trainers, shards, spec, tmp_path, timeout=400)
    ranks = []
    for r in range(2):
        local = mixer.make_loader(mixture(shards, rank=r, world_size=2), num_workers=1)
        reference = json.loads(json.dumps(take(local, None)))
        ran = json.loads((tmp_path / f"run-rank{r}.json").read_text())
        resumed = json.loads((tmp_path / f"resume-rank{r}.json").read_text())
        assert ran == reference[: cuts[r]], r
        assert [v for v in resumed if v != ["filler"]] == reference[cuts[r] :], r
        ranks.append((reference, resumed))
    # the rank sync evens the restarted ranks out with fillers: both hand out the same number of batches
    assert len(ranks[0][1]) == len(ranks[1][1]) and ["filler"] in ranks[0][1] + ranks[1][1]
    seen = Counter(k for reference, _ in ranks for v in reference for k in v[0])
    assert set(seen) == every_key(shards) and set(seen.values()) == {1}


# ---- a reader's data fails -----------------------------------------------------------------------


class _FailOn:
    """A decode that fails on one key once armed (after the mixture has profiled its sources); the
    armed flag travels with the pickled mixture to the reader actors."""

    def __init__(self, key: str) -> None:
        self.key, self.armed = key, False

    def __call__(self, sample: dict[str, Any]) -> np.ndarray:
        if self.armed and sample["__key__"] == self.key:
            raise ValueError(f"injected failure at {self.key}")
        from mixer.read.decode import default_tokens

        return default_tokens(sample)


def _failing_mixture(shards: Any) -> mixer.Mixture:
    decode = _FailOn("web-000003-000040")
    mix = mixture(shards, source_options={"decode": decode})
    decode.armed = True
    return mix


def _until_the_error(loader: Any) -> tuple[list[Any], str, str]:
    views = []
    try:
        for b in loader:
            views.append(view(b))
    except Exception as exc:
        return views, type(exc).__name__, str(exc).splitlines()[0]
    return views, "", ""


def _remote_failing(shards: Any) -> tuple[list[Any], str, str]:
    with MixerService(_failing_mixture(shards), readers_per_trainer=0, reader_options=READERS) as service:
        return _until_the_error(make_remote_loader(service, rank=0))


@pytest.mark.slow
def test_a_readers_error_comes_after_the_batches_made_before_it(cluster: Cluster, shards: Any) -> None:
    local = _until_the_error(mixer.make_loader(_failing_mixture(shards), num_workers=0))
    remote = cluster.run(_remote_failing, shards)
    assert local[1] and "injected failure at web-000003-000040" in local[2] and len(local[0]) > 5
    assert remote[0] == local[0]  # every batch made before the failure was handed out first
    assert remote[1].endswith(local[1]) and local[2] in remote[2]


# ---- the service cannot reach its readers -----------------------------------------------------------


def _unplaceable(shards: Any) -> tuple[str, float]:
    start = time.monotonic()
    try:
        MixerService(
            mixture(shards), readers_per_trainer=1, reader_options={"resources": {"nowhere": 1}}, start_timeout=2
        )
    except mixer.MixerError as exc:
        return str(exc), time.monotonic() - start
    return "", time.monotonic() - start


@pytest.mark.slow
def test_readers_that_cannot_be_placed_fail_with_a_named_error_in_bounded_time(cluster: Cluster, shards: Any) -> None:
    message, waited = cluster.run(_unplaceable, shards)
    assert "did not start within 2 s" in message and "reader 0 of trainer 0" in message
    assert waited < 15


def _lose_the_readers_node(shards: Any) -> dict[str, Any]:
    """A second node (a CPU node of its own, as readers would have) joins; the service's reader lives
    there; mid-pass the node dies (its raylet and the reader's process killed)."""
    address = ray.get_runtime_context().gcs_address
    node = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            f"--address={address}",
            "--num-cpus=1",
            '--resources={"readers_node": 1}',
            "--include-log-monitor=false",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(n["Alive"] and "readers_node" in n["Resources"] for n in ray.nodes()):
            assert time.monotonic() < deadline and node.poll() is None, "the second node did not join"
            time.sleep(0.2)
        options = {"num_cpus": 0, "resources": {"readers_node": 1}}
        service = MixerService(mixture(shards), readers_per_trainer=0, name="lost", reader_options=options)
        pid = ray.get(service.handles(0)[0].describe.remote())["pid"]
        remote = make_remote_loader(service, rank=0, timeout=3)
        it = iter(remote)
        got = [view(next(it)) for _ in range(5)]
        os.kill(pid, signal.SIGKILL)
        os.killpg(node.pid, signal.SIGKILL)  # the node's processes (started here, in their own group)
        start = time.monotonic()
        try:
            for b in it:
                got.append(view(b))
        except mixer.MixerError as exc:
            return {"error": str(exc), "waited": time.monotonic() - start, "views": got}
        return {"error": None, "waited": time.monotonic() - start, "views": got}
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


@pytest.mark.slow
def test_a_lost_reader_node_ends_the_pass_with_a_named_error_in_bounded_time(cluster: Cluster, shards: Any) -> None:
    got = cluster.run(_lose_the_readers_node, shards)
    assert got["error"] is not None and "service 'lost'" in got["error"] and "within 3 s" in got["error"]
    assert got["waited"] < 3 + 20
    # what came before the loss was the stream's own beginning
    assert got["views"][:5] == _local(shards, workers=0, n=5)["views"]


def _bad_uses(shards: Any) -> list[str]:
    out = []
    for call in (
        lambda: MixerService.connect("no-such-service"),
        lambda: make_remote_loader(_service("eq-2-all_exhausted", shards, readers=2), rank=1),
        lambda: make_remote_loader(_service("eq-2-all_exhausted", shards, readers=2), rank=0, batches_per_call=0),
        lambda: MixerService(mixture(shards), readers_per_trainer=2, name="eq-2-all_exhausted", reader_options=READERS),
    ):
        try:
            call()
            out.append("no error")
        except mixer.MixerError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    # the running service of that name is untouched
    out.append(str(len(take(make_remote_loader(_service("eq-2-all_exhausted", shards, readers=2), rank=0), 3))))
    return out


@pytest.mark.slow
def test_bad_uses_are_named_errors(cluster: Cluster, shards: Any) -> None:
    missing, rank, group, taken, still = cluster.run(_bad_uses, shards)
    assert missing.startswith("MixerError: no mixer service 'no-such-service'")
    assert rank.startswith("ConfigError: make_remote_loader: rank must be in [0, 1) (got 1)")
    assert group.startswith("ConfigError: make_remote_loader batches_per_call must be an int >= 1")
    assert (
        taken.startswith("MixerError: mixer service 'eq-2-all_exhausted': an actor named") and "already lives" in taken
    )
    assert still == "3"
