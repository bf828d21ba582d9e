"""One function on several threads at once, for the concurrency tests (CPU and GPU)."""
from __future__ import annotations

import threading


def run_threads(work, args_list) -> None:
    """Starts work(*args) on one thread per entry of args_list, all before any is joined, and waits for all."""
    threads = [threading.Thread(target=work, args=tuple(args)) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
