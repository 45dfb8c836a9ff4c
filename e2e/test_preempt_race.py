"""Issue 46: a stop that races the line's own end, through the whole stack (real Envoy, the real
sidecar with its own feeder, the fake router's token path, one slot). The line has read every
token when a person's request makes the scheduler stop it; the next event is the answer's end,
and the end wins: the line's one answer is whole with no stop counted (no `stop` record, nothing in
llamaswap_preemptions_total), it is not sent again, its
part ends `served`, and the person runs once the line has let go."""

from __future__ import annotations

import asyncio
import pathlib

from harness import activity_records, async_wait_for, http_get, metric_samples
from preempt_e2e import CONTENT, MAX_TOKENS, check_answer, parts, prompt_of, stop_records, stopping


async def test_a_stop_that_comes_with_the_line_s_end_changes_nothing(tmp_path: pathlib.Path) -> None:
    async with stopping(tmp_path, paused_at=MAX_TOKENS) as state:  # every token sent, the end not yet
        admin = state.stack.sidecar.admin_url
        state.fake.tokens.hold_after = None
        state.fake.tokens.release()  # the next event is the end
        record = await asyncio.to_thread(state.output)
        check_answer(record, CONTENT, "model-a", stops=0)
        await async_wait_for(lambda: "person" in state.fake.order(), what="the person running after the line")
        state.fake.release("person")
        assert (await state.person).status == 200
        [part] = parts(admin, state.line_id)
        assert part["outcome"] == "served"
        person = (await async_wait_for(lambda: activity_records(admin, {"person"}), what="the person's record"))
        assert person["person"]["outcome"] == "served"
        # Sent once, its stream read to its end (never cut), and nothing of it waits to resume.
        assert state.fake.tokens.completions == [(prompt_of(CONTENT), MAX_TOKENS)] and state.fake.tokens.left == []
        assert state.stack.sidecar.queue()["waiting"] == []
        # The end won: it was no stop. No stop record, none counted.
        assert stop_records(admin) == []
        samples = metric_samples(http_get(f"{admin}/metrics")[1].decode())
        assert samples['llamaswap_preemptions_total{band="batch"}'] == 0.0
