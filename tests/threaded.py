"""Work run in several threads at once, for tests that drive blocking clients side by side
(tests/averaging/test_collaborative.py, test_train.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(work: Callable[[int], None], count: int, timeout: float) -> None:
    """`work(0)` … `work(count - 1)`, each in its own thread; waits up to `timeout` seconds for each and re-raises
    in the calling thread the first error any of them raised."""
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            work(index)
        except BaseException as error:  # re-raised in the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors:
        raise errors[0]
