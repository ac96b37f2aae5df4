"""SGLang's real HTTP app and LoRA bookkeeping with the GPU model replaced by a recorder (a test harness).

Run with a Python that has `sglang` installed (it needs no GPU):

    python tests/sglang_real_app_server.py --model DIR --port P --api-key K --log events.jsonl

What is SGLang's own code here (imported from the installed package, not copied):
  - the FastAPI `app` of `sglang.srt.entrypoints.http_server`: routes, request decoding into SGLang's structs,
    `/generate`'s contract check, per-endpoint auth levels and `add_api_key_middleware`;
  - `TokenizerManager`'s LoRA methods: `load_lora_adapter_from_tensors`, `load_lora_adapter`,
    `unload_lora_adapter` (unregister, wait until in-flight requests release the adapter, then unload),
    `_validate_and_resolve_lora` for every `/generate` and the real `LoRARegistry`;
  - the TP worker's `load_lora_adapter_from_tensors` (`MultiprocessingSerializer.deserialize`, i.e. SGLang's
    restricted unpickler, after `monkey_patch_torch_reductions`) and `LoRAManager`'s load/unload (`LoRAConfig`,
    `LoRAAdapter.initialize_weights_from_tensors` / `initialize_weights`, name validation);
  - `SamplingParams(**params).normalize(None)` and `.verify(vocab_size)` for every request's sampling params.

What is not: there is no model forward. `/generate` answers in SGLang's response shape (as recorded in
`tests/fixtures/sglang_api.json`) with deterministic tokens, and every event (the tensors the backend received,
with sha256 per tensor, the adapter's normalized weight names, the sampling params) goes to `--log` as JSON lines
so a test can check what SGLang's code made of the client's requests.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import threading
import time


def _sha256(t) -> str:
    import torch

    flat = t.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class EventLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, kind: str, **fields) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")


def build(args: argparse.Namespace):  # noqa: C901 - one place that wires SGLang's pieces together
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=args.model,
        enable_lora=True,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        device="cpu",
        api_key=args.api_key,
    )
    publish(server_args, role="tokenizer", ranks=SpawnRanks(world_rank=0))

    import sglang.srt.entrypoints.http_server as http_server
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.lora.utils import get_normalized_target_modules
    from sglang.srt.managers.io_struct import (
        LoadLoRAAdapterFromTensorsReqInput,
        LoadLoRAAdapterReqInput,
        UnloadLoRAAdapterReqInput,
    )
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.managers.tp_worker import BaseTpWorker
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.auth import add_api_key_middleware
    from transformers import AutoConfig

    log = EventLog(args.log)
    hf_config = AutoConfig.from_pretrained(args.model)

    # -- backend: SGLang's LoRAManager without the GPU memory pool, behind SGLang's TP worker code.
    lora_manager = LoRAManager.__new__(LoRAManager)
    lora_manager.__dict__.update(
        base_hf_config=hf_config,
        load_config=LoadConfig(),
        lora_backend=None,
        base_model=None,
        speculative_algorithm=None,
        attn_dp_enabled=False,
        max_loras_per_batch=args.max_loras_per_batch,
        loras={},
        configs={},
        lora_refs={},
        num_pinned_loras=0,
    )

    # SGLang's memory pool without its GPU buffers: its real `can_support` (rank and target-module checks against
    # --max-lora-rank / --lora-target-modules), and nothing to free on unload.
    # SGLang resolves "all" against the loaded model's linear layers; these are a Llama's.
    llama_linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pool_modules = llama_linears if "all" in args.lora_target_modules else args.lora_target_modules
    pool = LoRAMemoryPool.__new__(LoRAMemoryPool)
    pool.__dict__.update(
        max_lora_rank=args.max_lora_rank,
        lora_added_tokens_size=0,
        target_modules=get_normalized_target_modules(pool_modules),
    )
    pool.remove_lora = lambda lora_id: None
    lora_manager.memory_pool = pool
    lora_manager._notify_lora_slots_updated = lambda slots: None

    def _summary(lora_id: str) -> dict:
        adapter = lora_manager.loras[lora_id]
        layers = {str(i): sorted(layer.weights) for i, layer in enumerate(adapter.layers) if layer.weights}
        return {"scaling": adapter.scaling, "r": adapter.config.r, "layers": layers}

    class ModelRunner:
        def load_lora_adapter_from_tensors(self, ref, tensors, config_dict, added_tokens_config):
            log.write(
                "backend_tensors",
                lora_name=ref.lora_name,
                tensors={
                    k: {"sha256": _sha256(v), "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                    for k, v in tensors.items()
                },
            )
            result = lora_manager.load_lora_adapter_from_tensors(ref, tensors, config_dict, added_tokens_config)
            if result.success:
                log.write("backend_loaded", lora_name=ref.lora_name, source="tensors", **_summary(ref.lora_id))
            return result

        def load_lora_adapter(self, ref):
            result = lora_manager.load_lora_adapter(ref)
            if result.success:
                log.write("backend_loaded", lora_name=ref.lora_name, source="path", **_summary(ref.lora_id))
            return result

        def unload_lora_adapter(self, ref):
            result = lora_manager.unload_lora_adapter(ref)
            log.write("backend_unloaded", lora_name=ref.lora_name, success=result.success)
            return result

    class Worker:  # BaseTpWorker is abstract; borrow its LoRA methods and the per-rank deserializer
        model_runner = ModelRunner()
        deserialize_own_rank = BaseTpWorker.deserialize_own_rank

    worker = Worker()

    # SGLang's own load/unload, without the wrappers that log free GPU memory.
    lora_manager.load_lora_adapter = lora_manager._load_lora_adapter
    lora_manager.unload_lora_adapter = lora_manager._unload_lora_adapter

    # -- front end: SGLang's TokenizerManager LoRA logic; generation answered by a recorder.
    class OracleTokenizerManager(TokenizerManager):
        def __init__(self) -> None:  # noqa: D107 - no scheduler, no tokenizer process
            self.lora_registry = LoRARegistry(None)
            self.lora_ref_cache = {}
            self.pending_lora_unloads = {}
            self.lora_update_lock = asyncio.Lock()
            self.enable_lora = True
            self.server_status = ServerStatus.Up
            self.gracefully_exit = False
            self.is_generation = True
            self.paused_mode = None
            self._pause_generation = 0
            self._inflight: dict[str, asyncio.Future] = {}
            self.last_receive_tstamp = time.time()
            self.rid_to_state = {}
            self.server_args = server_args  # /server_info reports these (tp_size among them)
            self.startup_time = time.time()

        async def get_internal_state(self):
            return [{}]

        def auto_create_handle_loop(self) -> None:
            pass

        async def update_lora_adapter_communicator(self, obj):
            if isinstance(obj, LoadLoRAAdapterFromTensorsReqInput):
                return [BaseTpWorker.load_lora_adapter_from_tensors(worker, obj)]
            if isinstance(obj, LoadLoRAAdapterReqInput):
                return [BaseTpWorker.load_lora_adapter(worker, obj)]
            if isinstance(obj, UnloadLoRAAdapterReqInput):
                return [BaseTpWorker.unload_lora_adapter(worker, obj)]
            raise TypeError(type(obj))

        async def pause_generation(self, obj) -> None:
            self.paused_mode = obj.mode
            self._pause_generation += 1
            log.write("pause", mode=obj.mode, inflight=len(self._inflight))
            if obj.mode == "abort":
                for fut in self._inflight.values():
                    if not fut.done():
                        fut.set_result("abort")

        async def continue_generation(self, obj) -> None:
            log.write("continue", torch_empty_cache=obj.torch_empty_cache)
            self.paused_mode = None

        async def flush_cache(self, timeout_s: float = 0.0):
            from sglang.srt.managers.io_struct import FlushCacheReqOutput

            log.write("flush_cache", inflight=len(self._inflight))
            return FlushCacheReqOutput(success=not self._inflight)

        async def generate_request(self, obj, request=None):
            obj.normalize_batch_and_arguments()
            if not obj.is_single:
                raise ValueError("the recorder answers one prompt per request (as SGLangEngine sends them)")
            while self.paused_mode is not None:  # SGLang holds new requests while paused
                await asyncio.sleep(0.01)
            params = SamplingParams(**(obj.sampling_params or {}))
            params.normalize(None)
            params.verify(hf_config.vocab_size)
            await self._validate_and_resolve_lora(obj)  # unknown adapter names raise ValueError here
            rid = obj.rid if isinstance(obj.rid, str) else f"r{len(self.rid_to_state)}"
            log.write(
                "generate",
                rid=rid,
                lora_path=obj.lora_path,
                lora_id=obj.lora_id,
                input_ids=obj.input_ids,
                sampling={
                    "max_new_tokens": params.max_new_tokens,
                    "temperature": params.temperature,
                    "top_p": params.top_p,
                    "top_k": params.top_k,
                    "stop_token_ids": sorted(params.stop_token_ids or []),
                },  # fmt: skip
                return_logprob=obj.return_logprob,
            )
            fut = asyncio.get_running_loop().create_future()
            self._inflight[rid] = fut
            try:
                # A prompt starting with ORACLE_SLOW_FIRST_TOKEN stays in flight until a pause aborts it (or 60 s).
                slow = os.environ.get("ORACLE_SLOW_FIRST_TOKEN")
                outcome = "done"
                if slow is not None and obj.input_ids and obj.input_ids[0] == int(slow):
                    try:
                        outcome = await asyncio.wait_for(asyncio.shield(fut), timeout=60)
                    except asyncio.TimeoutError:
                        pass
            finally:
                self._inflight.pop(rid, None)
                if obj.lora_path:
                    await self.lora_registry.release(obj.lora_id)
            n = params.max_new_tokens if outcome == "done" else 1
            seed = sum(obj.input_ids) + len(obj.lora_path or "")
            out_ids = [3 + (seed + i) % (hf_config.vocab_size - 3) for i in range(n)]
            finish = (
                {"type": "length", "length": n}
                if outcome == "done"
                else {"type": "abort", "message": "Abort before prefill", "status_code": 200, "err_type": None}
            )
            self.last_receive_tstamp = time.time()  # /health and /health_generate look at this
            yield {
                "text": "",
                "output_ids": out_ids,
                "meta_info": {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": len(obj.input_ids),
                    "completion_tokens": n,
                    "cached_tokens": 0,
                    "weight_version": "default",
                    "output_token_logprobs": [[-0.5, t, None] for t in out_ids] if obj.return_logprob else None,
                    "e2e_latency": 0.0,
                },
            }

    state = http_server._GlobalState(
        tokenizer_manager=OracleTokenizerManager(), template_manager=None, scheduler_info={}
    )
    http_server.set_global_state(state)
    app = http_server.app
    if args.api_key:
        add_api_key_middleware(app, api_key=args.api_key, admin_api_key=None)
    log.write("ready", sglang_version=__import__("sglang").__version__)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--log", required=True)
    p.add_argument("--max-loras-per-batch", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="+", default=["all"])
    args = p.parse_args(argv)
    app = build(args)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, lifespan="off", log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
