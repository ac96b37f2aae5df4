"""Weight-sync faults on HTTP engines (a reviewer's cases): a failed control call never leaves an engine paused or
its client holding requests for good, errors name the engine's URL, and a client attached to a server that already
holds an adapter can still push it. Every case runs `SGLangEngine` against engine-serve's app around the fake engine
of tests/test_http_engine.py."""

from __future__ import annotations

import threading
import time

import pytest

from rl_multilora.weight_sync import WeightSync
from rollout.engines.multi import MultiEngine
from rollout.server.http_server import BackgroundServer
from rollout.sglang.client import SGLangEngine, SGLangError
from rollout.types import GenerateRequest, SamplingParams
from tests.test_http_engine import CONFIG, FakeEngine, tensors

REQUEST = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))


class _Backend:
    def adapter_state_dict(self, name):
        return tensors(1)

    def peft_config(self, name):
        return CONFIG


def _generate_within(engine: SGLangEngine, seconds: float) -> list | None:
    """`engine.generate([REQUEST])` in a thread; its results, or None when it has not returned within `seconds`."""
    out: dict[str, list] = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate([REQUEST])), daemon=True)
    thread.start()
    thread.join(seconds)
    return out.get("r")


def test_one_engines_failed_pause_leaves_no_engine_paused():
    """Engine B refuses the pause (a wrong key): the sync raises B's error naming its URL, engine A (paused first) is
    resumed, and A's next generate runs; it used to wait for good."""
    fake_a, fake_b = FakeEngine(), FakeEngine()
    with BackgroundServer(fake_a) as sa, BackgroundServer(fake_b, api_key="k") as sb:
        a = SGLangEngine(sa.url, tensor_format="safetensors", timeout=5)
        b = SGLangEngine(sb.url, tensor_format="safetensors", timeout=5, api_key="wrong")
        with pytest.raises(SGLangError, match=f"{sb.url}/pause_generation: 401"):
            WeightSync(MultiEngine([a, b]), _Backend()).sync(push=[("x", 0)], unload=[])
        assert fake_a.calls[0] == "pause" and "resume" in fake_a.calls and "x" not in fake_a.versions
        results = _generate_within(a, 5)
        assert results is not None and results[0].finish_reason == "length"


def test_a_failed_resume_releases_the_clients_held_requests_and_flushes_on_retry():
    """`/continue_generation` answers after the client's timeout once: resume raises an error naming the URL and the
    timeout, the client holds no request (it used to, for good, even after close()), and a retried resume flushes
    the cache for the adapter changed in the pause."""

    class SlowResume(FakeEngine):
        slow, flushes = True, 0

        def resume(self):
            if self.slow:
                self.slow = False
                time.sleep(2.5)
            super().resume()

        def flush_cache(self):
            self.flushes += 1
            return True

    fake = SlowResume()
    with BackgroundServer(fake) as server:
        engine = SGLangEngine(server.url, tensor_format="safetensors", timeout=1)
        engine.pause()
        engine.load_adapter("a", tensors(1), CONFIG, version=0)
        with pytest.raises(SGLangError, match=rf"{server.url}/continue_generation failed: ReadTimeout.*timeout=1 s"):
            engine.resume()
        time.sleep(2)  # the server resumes once its slow call is done
        results = _generate_within(engine, 5)
        assert results is not None and results[0].finish_reason == "length"
        flushes = fake.flushes
        engine.resume()
        assert fake.flushes == flushes + 1


def test_close_releases_requests_held_by_a_pause():
    with BackgroundServer(FakeEngine()) as server:
        engine = SGLangEngine(server.url, tensor_format="safetensors", timeout=5)
        engine.pause()
        out: dict[str, list] = {}
        thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate([REQUEST])), daemon=True)
        thread.start()
        time.sleep(0.2)
        engine.close()
        thread.join(5)
        assert not thread.is_alive()
        assert out["r"][0].finish_reason == "error" and "closed" in out["r"][0].error


def test_a_new_client_pushes_an_adapter_the_server_already_holds():
    """SGLang refuses to load a name it holds ("... because it is already loaded"); a client attached to a running
    server (a resumed run with rollout.url) did not know it held `a`, and its first push failed. It unloads and
    pushes again."""

    class SGLangLike(FakeEngine):
        def load_adapter(self, name, tensors, config, version=None):
            if name in self.versions:
                raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            if name == "full":
                raise RuntimeError("no free slot")
            return super().load_adapter(name, tensors, config, version)

    fake = SGLangLike()
    with BackgroundServer(fake) as server:
        SGLangEngine(server.url, tensor_format="safetensors").load_adapter("a", tensors(1), CONFIG, version=0)
        second = SGLangEngine(server.url, tensor_format="safetensors")
        assert second.adapter_versions() == {}
        assert second.load_adapter("a", tensors(2), CONFIG, version=1) == 1
        assert fake.versions == {"a": 1} and second.adapter_versions() == {"a": 1}
        calls = len(fake.calls)
        with pytest.raises(
            SGLangError, match=f"{server.url}/load_lora_adapter_from_tensors failed with HTTP 400: .*: no free slot$"
        ):
            second.load_adapter("full", tensors(1), CONFIG, version=0)  # any other refusal: not retried
        assert fake.calls[calls:] == []


def test_a_sync_that_fails_part_way_still_records_what_the_engine_took():
    """The engine unloaded `x` and took `a` at version 1, then `b`'s push failed: the caller got no stats, so the
    tenant manager still had `x` in the engine and `a` at version 0 (a retry of the same plan failed unloading `x`,
    and an asynchronous run served `a` at a version its records did not say). A reviewer's repro."""
    import torch

    from rl_multilora.loop import Runtime
    from rl_multilora.weight_sync import SyncStats

    class Engine:
        publishes_without_pause = True

        def __init__(self):
            self.loaded = {"x": 0, "a": 0, "b": 0}

        def pause(self):
            pass

        def resume(self):
            pass

        def load_adapter(self, name, tensors, config, version=None):
            if name == "b":
                raise RuntimeError("load of b failed")
            self.loaded[name] = version

        def unload_adapter(self, name):
            del self.loaded[name]

    class Backend:
        def adapter_state_dict(self, name):
            return {"k": torch.zeros(2)}

        def peft_config(self, name):
            return {}

    applied = []
    engine = Engine()
    rt = Runtime.__new__(Runtime)  # the parts sync_now reads, nothing else
    rt.engine = engine
    rt.weight_sync = WeightSync(engine, Backend())
    rt.cfg = type("Cfg", (), {"rollout": type("R", (), {"mode": "async"})()})()
    rt.tenants = type(
        "Tenants",
        (),
        {
            "sync_plan": lambda self: ([("a", 1), ("b", 1)], ["x"]),
            "apply_sync": lambda self, p, u: applied.append((p, u)),
        },
    )()
    with pytest.raises(RuntimeError, match="load of b failed"):
        rt.sync_now()
    assert engine.loaded == {"a": 1, "b": 0}
    assert applied == [({"a": 1}, ["x"])]  # what it took is recorded; b stays to push again
    stats = SyncStats()
    with pytest.raises(RuntimeError):
        WeightSync(Engine(), Backend()).sync([("a", 2), ("b", 2)], ["x"], pause=False, stats=stats)
    assert stats.pushed == {"a": 2} and stats.adapters_unloaded == ["x"]
