"""One function on several threads at once, for the concurrency tests (CPU and GPU)."""
from __future__ import annotations

import threading


def run_threads(work, args_list) -> None:
    """Starts work(*args) on one thread per entry of args_list, all before any is joined, waits for all,
    then raises the first exception a thread raised: a thread's exception would otherwise only end that
    thread (pytest reports it as a warning), and a test whose every threaded run failed would pass."""
    errors: list[BaseException] = []

    def run(args):
        try:
            work(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(tuple(args),)) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
