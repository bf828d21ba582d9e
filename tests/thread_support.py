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


def runs_unlike_alone(run, inputs, same) -> tuple[list, list[str]]:
    """`inputs[t]`: thread t's inputs. Each is run once alone first (one thread, in order), then every
    thread runs its own again, all threads at once. Returns the outputs alone and, for each threaded output
    that is not same(output, its output alone), "thread t run r (n rows)": concurrent runs must not see
    each other's rows or scratch."""
    alone = [[run(x) for x in per] for per in inputs]
    bad: list[str] = []

    def work(t):
        for r, x in enumerate(inputs[t]):
            if not same(run(x), alone[t][r]):
                bad.append(f"thread {t} run {r} ({len(x)} rows)")

    run_threads(work, [(t,) for t in range(len(inputs))])
    return alone, bad
