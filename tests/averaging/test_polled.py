"""`averaging.polled.unless`: the work's answer, the default once the condition holds, the work's error as itself."""

from __future__ import annotations

import pytest
import trio

from averaging.polled import unless


class Refused(Exception):
    pass


async def test_the_work_answers_or_the_condition_gives_it_up_or_its_error_is_raised_as_itself(autojump_clock):
    async def answer(value: int) -> int:
        await trio.sleep(1.0)
        return value

    assert await unless(lambda: False, 0.1, "gave up", answer, 7) == 7

    flag = {"set": False}

    async def forever() -> int:
        flag["set"] = True  # the condition holds from now on
        await trio.sleep_forever()
        return 0

    began = trio.current_time()
    assert await unless(lambda: flag["set"], 0.1, "gave up", forever) == "gave up"
    assert trio.current_time() - began <= 0.1 + 1e-9

    async def refuse() -> int:
        await trio.sleep(0.5)
        raise Refused("no")

    with pytest.raises(Refused, match="no"):  # not an ExceptionGroup holding it
        await unless(lambda: False, 0.1, "gave up", refuse)
