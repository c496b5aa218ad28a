"""The Ray side of tests/test_service.py: one process inside a network namespace that has only
loopback, which starts the session's local Ray cluster and runs the functions the tests send it.

    unshare -n sh -c 'ip link set lo up && exec python tests/support/ray_driver.py READ_FD WRITE_FD TEMP_DIR'

Ray does not stay on loopback by itself (it replaces 127.0.0.1 by the machine's address and its
processes listen on every interface), so this process refuses to start Ray unless the only network
interface it sees is ``lo``. Requests come as pickles on READ_FD: ``(function, args, kwargs)`` run
here (functions by reference: they live in test_service, importable from this folder), answered on
WRITE_FD with ``("ok", result)`` or ``("err", exception, traceback text)``; None ends the session
(Ray is shut down). Its first message is ``("ready", {"address": <GCS address>})`` or
``("refused", reason)``.
"""

from __future__ import annotations

import pickle
import socket
import sys
import traceback
from multiprocessing.connection import Connection


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def _next(requests: Connection) -> object:
    try:
        return requests.recv()
    except EOFError:  # the test process is gone: end the session all the same
        return None


def main() -> None:
    requests = Connection(int(sys.argv[1]), writable=False)
    answers = Connection(int(sys.argv[2]), readable=False)
    seen = interfaces()
    if seen != ["lo"]:
        answers.send(("refused", f"network interfaces {seen}: not a loopback-only namespace; Ray not started"))
        return
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=sys.argv[3],
        object_store_memory=512 << 20,
        log_to_driver=False,
    )
    answers.send(("ready", {"address": ray.get_runtime_context().gcs_address}))
    try:
        while (request := _next(requests)) is not None:
            fn, args, kwargs = request
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001  (everything goes back to the test)
                text = traceback.format_exc()
                try:
                    pickle.dumps(exc)
                except Exception:
                    exc = RuntimeError(f"{type(exc).__name__}: {exc}")
                answers.send(("err", exc, text))
            else:
                answers.send(("ok", result))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
