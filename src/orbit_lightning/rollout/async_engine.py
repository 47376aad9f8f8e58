"""asyncio front end for a `RolloutEngine`: streaming per request, one background task stepping the engine.

Steps run in a worker thread (`asyncio.to_thread`), so reward functions and the trainer's coroutines keep the
event loop while the GPU decodes. The engine's lock makes `stage_adapter` / `activate_adapter` land between
steps. `stage_adapter` here *waits* for the inactive slot to drain under the "finish" policy instead of raising.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from torch import Tensor

from .engine import RolloutEngine
from .outputs import RequestOutput
from .params import SamplingParams


class AsyncRolloutEngine:
    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._loop_task: asyncio.Task | None = None

    async def generate(self, prompt: list[int] | str, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield this request's output after every step that changed it (a step adds up to the engine's
        `decode_steps` tokens per sample); the last one has `finished=True`. Leaving the `async for` early aborts
        the request."""
        rid = self.engine.add_request(prompt, params, request_id)
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[rid] = queue
        self._ensure_stepping()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):  # the step loop failed: surface it in every consumer
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.engine.abort(rid)

    async def stage_adapter(self, version: int, state: dict[str, Tensor], poll_s: float = 0.001) -> None:
        """Stage into the inactive slot as soon as no in-flight sequence uses it any more."""
        while not self.engine.can_stage():
            self._ensure_stepping()
            await asyncio.sleep(poll_s)
        self.engine.stage_adapter(version, state)

    def activate_adapter(self, version: int) -> None:
        self.engine.activate_adapter(version)

    def _ensure_stepping(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        # has_unfinished() is read on the event loop thread, where requests are added: no lost wake-up.
        while self.engine.has_unfinished():
            try:
                outs = await asyncio.to_thread(self.engine.step)
            except Exception as e:
                for queue in self._queues.values():
                    queue.put_nowait(e)
                raise
            for out in outs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
