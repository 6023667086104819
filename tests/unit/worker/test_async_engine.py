"""The engine thread: the engine is built where its steps run, and torch work elsewhere ends with its thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from glm5.errors import CheckpointError
from glm5_worker.config import EngineConfig
from glm5_worker.engine.async_engine import AsyncEngine, EngineStopped
from glm5_worker.engine.engine import Engine
from glm5_worker.engine.sequence import SamplingParams
from glm5_worker.runner.threads import in_own_thread


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_model: Path) -> None:
    built_on: list[threading.Thread] = []

    def build() -> Engine:
        built_on.append(threading.current_thread())
        return Engine(EngineConfig(model=str(tiny_model), max_model_len=512, kv_cache_bytes=16 << 20))

    def os_name() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    async def main() -> tuple[threading.Thread, str, list[int]]:
        engine = await AsyncEngine.start(build)
        try:
            stepping = await engine.run(threading.current_thread)
            named = await engine.run(os_name)
            params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            tokens = [t async for out in engine.generate(None, None, [5, 6, 7], params) for t in out.token_ids]
            return stepping, named, tokens
        finally:
            engine.shutdown()

    stepping, named, tokens = asyncio.run(main())
    assert built_on == [stepping]
    assert stepping is not threading.main_thread() and stepping.name == "glm5-engine"
    # the OS's name too (top -H, py-spy, benchmarks/data_plane.py tell the step's CPU from the serving path's)
    assert named == "glm5-engine"
    assert len(tokens) == 4


def test_a_failed_build_is_the_start_error_and_takes_no_requests(tmp_path: Path) -> None:
    """A request after a failed build gets EngineStopped, also one that slipped past the accepting check just as
    the engine thread ended: before, its command sat in a queue nobody read and the caller waited forever (this
    test hung one CI run that way)."""

    def build() -> Engine:
        return Engine(EngineConfig(model=str(tmp_path / "missing"), max_model_len=512))

    async def main() -> None:
        engine = AsyncEngine(build)
        with pytest.raises(CheckpointError):
            await engine.started()
        with pytest.raises(EngineStopped):
            async for _ in engine.generate(None, None, [1], SamplingParams()):
                pass
        engine._thread.join(timeout=10)
        engine._accepting = True  # as if a request had checked it before the thread ended
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(engine.run(lambda: 1), timeout=10)
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(anext(engine.generate(None, None, [1], SamplingParams())), timeout=10)
        engine.shutdown()  # nothing was built: nothing to close

    asyncio.run(main())


def test_in_own_thread_returns_and_raises_on_a_thread_that_ends() -> None:
    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return 42

    assert in_own_thread(work, "t-ok").result(timeout=10) == 42
    (thread,) = ran_on
    assert thread is not threading.current_thread() and thread.name == "t-ok"
    thread.join(timeout=10)
    assert not thread.is_alive()

    def fail() -> int:
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):
        in_own_thread(fail, "t-fail").result(timeout=10)
