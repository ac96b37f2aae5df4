"""The Tinker-API HTTP server (aiohttp): sessions, models, futures, training, sampling, checkpoints.

Run: `python -m rl_multilora.tinker.server --model artifacts/tiny/model --state-dir runs/tinker [--port 8000]`, then
`tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key=<the token>)`.

Design choices (and the pitfalls of other Tinker servers they avoid):

- Binds 127.0.0.1 by default. Every endpoint but `healthz` needs the token (`X-API-Key`, as the SDK sends it, or
  `Authorization: Bearer`); the token must start with "tml-", which the SDK insists on.
- Every training request is acknowledged with a future whose id is deterministic (`<model_id>.<seq_id>`,
  `<session>.create.<model_seq_id>`, `<sampling_session>.<seq_id>`): a retried POST gets the same future and is not
  run twice. The request is committed to the journal (`journal.py`) before the acknowledgement.
- Requests of one model run in seq_id order: a request waits until every lower seq_id of its model has run,
  whatever order the HTTP calls arrived in. `unload_model` has no seq_id: it runs after every request of its model
  acknowledged before it (so a replay unloads at the same point).
- Models are named `<session>:train:<n>`, as the SDK names a model it creates from a checkpoint
  (`create_training_client_from_state*`, a `load_weights` without model_id) without asking the server.
- One worker thread runs the model. It takes every request that is ready (the next seq_id of each model), waits
  `batch_wait_s` (20 ms) for other clients' forward_backward calls, and runs all ready forward_backward requests, of
  any number of clients, as one mixed batch (`ops.ClientOps`).
- In the GRPO service (`rl-multilora serve CONFIG --tinker-port PORT`, `build_service_server`) the model, the engine
  and the slot pool are the service's: client tenants are the TenantManager's (`add_client`), and each batch of ready
  requests runs in one turn of the service's FIFO model lock (`turn`), between GRPO steps.
- After a restart, a sample or a sampling session that names sampler weights not published yet waits until the
  replayed requests have run (they republish them) instead of failing with "names no sampler weights".
- `retrieve_future` long-polls (up to `poll_s`) instead of answering "try_again" at once: the SDK re-polls a
  try_again immediately, so an instant answer would be a busy loop.
- Limits: every input is checked before it touches a tenant: loss inputs finite, token ids inside the model's
  vocabulary, a sample's prompt and `max_tokens` inside the context and `--max-tokens-cap` (a sample is refused at
  once, before it is acknowledged; a model's request fails in its turn, so its seq_id order goes on). JSON answers
  never hold a bare NaN (non-finite numbers are null), which the SDK could not parse. A request that could never
  run is refused at once (400), since its future would never resolve: a request of a model no create (or
  create-via-load) made, a seq_id of its model that ran already (a retried POST has the same request id and gets
  its future), a seq_id 0 outside a create, a model id that is not `<session>:train:<n>`. A session the server
  does not know (a client of a server restarted with `--fresh`) is taken on, so that it expires like the others. A create_model's `lora_config` and `optimizer_config` are checked before it is
  acknowledged; every optimizer but AdamW is refused (SDK 0.38's Dimuon included), never run as Adam.
- A mixed batch that fails runs its requests alone, each once: the requests whose backend call had run before the
  failure (their gradients are in) resolve with their outputs (`ops.PartialBatch`), only the others run again. A
  backend call holds at most `max_loras` tenants, so a call is all or nothing.
- Memory and the journal stay bounded: a compacted request's result is in the journal only (`done`; retrieve_future
  and a retried POST find it there); a sample (of the base, or of any sampler weights: a model that only samples
  takes no snapshot) is swapped for its result once done (the newest 1,024 kept), so a restart does not sample it
  again. A recording sample stays until none of its stability records is left (expired, evicted or its
  session ended): until then its replay rebuilds them.
- Samples without a seed of their own are seeded by a hash of their whole request id: a replay samples the same
  tokens, and two sessions' first samples differ.
- Sessions expire: a session that sent no heartbeat (nor any request or poll) for `session_timeout_s` has its queued
  requests failed, its samples in flight cancelled, and its models unloaded (slots, optimizer state and sampler
  versions freed; checkpoints kept) and compacted out of the journal; its later heartbeats get 410, which stops
  the SDK's heartbeat loop.
- Stability records (`stability.py`): a sample with `record_stability_info` gets fresh, unguessable
  `sample_sequence_ids` (kept in its journaled body, so a replay records the same ids and a retried POST gets them
  again) and its sequences are recorded for the sampling session's session before its result resolves; a
  `stable_reinforce` forward_backward resolves its datums' provenance against them (`ClientOps._row`). Records
  expire one day unused and are capped in tokens (LRU); an ending session drops its own.
- Errors: HTTP errors are `{"detail": ...}` with the status the SDK maps to its exception classes; a request that
  fails while running resolves its future to `{"error": ..., "category": "user" | "server"}` (RequestFailedError).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from google.protobuf.message import DecodeError

from rl_multilora.tinker import wire
from rl_multilora.tinker.journal import Journal
from rl_multilora.tinker.ops import (
    INFLIGHT_NAME,
    MAX_FREED_PATHS,
    MODEL_ID_PATTERN,
    PLAIN_NAME_PATTERN,
    ClientOps,
    FwdBwdItem,
    ModelLimits,
    PartialBatch,
    UserError,
    bad_model_id,
    lora_settings,
    model_id_of,
    slot_name,
)
from rl_multilora.tinker.stability import DAY_S, MAX_TOKENS, StabilityRecords, session_of

log = logging.getLogger(__name__)
API = "/api/v1"
REQUEST_TOKENS = 16384  # the tokens an SDK that reads client/config puts in one forward_backward request (at most)
SDK_BYTES_PER_TOKEN = 8  # the least the SDK counts for a datum's token (`_estimate_datum_bytes_count_proto`)
ROWS_PER_SNAPSHOT = 4  # a model holding this many journal rows per `snapshot_every` is snapshotted (`_compact_after`)
MAX_NUM_SAMPLES = 1024  # sequences one sample request may ask for (each up to the max_tokens cap)
PROTO_ACCEPT = re.compile(r"application/x-protobuf", re.IGNORECASE)  # a client that reads proto results says so
FWDBWD_KEY = re.compile(MODEL_ID_PATTERN.pattern + r"\.[0-9]+")  # a forward_backward's request id (fullmatch)
SEQUENCE_IDS = "_server_sequence_ids"  # a recording sample's ids, in its journaled body (the server's, not a client's)


@dataclass
class Result:
    """A future's outcome: a JSON dict, or proto bytes for ForwardBackwardOutput / SampleResponse."""

    event: asyncio.Event
    value: dict[str, Any] | bytes | None = None
    sequence_ids: list[str] | None = None  # a recording sample's, answered again to a retried POST
    resolved: int | None = None  # this server's count of results resolved before it (the order requests finished in)


@dataclass
class Op:
    """One training-side request waiting for its turn."""

    request_id: str
    kind: str
    model_id: str
    seq_id: int
    body: Any


@dataclass
class ServerState:
    """Sessions, sampling sessions, futures and the per-model queues (all touched under `lock`)."""

    sessions: set[str] = field(default_factory=set)
    sampling: dict[str, str | None] = field(default_factory=dict)  # sampling_session_id -> sampler path (None: base)
    results: dict[str, Result] = field(default_factory=dict)
    queues: dict[str, dict[int, Op]] = field(default_factory=dict)  # model_id -> seq_id -> op
    next_seq: dict[str, int] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)  # every model a create, a create-via-load or a snapshot made
    creates: list[Op] = field(default_factory=list)
    unloads: list[tuple[int, Op]] = field(default_factory=list)  # (run once next_seq[model] is past this, op)


class TinkerServer:
    def __init__(
        self,
        ops: ClientOps,
        journal: Journal,
        token: str,
        base_model: str,
        poll_s: float = 20.0,
        batch_wait_s: float = 0.02,
        turn: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        snapshot_every: int = 50,
        session_timeout_s: float = 120.0,
        tokenizer_id: str | None = None,
        request_tokens: int = REQUEST_TOKENS,
    ) -> None:
        if type(request_tokens) is not int or request_tokens < 1:
            raise ValueError(
                f"request_tokens={request_tokens!r} is not allowed; allowed: an int >= 1 (the tokens the SDK puts in "
                "one forward_backward request)"
            )
        self.request_tokens = request_tokens
        if not (isinstance(session_timeout_s, int | float) and session_timeout_s > 0):
            raise ValueError(
                f"session_timeout_s={session_timeout_s!r} is not allowed; allowed: seconds > 0 (a session without "
                "heartbeats for this long is ended and its models unloaded; the SDK beats every 10 s)"
            )
        self.session_timeout_s = float(session_timeout_s)
        self._last_seen: dict[str, float] = {}  # session -> time.monotonic() of its last heartbeat or request
        self._finished: dict[str, str] = {}  # session -> the reason its client finished it with (`finish_session`)
        self._expired: set[str] = set()
        self._samples: dict[str, asyncio.Task] = {}  # sample request id -> its task, while it runs
        self._recording: set[str] = set()  # sequence ids of recording samples not done yet (under `lock`)
        # recording samples, done: their journal rows go once none of their records is left (`_finish_recorded`)
        self._recorded: dict[str, tuple[list[str], Any, str | None]] = {}  # key -> (sequence ids, result, owner)
        if type(snapshot_every) is not int or snapshot_every < 1:
            raise ValueError(
                f"snapshot_every={snapshot_every!r} is not allowed; allowed: an int >= 1 (a model's optimizer steps "
                "between journal snapshots)"
            )
        self.snapshot_every = snapshot_every
        self._model_keys: dict[str, list[tuple[str, int | None]]] = {}  # model -> (request id, seq) in the journal
        self._snapped_at: dict[str, int] = {}  # model -> its step count at its last snapshot
        self._snap_folder: dict[str, str] = {}  # model -> checkpoint folder of its last snapshot
        self._grad_pending: set[str] = set()  # models with a forward_backward's gradient and no optim_step since
        self._unsnapped_load: set[str] = set()  # models whose load_weights no snapshot holds yet (`_compact_after`)
        self.ops = ops
        self.turn = turn  # held while requests run on the model (the service's FIFO lock; nothing standalone)
        self.batch_wait_s = batch_wait_s
        self.journal = journal
        self.token = token
        self.base_model = base_model
        # what `get_info` tells the SDK to load the tokenizer from (`TrainingClient.get_tokenizer`): the served
        # folder, which holds it, so a client beside the server (it binds to localhost unless told otherwise) loads
        # it offline; the served name otherwise
        self.tokenizer_id = tokenizer_id or base_model
        self.poll_s = poll_s
        self.state = ServerState()
        self._resolved = itertools.count()
        self.lock = threading.Condition()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._freed_sampling: OrderedDict[str, str] = OrderedDict()  # forgotten sampling sessions -> their path
        self._closing: asyncio.Event | None = None  # set when the app starts shutting down (`_on_shutdown`)
        self._replayed: list[Result] = []  # futures of the replayed model requests (republishing sampler weights)
        self._stop = False
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)

    # -- app -------------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        # bodies are decompressed by the routes that take them (`wire.decompress`: zstd, which aiohttp reads only with
        # an extra package), not by aiohttp's parser
        app = web.Application(middlewares=[self._auth], client_max_size=256 * 1024 * 1024,
                              handler_args={"auto_decompress": False})  # fmt: skip
        get = {"healthz": self.healthz, "get_server_capabilities": self.capabilities, "memory": self.memory}
        post = {
            "client/config": self.client_config,
            "client/dynamic_config": self.dynamic_config,
            "telemetry": self.telemetry,
            "create_session": self.create_session,
            "session_heartbeat": self.heartbeat,
            "create_model": self.create_model,
            "get_info": self.get_info,
            "forward_backward": self.forward_backward,
            "forward": self.forward_backward,  # SDK < 0.24: a JSON ForwardRequest (`forward_input`)
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "save_weights_external": self.save_weights_external,
            "load_weights": self.load_weights,
            "unload_model": self.unload_model,
            "create_sampling_session": self.create_sampling_session,
            "asample": self.asample,
            "retrieve_future": self.retrieve_future,
        }
        for name, handler in get.items():
            app.router.add_get(f"{API}/{name}", handler)
        for name, handler in post.items():
            app.router.add_post(f"{API}/{name}", handler)
        app.router.add_get(API + "/samplers/{sid}", self.get_sampler)
        app.router.add_post(API + "/sessions/{sid}/finish", self.finish_session)
        # the SDK's RestClient calls for what a hosted Tinker keeps and this server does not: refused, saying so,
        # before the checkpoint route below could take a publish for a checkpoint named ".../publish"
        checkpoint = API + "/training_runs/{run}/checkpoints/{checkpoint_id:.+}"
        for method, path, what in [
            ("POST", checkpoint + "/publish", "publishing a checkpoint"),
            ("DELETE", checkpoint + "/publish", "unpublishing a checkpoint"),
            ("PUT", checkpoint + "/ttl", "a checkpoint's time to live"),
            ("GET", checkpoint + "/external_weights_urls", "download URLs of a checkpoint's weights"),
            ("PUT", API + "/sessions/{sid}/project", "session projects"),
            ("GET", API + "/sessions/{sid}/trace_export", "session traces"),
            ("POST", API + "/sessions/search", "session search"),
            ("POST", API + "/copy_weights", "copying weights into another project"),
            (
                "POST",
                API + "/create_custom_loss",
                "a server-side custom loss (forward_backward_custom runs it in the client)",
            ),
            ("GET", API + "/audit", "the audit log"),
            ("GET", API + "/billing/usage/events", "billing"),
            ("GET", API + "/billing/usage/checkpoints/current", "checkpoint storage billing"),
        ]:
            app.router.add_route(method, path, self._unsupported(what))
        app.router.add_get(API + "/checkpoints", self.list_user_checkpoints)
        app.router.add_get(API + "/sessions", self.list_sessions)
        app.router.add_get(API + "/sessions/{sid}", self.get_session)
        app.router.add_get(API + "/training_runs", self.list_training_runs)
        app.router.add_get(API + "/training_runs/{run}", self.get_training_run)
        app.router.add_get(API + "/training_runs/{run}/checkpoints", self.list_checkpoints)
        app.router.add_delete(API + "/training_runs/{run}/checkpoints/{checkpoint_id:.+}", self.delete_checkpoint)
        app.router.add_post(API + "/weights_info", self.weights_info)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app) -> None:
        self.loop = asyncio.get_running_loop()
        self._closing = asyncio.Event()
        for snap in self.journal.snapshots():  # each model from its snapshot, before the requests after it
            key = f"restore.{snap.model_id}"
            self._dispatch(key, "restore", snap, replay=True)
            self._replayed.append(self.state.results[key])
        for key, kind, body, model_id, seq in self.journal.replay():
            decoded = json.loads(body) if kind != "forward_backward" else body
            self._dispatch(key, kind, decoded, replay=True, model_id=model_id, seq=seq)
            if kind not in ("create_session", "create_sampling_session", "sample", "end_session"):
                self._replayed.append(self.state.results[key])
        self._drop_unreachable()
        gapped = self._gapped()
        self._replayed = [res for res in self._replayed if id(res) not in gapped]
        self._worker.start()
        app[_REAPER] = self.loop.create_task(self._reap_sessions())

    def _drop_unreachable(self) -> None:
        """Fail the replayed requests that could never run, which a journal written before `_check_order` may hold
        (a request of a model never created, a seq_id 0 only a create has, a seq_id a snapshot is past): their futures
        would never resolve, and a restart's wait for replayed requests (`_replay_done`) would wait on them for ever."""
        with self.lock:
            bad = []
            for model_id, queue in self.state.queues.items():
                floor = self.state.next_seq.get(model_id, 0)
                for seq, op in list(queue.items()):
                    never = model_id not in self.state.models or seq < floor
                    if never or (seq == 0 and op.kind != "load_weights"):
                        bad.append(queue.pop(seq))
        for op in bad:
            log.warning("journal: %s %s can never run (its model was not created, or its seq_id is taken); failing it",
                        op.kind, op.request_id)  # fmt: skip
            why = f"{op.kind} {op.request_id!r} can never run: its model was never created here or its seq_id is taken"
            self._resolve(self.state.results[op.request_id], {"error": why, "category": "user"})

    def _gapped(self) -> set[int]:
        """The results (ids) of replayed requests that wait behind a seq_id the journal does not hold (the client
        never sent it, or it was refused): they run only once the client sends it, so a restart's wait for replayed
        requests (`_replay_done`) skips them, as a server that never restarted would not wait for them either (a
        sample naming weights only they would publish was refused at once there, and is here). Before the worker
        starts: nothing runs yet, so each model's next seq_id is exact."""
        gapped: set[int] = set()
        with self.lock:
            created = {op.model_id for op in self.state.creates}
            firsts: dict[str, int] = {}
            for model_id, queue in self.state.queues.items():
                k = self.state.next_seq.get(model_id, 1 if model_id in created else None)
                if k is None:
                    continue
                while k in queue:
                    k += 1
                firsts[model_id] = k
                gapped.update(id(self.state.results[op.request_id]) for seq, op in queue.items() if seq > k)
            for after, op in self.state.unloads:
                k = firsts.get(op.model_id, self.state.next_seq.get(op.model_id))
                if k is not None and after >= k:
                    gapped.add(id(self.state.results[op.request_id]))
        return gapped

    async def _on_shutdown(self, app) -> None:
        """Before the server waits for its requests to end: every long-poll of `retrieve_future` answers try_again
        now (a client's poll is renewed every `poll_s`, 20 s, which kept a SIGTERMed server up past a container's
        grace period). Acknowledged requests stay journaled and run after a restart."""
        self._closing.set()

    async def _on_cleanup(self, app) -> None:
        app[_REAPER].cancel()
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        await asyncio.to_thread(self._worker.join, 10)
        self.journal.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path != f"{API}/healthz":
            given = request.headers.get("X-API-Key") or request.headers.get("Authorization", "").removeprefix(
                "Bearer "
            )
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return web.json_response({"detail": "missing or wrong API key"}, status=401)
        try:
            return await handler(request)
        except web.HTTPException as e:  # no such route or method, body too large: JSON, as every other answer
            if e.status < 400:
                raise
            return web.json_response({"detail": f"{e.reason}: {request.method} {request.path}"}, status=e.status)
        except UserError as e:
            return web.json_response({"detail": str(e)}, status=400)
        except (KeyError, ValueError, json.JSONDecodeError) as e:
            return web.json_response({"detail": f"bad request: {type(e).__name__}: {e}"}, status=400)
        except (TypeError, AttributeError, OverflowError, RecursionError) as e:
            # raised while a handler reads the body (a list for an object, a string for a number, an int past 64 bits,
            # arrays nested 10,000 deep):
            # the handlers run no model work, so these are the client's malformed fields
            why = f"bad request: a field has the wrong type or size ({type(e).__name__}: {e}); allowed: the SDK's body"
            return web.json_response({"detail": why}, status=400)

    @staticmethod
    def _json(d: dict[str, Any]) -> web.Response:
        return web.json_response(_finite(d), dumps=_STRICT_DUMPS)

    # -- plain endpoints -------------------------------------------------------------------------------------------
    async def healthz(self, _r) -> web.Response:
        return self._json({"status": "ok"})

    async def capabilities(self, _r) -> web.Response:
        """The served base model and its context length; beyond the SDK's fields, the losses this server computes
        (`rl_multilora.losses.SDK_LOSSES`; `stable_reinforce` is this project's own objective), its sample limits
        and the bounds of its stability records (the SDK ignores unknown fields)."""
        from rl_multilora.losses import SDK_LOSSES

        limits = self.ops.limits
        model = {"model_name": self.base_model, "max_context_length": limits.context_length, "trainable": True,
                 "sampleable": True}  # fmt: skip
        records = self.ops.records
        return self._json({
            "supported_models": [model],
            "loss_fns": sorted(SDK_LOSSES),
            "stability_records": {"ttl_s": records.ttl_s, "max_tokens": records.max_tokens},
            "max_tokens_cap": limits.max_tokens_cap or limits.context_length,
            "prompt_logprobs": self.ops.backend.shared_model is not None,
            "session_timeout_s": self.session_timeout_s,
        })  # fmt: skip

    async def memory(self, _r) -> web.Response:
        """Bytes held by component and the process's RSS (`rl_multilora.tinker.memory`; not an SDK route)."""
        from rl_multilora.tinker.memory import server_memory

        with self.lock:
            results = dict(self.state.results)
        return self._json(await asyncio.to_thread(server_memory, self.ops, results))

    # -- REST: training runs and their checkpoints (the SDK's RestClient) ------------------------------------------
    def _run(self, r: web.Request) -> str:
        run = r.match_info["run"]
        slot_name(run)  # a UserError for an id that is not <session>:train:<n>
        return run

    def _training_run(self, model_id: str) -> dict[str, Any]:
        from datetime import UTC, datetime

        info = self.ops.run_info(model_id)
        saved = self.ops.training_checkpoints(model_id)
        return {
            "training_run_id": model_id,
            "base_model": self.base_model,
            "model_owner": "local",
            "is_lora": True,
            "lora_rank": info["rank"],
            "last_request_time": saved[-1]["time"] if saved else datetime.now(UTC).isoformat(),
            "last_checkpoint": max(saved, key=lambda c: c["time"]) if saved else None,
            "last_sampler_checkpoint": None,  # sampler weights are in-memory versions, not checkpoints
        }

    async def list_training_runs(self, r: web.Request) -> web.Response:
        """Models that hold a slot or have a client checkpoint: a page (`limit`, `offset`), the SDK's
        `TrainingRunsResponse`."""
        limit, offset = self._page(r, 20)
        runs = await asyncio.to_thread(self.ops.training_runs)
        page = [await asyncio.to_thread(self._training_run, m) for m in runs[offset : offset + limit]]
        cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
        return self._json({"training_runs": page, "cursor": cursor})

    @staticmethod
    def _unsupported(what: str):
        async def refuse(r: web.Request) -> web.Response:
            raise UserError(f"{r.method} {r.path}: {what} is not supported by this server (a local Tinker-API server; "
                            "its checkpoints are folders in --state-dir: `rl-multilora export` copies one out as a "
                            "PEFT adapter)")  # fmt: skip

        return refuse

    @staticmethod
    def _page(r: web.Request, default_limit: int) -> tuple[int, int]:
        try:
            limit, offset = int(r.query.get("limit", default_limit)), int(r.query.get("offset", 0))
        except ValueError:
            raise UserError("limit and offset must be integers") from None
        if limit < 1 or offset < 0:
            raise UserError(f"limit={limit}, offset={offset} are not allowed; allowed: limit >= 1, offset >= 0")
        return limit, offset

    async def list_user_checkpoints(self, r: web.Request) -> web.Response:
        """Every model's `save_state` checkpoints, newest first: a page (`limit`, `offset`), the SDK's
        `CheckpointsListResponse` with its cursor (`RestClient.list_user_checkpoints`)."""
        limit, offset = self._page(r, 100)

        def every() -> list[dict[str, Any]]:
            saved = [c for m in self.ops.training_runs() for c in self.ops.training_checkpoints(m)]
            return sorted(saved, key=lambda c: c["time"], reverse=True)

        saved = await asyncio.to_thread(every)
        cursor = {"offset": offset, "limit": limit, "total_count": len(saved)}
        return self._json({"checkpoints": saved[offset : offset + limit], "cursor": cursor})

    def _session_ids(self) -> list[str]:
        """Every session this server knows: live, finished by its client or expired."""
        with self.lock:
            return sorted({*self.state.sessions, *self._finished, *self._expired})

    async def list_sessions(self, r: web.Request) -> web.Response:
        """The sessions this server knows (live, finished or expired), a page (`limit`, `offset`): the SDK's
        `ListSessionsResponse` (`RestClient.list_sessions`)."""
        limit, offset = self._page(r, 20)
        return self._json({"sessions": self._session_ids()[offset : offset + limit]})

    async def get_session(self, r: web.Request) -> web.Response:
        """A session's models and sampling sessions, the SDK's `GetSessionResponse` (`RestClient.get_session`); 404
        for a session this server does not know."""
        sid = r.match_info["sid"]
        if sid not in self._session_ids():
            return web.json_response({"detail": f"unknown session_id {sid!r}"}, status=404)
        with self.lock:
            runs = sorted((m for m in self.state.models if session_of(m) == sid), key=lambda m: (len(m), m))
            samplers = sorted(k for k in self.state.sampling if session_of(k) == sid)
        return self._json({"training_run_ids": runs, "sampler_ids": samplers})

    async def get_training_run(self, r: web.Request) -> web.Response:
        """One model as the SDK's `TrainingRun` (rank, newest checkpoint); 404 for a model with neither slot nor
        checkpoint."""
        run = self._run(r)
        try:
            return self._json(await asyncio.to_thread(self._training_run, run))
        except UserError as e:
            return web.json_response({"detail": str(e)}, status=404)

    async def list_checkpoints(self, r: web.Request) -> web.Response:
        """The model's `save_state` checkpoints, oldest first, as the SDK's `CheckpointsListResponse`."""
        run = self._run(r)
        return self._json({"checkpoints": await asyncio.to_thread(self.ops.training_checkpoints, run)})

    async def delete_checkpoint(self, r: web.Request) -> web.Response:
        """Remove the checkpoints `weights/<name>` of the model (not one a journal snapshot needs); 404 when none."""
        run, checkpoint_id = self._run(r), r.match_info["checkpoint_id"]
        kind, _, label = checkpoint_id.partition("/")
        if kind != "weights":
            raise UserError(f"checkpoint_id={checkpoint_id!r} is not allowed; allowed: weights/<name> (sampler "
                            "weights are in-memory versions, not checkpoints)")  # fmt: skip
        protected = {snap.info.get("folder") for snap in self.journal.snapshots() if snap.model_id == run}
        with self.lock:  # a snapshot being written now names its folder only once it is in the journal
            protected |= {self._snap_folder.get(run)} - {None}
        if not await asyncio.to_thread(self.ops.delete_checkpoint, run, label, protected):
            return web.json_response({"detail": f"checkpoint tinker://{run}/weights/{label} does not exist"},
                                     status=404)  # fmt: skip
        return self._json({})

    async def weights_info(self, r: web.Request) -> web.Response:
        """Rank and trained layers of the model a `tinker_path` names, as the SDK's `WeightsInfoResponse`."""
        path = (await r.json())["tinker_path"]
        model_id = path.removeprefix("tinker://").split("/")[0] if isinstance(path, str) else None
        if model_id is None or not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(f"tinker_path={path!r} is not allowed; allowed: tinker://<model_id>/...")
        info = await asyncio.to_thread(self.ops.run_info, model_id)
        layers = info["lora_config"]
        trained = {
            key: layers.get(key, key != "train_unembed") for key in ("train_unembed", "train_mlp", "train_attn")
        }
        return self._json({"base_model": self.base_model, "is_lora": True, "lora_rank": info["rank"], **trained})

    async def client_config(self, _r) -> web.Response:
        # API keys only (no JWT exchange), plain httpx transport, per-request future polling; forward_backward and
        # forward as (zstd-compressed) protos: SDK 0.24 sends JSON unless told `proto_write_fwdbwd` (later releases
        # always send protos), and compresses only when told `proto_compress_fwdbwd`.
        # A forward_backward runs as one pass over all its datums, so its memory follows its tokens: SDKs that read
        # `fwdbwd_max_chunk_bytes_count` (0.38) split a call into requests of at most `request_tokens` tokens each
        # (the SDK counts at least 8 bytes a token: 4 in model_input, 4 or more in target_tokens), whose gradients
        # accumulate until the optim_step as any two requests' do.
        return self._json({"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_write_fwdbwd": True,
                           "fwd_via_fwdbwd": True, "proto_compress_fwdbwd": True,
                           "fwdbwd_max_chunk_bytes_count": SDK_BYTES_PER_TOKEN * self.request_tokens})  # fmt: skip

    async def dynamic_config(self, _r) -> web.Response:
        return self._json({})

    async def telemetry(self, _r) -> web.Response:
        return self._json({"status": "accepted"})

    async def heartbeat(self, r: web.Request) -> web.Response:
        sid = (await r.json()).get("session_id")
        if sid in self._expired:
            why = f"session {sid!r} expired: no heartbeat for {self.session_timeout_s:g} s; create a new ServiceClient"
            return web.json_response({"detail": why}, status=410)
        if sid in self._finished:
            why = f"session {sid!r} was finished by its client ({self._finished[sid]}); create a new ServiceClient"
            return web.json_response({"detail": why}, status=410)
        if sid not in self.state.sessions:
            return web.json_response({"detail": f"unknown session_id {sid!r}"}, status=404)
        self._last_seen[sid] = time.monotonic()
        return self._json({"type": "session_heartbeat"})

    async def finish_session(self, r: web.Request) -> web.Response:
        """`ServiceClient.close(status)` (SDK 0.38; also what leaving `with ServiceClient() as sc:` calls): the session
        ends. Its models are unloaded as `unload_model` would unload them, after every request of theirs that was
        acknowledged (a `save_state` the script did not wait for still runs; slots are freed); its checkpoints stay;
        its sampling sessions end; any later request of the session is refused. First reason wins, and finishing a
        session that ended already (finished, expired, or unknown here) answers as the first time did."""
        sid = r.match_info["sid"]
        if not PLAIN_NAME_PATTERN.fullmatch(sid):
            raise UserError(f"session_id={sid!r} is not allowed; allowed: 1 to 64 letters, digits, '_' or '-'")
        body = await r.json() if r.can_read_body else {}
        reason = (body.get("reason") or {}).get("type", "success") if isinstance(body, dict) else "success"
        if reason not in ("success", "errored", "interrupted"):
            raise UserError(f"reason.type={reason!r} is not allowed; allowed: 'success', 'errored' or 'interrupted'")
        if sid in self._finished or sid in self._expired or sid not in self.state.sessions:
            return self._json({})
        # Marked before its models are listed: a create the worker took out of the queue but has not run yet is in
        # no list, and `_unless_ended_model` unloads it once it runs (it held a slot for ever otherwise).
        self._finished[sid] = reason
        self._journal_end(sid, reason)
        with self.lock:
            models = self._session_models(sid)
        for m in sorted(models):  # journaled like the SDK's own unload_model: a restart unloads them too
            await self._ack(f"{m}.unload", "unload_model", {"model_id": m}, None, m, ending=True)
        detail = body.get("detail") if isinstance(body, dict) else None
        log.info("session %s finished by its client (%s%s); unloading its %d model(s)", sid, reason,
                 f": {detail}" if isinstance(detail, str) and detail else "", len(models))  # fmt: skip
        self._forget_session(sid)
        self.ops.records.drop_session(sid)
        return self._json({})

    async def create_session(self, _r) -> web.Response:
        sid = "s" + uuid.uuid4().hex[:16]
        self.journal.append(f"session.{sid}", "create_session", json.dumps({"session_id": sid}).encode())
        self._dispatch(f"session.{sid}", "create_session", {"session_id": sid})
        return self._json({"type": "create_session", "session_id": sid})

    async def get_info(self, r: web.Request) -> web.Response:
        model_id = (await r.json())["model_id"]
        t = self.ops.tenant(model_id)
        data = {"arch": "llama", "model_name": self.base_model, "tokenizer_id": self.tokenizer_id}
        return self._json({"type": "get_info", "model_id": model_id, "model_data": data, "is_lora": True,
                           "lora_rank": t.rank, "model_name": self.base_model})  # fmt: skip

    async def get_sampler(self, r: web.Request) -> web.Response:
        sid = r.match_info["sid"]
        if sid not in self.state.sampling:
            return web.json_response({"detail": f"unknown sampler {sid!r}"}, status=404)
        return self._json({"sampler_id": sid, "base_model": self.base_model, "model_path": self.state.sampling[sid]})

    # -- acknowledged requests -------------------------------------------------------------------------------------
    async def _ack(
        self,
        key: str,
        kind: str,
        body: dict[str, Any] | bytes,
        extra: dict[str, Any] | None = None,
        model_id: str | None = None,
        seq: int | None = None,
        ending: bool = False,
    ):
        """Journal and dispatch a request (once: a retried POST gets the same future). `ending`: an unload that
        `finish_session` queues for a session it has just marked finished (any other request of it is refused)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        session = self._touch(model_id or key)
        if not ending:
            self._unless_ended(session)
        if not self._known(key):
            self.journal.append(key, kind, raw, model_id, seq)
            self._dispatch(key, kind, body, model_id=model_id, seq=seq)
        return self._json({"request_id": key, **(extra or {})})

    async def create_model(self, r: web.Request) -> web.Response:
        body = await r.json()
        self._check_base(body.get("base_model"))
        key = f"{body['session_id']}.create.{body['model_seq_id']}"
        model_id = model_id_of(body["session_id"], body["model_seq_id"])
        if not self._known(key):  # a retry gets its future whatever the session's state now
            self._check_session(body["session_id"])
            lora_settings(body.get("lora_config"), self.ops.backend.max_rank)
            _check_optimizer("optimizer_config", body.get("optimizer_config"))
        return await self._ack(key, "create_model", body, {"model_id": model_id}, model_id, 0)

    def _known(self, key: str) -> bool:
        """Whether request `key` was acknowledged before: its future is in memory, or its result is in the journal
        (a compacted request's: `_compact` keeps it there, not here)."""
        return key in self.state.results or self.journal.has_result(key)

    def _check_session(self, session: Any) -> None:
        """A UserError when `session` has ended. A session this server does not know (a client of a server started
        again with `--fresh`, which archived the journal that had it) is taken on as if it had just been created, so
        it expires like any other and its models are unloaded then (a model of an untracked session held its slot for
        ever)."""
        self._unless_ended(session)
        if session not in self.state.sessions:
            if not isinstance(session, str) or not PLAIN_NAME_PATTERN.fullmatch(session):
                raise UserError(f"session_id={session!r} is not allowed; allowed: 1 to 64 letters, digits, '_' or '-'")
            self.journal.append(f"session.{session}", "create_session", json.dumps({"session_id": session}).encode())
            self._dispatch(f"session.{session}", "create_session", {"session_id": session})

    def _journal_end(self, sid: str, how: str) -> None:
        """Record that a session ended (`how`: its client's finish reason, or "expired"): a restart replays the
        session's creation, and without this it came back to life (heartbeats answered, models created in it)."""
        body = json.dumps({"session_id": sid, "how": how}).encode()
        self.journal.append(f"session.{sid}.end", "end_session", body)
        # its creation and its sampling sessions need no replay now (the journal kept one row each for ever)
        samplers = [f"sampling.{k}" for k in list(self.state.sampling) if k.startswith(f"{sid}.")]
        self.journal.drop([f"session.{sid}", *samplers])

    def _forget_session(self, sid: str) -> None:
        """An ended session's own state: off the live sessions and the expiry clock, its sampling sessions gone."""
        self._last_seen.pop(sid, None)
        self.state.sessions.discard(sid)
        for name in [k for k in self.state.sampling if k.startswith(f"{sid}.")]:
            del self.state.sampling[name]

    def _drop_freed_samplers(self) -> None:
        """Forget the sampling sessions whose sampler weights were freed (on the event loop, after a turn): a
        `create_sampling_client(model_path=...)` per step (the cookbook's loop) added one for ever, in memory and
        in the journal. Sampling one of them was already a user error that says the weights were freed."""
        freed = self.ops.freed
        dead = [k for k, path in list(self.state.sampling.items()) if path is not None and path in freed]
        for k in dead:  # kept (bounded) for its samples' error, which names the weights and why they went
            self._freed_sampling[k] = self.state.sampling.pop(k)
        while len(self._freed_sampling) > MAX_FREED_PATHS:
            self._freed_sampling.popitem(last=False)
        self.journal.drop([f"sampling.{k}" for k in dead])

    def _session_path(self, sid: str) -> str | None:
        """A sampling session's weights (None: the base), a forgotten one's too (`_drop_freed_samplers`)."""
        if sid in self.state.sampling:
            return self.state.sampling[sid]
        if sid in self._freed_sampling:
            return self._freed_sampling[sid]
        raise UserError(f"unknown sampling_session_id {sid!r}")

    def _unless_ended(self, session: Any) -> None:
        """A UserError when `session` was finished by its client or expired."""
        if session in self._finished:
            raise UserError(f"session {session!r} was finished by its client ({self._finished[session]}); its models "
                            "were unloaded (their checkpoints stay); create a new ServiceClient")  # fmt: skip
        if session in self._expired:
            raise UserError(f"session {session!r} expired: no heartbeat for {self.session_timeout_s:g} s and its "
                            "models were unloaded; create a new ServiceClient")  # fmt: skip

    def _check_order(self, kind: str, model_id: str, seq: int | None, key: str) -> None:
        """A UserError for a model request that could never run (so its future would never resolve): its model was
        never created here, or its seq_id has run already (not a retry: a retry has the same request id), or it
        is a seq_id 0 that only a create (or a create-via-load) may have. `seq` None: an unload (no seq_id)."""
        if self._known(key):
            return  # a retried POST: the same future
        self._check_session(session_of(model_id))
        with self.lock:
            known = model_id in self.state.models
            nxt = self.state.next_seq.get(model_id)
        if seq is None:
            if not known:
                raise UserError(f"model_id={model_id!r} is not allowed: no create_model or load_weights made it "
                                "here; allowed: a model of this session")  # fmt: skip
            return
        if seq == 0 and kind != "load_weights":
            raise UserError(f"seq_id=0 is not allowed for {kind} of {model_id!r}; allowed: an int >= 1 (0 is the "
                            "request that creates the model)")  # fmt: skip
        if not known and not (kind == "load_weights" and seq == 0):
            raise UserError(f"model_id={model_id!r} is not allowed: no create_model or load_weights made it here; "
                            "allowed: a model of this session created first")  # fmt: skip
        if nxt is not None and seq < nxt:
            raise UserError(f"seq_id={seq} of {model_id!r} is not allowed: it ran already with another request; "
                            f"allowed: an int >= {nxt} (the model's next)")  # fmt: skip

    def _model_request(self, body: dict[str, Any], kind: str) -> tuple[str, str, int]:
        """(request id, model id, seq_id) of a model's JSON request, checked (`_model_key`)."""
        model_id, seq = body["model_id"], body["seq_id"]
        return self._model_key(kind, model_id, seq), model_id, seq

    def _model_key(self, kind: str, model_id: Any, seq: Any) -> str:
        """The request id `<model_id>.<seq_id>` of a model's request, after its id, its seq_id's range and its order
        are checked (`_check_order`)."""
        _api_model_id(model_id)
        if type(seq) is not int or not 0 <= seq < 2**62:
            raise UserError(f"seq_id={seq!r} is not allowed; allowed: an int in [0, 2**62)")
        key = f"{model_id}.{seq}"
        self._check_order(kind, model_id, seq, key)
        return key

    async def forward_backward(self, r: web.Request) -> web.Response:
        """A ForwardBackwardRequest proto (zstd-compressed or not), or the JSON of an SDK before the protos (a
        ForwardBackwardRequest, or a ForwardRequest on `/forward`); kept in the journal as it was decoded from."""
        try:
            raw = wire.decompress(await r.read(), r.headers.get("Content-Encoding"))
            fb = wire.decode_forward_backward(raw)
        except wire.WireError as e:
            raise UserError(str(e)) from None
        except DecodeError as e:
            raise UserError(f"forward_backward body is not a ForwardBackwardRequest protobuf ({e})") from None
        key = self._model_key("forward_backward", fb.model_id, fb.seq_id)
        return await self._ack(key, "forward_backward", raw, {"model_id": fb.model_id}, fb.model_id, fb.seq_id)

    async def optim_step(self, r: web.Request) -> web.Response:
        body = await r.json()
        key, model_id, seq = self._model_request(body, "optim_step")
        return await self._ack(key, "optim_step", body, None, model_id, seq)

    async def save_weights(self, r: web.Request) -> web.Response:
        body = await r.json()
        key, model_id, seq = self._model_request(body, "save_weights")
        return await self._ack(key, "save_weights", body, None, model_id, seq)

    async def save_weights_external(self, r: web.Request) -> web.Response:
        """`save_weights_external(name)`: the adapter as a PEFT folder in the state dir (`ClientOps.save_external`),
        in the model's turn. A TTL is accepted and not kept (nothing here expires); encryption to age recipients is
        not supported and fails the request in its turn, so the model's next seq_id still runs."""
        body = await r.json()
        key, model_id, seq = self._model_request(body, "save_weights_external")
        return await self._ack(key, "save_weights_external", body, None, model_id, seq)

    async def save_weights_for_sampler(self, r: web.Request) -> web.Response:
        body = await r.json()
        key, model_id, seq = self._model_request(body, "save_weights_for_sampler")
        kind = body.get("kind", "snapshot")
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"kind={kind!r} is not allowed; allowed: 'snapshot' or 'inflight'")
        if kind == "inflight" and body.get("path") is not None:
            raise UserError(f"path={body['path']!r} is not allowed with kind='inflight' (its clients share the "
                            "model's one mutable target); leave it out, or save a named snapshot")  # fmt: skip
        if body.get("path") == INFLIGHT_NAME:
            raise UserError(f"path={INFLIGHT_NAME!r} is not allowed: the server keeps its inflight target under that "
                            "name; choose another")  # fmt: skip
        return await self._ack(key, "save_weights_for_sampler", body, None, model_id, seq)

    async def load_weights(self, r: web.Request) -> web.Response:
        body = await r.json()
        if body.get("model_id") is None:  # create-via-load: the load is the new model's request 0
            self._check_base(body.get("base_model"))
            body["model_id"], body["seq_id"] = model_id_of(body["session_id"], body["model_seq_id"]), 0
        key, model_id, seq = self._model_request(body, "load_weights")
        return await self._ack(key, "load_weights", body, {"model_id": model_id}, model_id, seq)

    async def unload_model(self, r: web.Request) -> web.Response:
        model_id = (await r.json())["model_id"]
        _api_model_id(model_id)
        key = f"{model_id}.unload"
        self._check_order("unload_model", model_id, None, key)
        return await self._ack(key, "unload_model", {"model_id": model_id}, None, model_id)

    async def create_sampling_session(self, r: web.Request) -> web.Response:
        body = await r.json()
        session, seq = body.get("session_id"), body.get("sampling_session_seq_id")
        self._check_session(session)  # an ended session is refused; one never seen is taken on (and expires)
        if type(seq) is not int or seq < 0:
            raise UserError(f"sampling_session_seq_id={seq!r} is not allowed; allowed: an int >= 0")
        sid = f"{session}.sampler.{seq}"
        path = _model_path(body)
        if path is None:
            self._check_base(body.get("base_model"))
        else:
            await self._replay_done(path)
            self.ops.sampler(path)
        key = f"sampling.{sid}"
        if key not in self.state.results:
            self.journal.append(key, "create_sampling_session", json.dumps({"sid": sid, "path": path}).encode())
            self._dispatch(key, "create_sampling_session", {"sid": sid, "path": path})
        return self._json({"type": "create_sampling_session", "sampling_session_id": sid})

    async def asample(self, r: web.Request) -> web.Response:
        """`asample`: `num_samples` completions of a prompt, from a sampling session (`sampling_session_id`, its
        `seq_id` making a retried POST the same request), or without one from `model_path` (sampler weights) or the
        served `base_model`: each such request is a request of its own (a `seq_id` there names nothing). Settings,
        prompt length and a `model_path` naming no weights are refused at once (400)."""
        body = await r.json()
        sid = body.get("sampling_session_id")
        if sid is None:  # stateless form: model_path or base_model on the request itself
            path = _model_path(body)
            if path is None:
                self._check_base(body.get("base_model"))
            else:  # refused at once when it names no sampler weights, as a sampling session's would be
                await self._replay_done(path)
                self.ops.sampler(path)
            # Its own request id whatever `seq_id` says: without a sampling session a seq_id names nothing of the
            # client's, and `<path>.<seq_id>` made two clients' requests one (the second got the first's samples).
            key = f"{path or 'base'}.{uuid.uuid4().hex}"
        elif sid not in self.state.sampling and sid not in self._freed_sampling:
            self._unless_ended(session_of(sid))
            raise UserError(f"unknown sampling_session_id {sid!r}")
        else:
            path = self._session_path(sid)
            seq = body.get("seq_id")
            if type(seq) is not int or seq < 0:  # it keys the request: a null or a "1" made two requests one
                raise UserError(f"seq_id={seq!r} is not allowed with a sampling_session_id; allowed: an int >= 0")
            key = f"{sid}.{seq}"
        n = body.get("num_samples", 1)
        if type(n) is not int or not 1 <= n <= MAX_NUM_SAMPLES:
            raise UserError(f"num_samples={n!r} is not allowed; allowed: an int in [1, {MAX_NUM_SAMPLES}]")
        record = body.get("record_stability_info")
        if record is not None and not isinstance(record, bool):
            raise UserError(f"record_stability_info={record!r} is not allowed; allowed: true, false or null")
        labels = [f"{key}.{i}" for i in range(n)]  # what a sample that records nothing calls its sequences
        done = self.state.results.get(key)
        if done is not None:  # a retried POST: the same ids
            ids = done.sequence_ids or labels
        else:  # refused at once, not acknowledged: nothing waits on a sample's order
            prompt = _prompt_tokens(body)
            max_new = self.ops.check_sample(prompt, body["sampling_params"])
            _prompt_scoring(body, len(prompt))
            body.pop(SEQUENCE_IDS, None)
            ids = labels
            if record:
                if body.get("sampling_session_id") is None:
                    raise UserError("record_stability_info needs a sampling_session_id (records belong to the "
                                    "sampling session's session); create a sampling client first")  # fmt: skip
                try:
                    self.ops.records.check_room(n, len(prompt), max_new)
                except ValueError as e:
                    raise UserError(str(e)) from None
                ids = body[SEQUENCE_IDS] = self.ops.records.new_ids(n)
        owner = path.removeprefix("tinker://").split("/")[0] if isinstance(path, str) else None
        extra = {"sample_sequence_ids": ids}
        return await self._ack(key, "sample", body, extra, owner if owner in self.ops.tenants else None)

    async def retrieve_future(self, r: web.Request) -> web.Response:
        key = (await r.json())["request_id"]
        self._touch(key)  # a client polling for its results is alive
        res = self.state.results.get(key)
        if res is None:  # a compacted request's result is in the journal only
            value = await asyncio.to_thread(self.journal.result, key)
            if value is None:
                return web.json_response({"detail": f"unknown request_id {key!r}"}, status=404)
        else:
            if not res.event.is_set():
                waits = [asyncio.ensure_future(e.wait()) for e in (res.event, self._closing)]
                _, pending = await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
                if not res.event.is_set():  # not done in this poll, or the server is shutting down
                    return self._json({"type": "try_again", "request_id": key, "queue_state": "active"})
            value = res.value
        if isinstance(value, bytes):
            accept = r.headers.get("Accept", "")
            if "json" not in accept.lower() or PROTO_ACCEPT.search(accept):
                return web.Response(body=value, content_type=wire.PROTO_CONTENT_TYPE)
            # an SDK before the protos (it accepts application/json only): the result as its pydantic models read it
            fwdbwd = FWDBWD_KEY.fullmatch(key) is not None  # `<model_id>.<seq_id>`; samples are keyed by sampler
            as_json = wire.forward_backward_output_json if fwdbwd else wire.sample_response_json
            return self._json(as_json(value))
        return self._json(value)

    async def _replay_done(self, path: str | None, sid: str | None = None) -> None:
        """Sampler weights at `path`, or a sampling session `sid`, not published (yet): wait for the replayed
        requests, in journal order, until one has republished them. Not for all of them: a replayed stable_reinforce
        forward_backward waits for the replayed samples it names (`_awaits_sample`), which may wait here."""
        for res in self._replayed:
            if not ((path is not None and path not in self.ops.samplers) or
                    (sid is not None and sid not in self.state.sampling and sid not in self._freed_sampling)):  # fmt: skip
                return
            await res.event.wait()

    def _check_base(self, name: str | None) -> None:
        if name is not None and name != self.base_model:
            raise UserError(f"base_model={name!r} is not served here; allowed: {self.base_model!r}")

    # -- session expiry ----------------------------------------------------------------------------------------------
    def _touch(self, key: str) -> str:
        """The session a model id or request id belongs to (its first part), marked as seen now when it is live."""
        session = session_of(key)
        if session in self._last_seen:
            self._last_seen[session] = time.monotonic()
        return session

    async def _reap_sessions(self) -> None:
        """End the sessions whose last heartbeat (or request) is older than `session_timeout_s`."""
        while True:
            await asyncio.sleep(min(self.session_timeout_s / 4, 5.0))
            try:
                await self._finish_recorded()
            except Exception:  # noqa: BLE001 - a journal write that fails now is tried again next time
                log.exception("finishing recorded samples failed")
            now = time.monotonic()
            for sid in [s for s, seen in self._last_seen.items() if now - seen > self.session_timeout_s]:
                try:
                    self._expire(sid)
                except Exception:  # noqa: BLE001 - one session's clean-up must not stop the others'
                    log.exception("ending session %s failed", sid)

    def _session_models(self, sid: str) -> set[str]:
        """The session's models that hold a slot or have requests waiting (under `lock`)."""
        prefix = f"{sid}:train:"
        held = [*self.ops.tenants, *self.state.queues, *(op.model_id for op in self.state.creates)]
        return {m for m in held if m.startswith(prefix)}

    def _expire(self, sid: str) -> None:
        """Fail the session's queued requests, cancel its samples in flight and queue an unload of each of its
        models (run by the worker in its next turn, before anything else of theirs; `_compact_after` then drops
        them from the journal). Its checkpoints stay."""
        log.info("session %s sent no heartbeat for %g s: ending it and unloading its models", sid,
                 self.session_timeout_s)  # fmt: skip
        self._last_seen.pop(sid, None)
        self._expired.add(sid)
        self._journal_end(sid, "expired")
        why = {"error": f"session {sid!r} expired: no heartbeat for {self.session_timeout_s:g} s", "category": "user"}
        prefix = f"{sid}:train:"
        with self.lock:
            self.state.sessions.discard(sid)
            models = self._session_models(sid)
            dropped = [op for m in models for op in self.state.queues.pop(m, {}).values()]
            dropped += [op for op in self.state.creates if op.model_id in models]
            dropped += [op for _, op in self.state.unloads if op.model_id in models]
            self.state.creates = [op for op in self.state.creates if op.model_id not in models]
            self.state.unloads = [(a, op) for a, op in self.state.unloads if op.model_id not in models]
            for m in sorted(models):
                key = f"{m}.expire"
                self.state.results[key] = Result(asyncio.Event())
                self.state.unloads.append((-1, Op(key, "unload_model", m, 0, {"model_id": m})))
            self.lock.notify_all()
        for op in dropped:
            self._resolve(self.state.results[op.request_id], why)
        for key, task in list(self._samples.items()):
            if key.startswith(f"{sid}.") or key.startswith(f"tinker://{prefix}"):
                task.cancel()
                self._resolve(self.state.results[key], why)
        for name in [k for k, path in self.state.sampling.items() if k.startswith(f"{sid}.") or
                     (path or "").startswith(f"tinker://{prefix}")]:  # fmt: skip
            del self.state.sampling[name]
        self.ops.records.drop_session(sid)

    # -- scheduling --------------------------------------------------------------------------------------------------
    def _dispatch(
        self, key: str, kind: str, body: Any, replay: bool = False, model_id: str | None = None, seq: int | None = None
    ) -> None:
        """Register the future of an acknowledged (or replayed) request and queue its work. `model_id` / `seq`: the
        model the journal files it under (what a snapshot of that model compacts)."""
        res = Result(asyncio.Event())
        self.state.results[key] = res
        if model_id is not None:
            with self.lock:
                self._model_keys.setdefault(model_id, []).append((key, seq))
        if kind == "create_session":
            self.state.sessions.add(body["session_id"])
            self._last_seen[body["session_id"]] = time.monotonic()
            self._resolve(res, {})
        elif kind == "create_sampling_session":
            self.state.sampling[body["sid"]] = body["path"]
            self._resolve(res, {})
        elif kind == "end_session":  # replayed: a session its client finished or that expired stays ended
            sid, how = body["session_id"], body["how"]
            if how == "expired":
                self._expired.add(sid)
            else:
                self._finished[sid] = how
            self._forget_session(sid)
            self._resolve(res, {})
        elif kind == "sample":
            assert self.loop is not None
            res.sequence_ids = body.get(SEQUENCE_IDS)
            with self.lock:
                self._recording.update(res.sequence_ids or ())
            task = self.loop.create_task(self._sample(key, body, res, model_id))
            self._samples[key] = task
            task.add_done_callback(lambda _t: self._samples.pop(key, None))
        elif kind == "restore":
            with self.lock:
                self.state.models.add(body.model_id)
                self.state.creates.append(Op(key, kind, body.model_id, 0, body))
                self.state.next_seq[body.model_id] = body.next_seq
                if body.info.get("owned", True):
                    self._snap_folder[body.model_id] = body.info["folder"]
                self.lock.notify_all()
        else:
            if kind == "forward_backward":
                fb = wire.decode_forward_backward(body)
                op = Op(key, kind, fb.model_id, fb.seq_id, fb)
            else:
                model_id = body.get("model_id") or model_id_of(body["session_id"], body["model_seq_id"])
                op = Op(key, kind, model_id, int(body.get("seq_id") or 0), body)
            with self.lock:
                if kind == "create_model" or (kind == "load_weights" and op.seq_id == 0):
                    self.state.models.add(op.model_id)
                if kind == "create_model":
                    self.state.creates.append(op)
                elif kind == "unload_model":
                    self.state.unloads.append((self._last_seq(op.model_id), op))
                else:
                    if kind == "load_weights" and op.seq_id == 0:
                        self.state.next_seq.setdefault(op.model_id, 0)
                    self.state.queues.setdefault(op.model_id, {})[op.seq_id] = op
                self.lock.notify_all()

    def _resolve(self, res: Result, value: dict[str, Any] | bytes, notify: bool = True) -> None:
        """Set a request's result; `notify` False: its pollers are told later (`_notify`), once the turn has
        compacted the journal after it (a save_state's checkpoint is then the snapshot, so deleting the previous one,
        which the client may do as soon as it has the result, is no longer refused; a load's snapshot holds what it
        read, so deleting that checkpoint can no longer lose the model)."""
        res.value = value  # at once: a snapshot taken later in this turn keeps it (`_compact`)
        res.resolved = next(self._resolved)  # itertools.count: one step under the GIL, from any thread
        if notify:
            self._notify(res)

    def _notify(self, res: Result) -> None:
        """Wake the pollers of a request whose result is set (from any thread)."""

        def done() -> None:
            res.event.set()

        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop or self.loop is None:
            done()
        else:
            self.loop.call_soon_threadsafe(done)

    def _last_seq(self, model_id: str) -> int:
        """The highest seq_id of the model acknowledged so far; -1 for a model the scheduler has never seen (under
        `lock`)."""
        queued = list(self.state.queues.get(model_id, {}))
        if model_id in self.state.next_seq:
            return max([self.state.next_seq[model_id] - 1, *queued])
        if queued or any(op.model_id == model_id for op in self.state.creates):
            return max([0, *queued])  # a pending create is request 0
        return -1

    def _ready(self) -> list[Op]:
        """Creates first, then the next seq_id of every model, then unloads whose model is done (under `lock`)."""
        ready = list(self.state.creates)
        self.state.creates.clear()
        for model_id, queue in self.state.queues.items():
            nxt = self.state.next_seq.get(model_id)
            if nxt is not None and nxt in queue and not self._awaits_sample(queue[nxt]):
                ready.append(queue.pop(nxt))
        waiting = []
        for after, op in self.state.unloads:
            if self.state.next_seq.get(op.model_id, 0) > after:  # after its model's ops in `ready` too
                ready.append(op)
            else:
                waiting.append((after, op))
        self.state.unloads = waiting
        return ready

    def _awaits_sample(self, op: Op) -> bool:
        """A forward_backward whose loss reads provenance and names a recording sample still running (a replayed
        one after a restart, or one the client named from its promise): it waits, so it finds the records (under
        `lock`; `_sample` notifies when one is done)."""
        if op.kind != "forward_backward" or op.body.error is not None or not self._recording:
            return False
        from rl_multilora.losses import REGISTRY

        loss = REGISTRY.get(op.body.loss_fn)
        if loss is None or not loss.provenance:
            return False
        spans = (s for d in op.body.data for s in (d.input_spans or []) + (d.target_spans or []))
        return any(s.sequence_id in self._recording for s in spans)

    def _work(self) -> None:
        first = True
        while True:
            with self.lock:
                ready = self._ready()
                while not ready and not self._stop:
                    self.lock.wait()
                    ready = self._ready()
                if self._stop:
                    return
                # Coalesce: forward_backward calls of other clients that arrive within batch_wait_s join this batch.
                deadline = time.monotonic() + self.batch_wait_s
                while any(op.kind == "forward_backward" for op in ready) and time.monotonic() < deadline:
                    self.lock.wait(deadline - time.monotonic())
                    ready += self._ready()
            with self.turn():
                with self.lock:  # what became ready while the service's step held the model joins this turn
                    ready += self._ready()
                fwd = [op for op in ready if op.kind == "forward_backward"]
                rest = [op for op in ready if op.kind != "forward_backward"]
                for op in rest:
                    self._run_one(op)
                if fwd:
                    self._run_batch(fwd)
                saves = [self.state.results[op.request_id] for op in ready if op.kind in _TOLD_AFTER_COMPACT]
                try:
                    self._compact_after(ready)  # (which may move their results into the journal)
                finally:
                    for res in saves:  # told only now (`_resolve`)
                        self._notify(res)
                if self.loop is not None and any(op.kind in _FREES_SAMPLERS for op in ready):
                    self.loop.call_soon_threadsafe(self._drop_freed_samplers)
                if first:  # every replayed create ran in this turn (creates and loads at seq 0 are ready at once)
                    self.ops.slots.end_client_reservations()
                    first = False
            with self.lock:
                for op in ready:
                    if op.kind not in ("create_model", "unload_model", "restore"):
                        self.state.next_seq[op.model_id] = op.seq_id + 1

    def _run_batch(self, ops: list[Op]) -> None:
        for op in ops:  # data the wire format allows but this server does not serve (a sparse tensor, an image)
            if op.body.error is not None:
                self._resolve(self.state.results[op.request_id], {"error": f"UserError: {op.body.error}",
                                                                  "category": "user"})  # fmt: skip
        ops = [op for op in ops if op.body.error is None]
        if not ops:
            return
        items = [FwdBwdItem(op.model_id, op.body.loss_fn, op.body.loss_fn_config, op.body.data, op.body.forward_only)
                 for op in ops]  # fmt: skip
        try:
            outs = self.ops.forward_backward(items)
        except PartialBatch as e:  # some items' calls ran (their gradients are in): those are done, the rest alone
            log.warning("a mixed batch failed after %d of its %d requests ran (%s); running the others alone",
                        len(e.done), len(ops), e.__cause__)  # fmt: skip
            for i, out in e.done.items():
                self._resolve(self.state.results[ops[i].request_id], wire.encode_forward_backward_output(*out))
            for i, op in enumerate(ops):
                if i not in e.done:
                    self._run_batch([op])
            return
        except Exception:  # noqa: BLE001 - one bad request must not fail the others of the batch: run them alone
            if len(ops) > 1:
                for op in ops:
                    self._run_batch([op])
                return
            self._fail(ops[0])
            return
        for op, out in zip(ops, outs, strict=True):
            self._resolve(self.state.results[op.request_id], wire.encode_forward_backward_output(*out))

    def _fail(self, op: Op) -> None:
        import sys

        e = sys.exc_info()[1]
        category = "user" if isinstance(e, UserError) else "server"
        if category == "server":
            log.exception("%s %s failed", op.kind, op.request_id)
        self._resolve(self.state.results[op.request_id], {"error": f"{type(e).__name__}: {e}", "category": category})

    def _run_one(self, op: Op) -> None:
        b = op.body
        try:
            if op.kind == "create_model":
                rank, seed, lc = lora_settings(b.get("lora_config"), self.ops.backend.max_rank)
                self.ops.create(op.model_id, rank, seed, lc)
                self._unless_ended_model(op.model_id)
                with self.lock:
                    self.state.next_seq.setdefault(op.model_id, 1)
                value: dict[str, Any] = {"type": "create_model", "model_id": op.model_id}
            elif op.kind == "optim_step":
                value = {"metrics": self.ops.optim_step(op.model_id, _optim_params(b))}
            elif op.kind == "save_weights":
                name = b.get("path") or f"step{self.ops.steps(op.model_id)}"
                value = {"type": "save_weights", "path": self.ops.save(op.model_id, name, key=op.request_id)}
            elif op.kind == "save_weights_external":
                if b.get("age_encryption_recipients"):
                    raise UserError("age_encryption_recipients is not supported by this server: the folder is "
                                    "written unencrypted into its --state-dir, so leave it out")  # fmt: skip
                path, size = self.ops.save_external(op.model_id, b.get("path"))
                value = {"type": "save_weights_external", "path": path, "size_bytes": size}
            elif op.kind == "save_weights_for_sampler":
                inflight = b.get("kind") == "inflight"
                path, _ = self.ops.publish_sampler(op.model_id, b.get("path"), inflight=inflight)
                value = {"type": "save_weights_for_sampler", "path": path}
                if b.get("path") is None:  # an unnamed version is known by its sampling session, not by a path
                    sid = f"{op.model_id}.sampler.{b.get('sampling_session_seq_id')}"
                    with self.lock:
                        self.state.sampling[sid] = path
                    value = {"type": "save_weights_for_sampler", "sampling_session_id": sid}  # SDK 0.16: no path
            elif op.kind == "load_weights":
                _check_optimizer("optimizer_config", b.get("optimizer_config"))
                self.ops.load(op.model_id, b["path"], bool(b.get("optimizer")))
                self._unless_ended_model(op.model_id)
                value = {"type": "load_weights", "path": b["path"], "model_id": op.model_id}
            elif op.kind == "unload_model":
                self.ops.unload(op.model_id)
                value = {"type": "unload_model", "model_id": op.model_id}
            elif op.kind == "restore":
                self.ops.restore(op.model_id, b.info, b.samplers)
                self._snapped_at[op.model_id] = self.ops.steps(op.model_id)
                value = {"type": "restore", "model_id": op.model_id}
            else:
                raise UserError(f"unknown request kind {op.kind!r}")
        except Exception:  # noqa: BLE001 - the failure is the request's result
            self._record_live(op)
            self._fail(op)
            return
        self._record_live(op)
        self._resolve(self.state.results[op.request_id], value, notify=op.kind not in _TOLD_AFTER_COMPACT)

    def _unless_ended_model(self, model_id: str) -> None:
        """After a create (or a load) made `model_id`: when its session ended meanwhile (`_expire` or
        `finish_session` ran while the request waited for its turn and did not see the model yet), unload it at once
        and fail the request, so no slot is held for a session that is gone. Both mark the session before they list
        its models, so either they see this model or this check sees the session ended."""
        session = session_of(model_id)
        ended = "expired" if session in self._expired else "was finished" if session in self._finished else None
        if ended is not None and model_id in self.ops.tenants:
            self.ops.unload(model_id)
            raise UserError(f"session {session!r} {ended} while this request waited for its turn; its model was "
                            "unloaded")  # fmt: skip

    # -- the bounded journal ----------------------------------------------------------------------------------------
    def _compact_after(self, ran: list[Op]) -> None:
        """Snapshot the models whose request of this turn calls for it (an optim_step `snapshot_every` steps after
        the last snapshot, a save_state, a load_weights) and compact their journal; forget an unloaded model's
        requests. A failed snapshot leaves the journal as it was (the restart replays more).

        A load is snapshotted at once: replayed, it would read its checkpoint by name again, and by then that name
        may be deleted or saved again (the model came back lost, or silently other weights). A failed
        create-via-load made no model: it is forgotten, so a replay does not try it again. No snapshot is taken
        while a forward_backward's gradient waits for its optim_step (`_grad_pending`): the checkpoint cannot hold
        it, so those rows stay to be replayed, and a load is then snapshotted at the model's next optim_step."""
        for op in ran:
            m = op.model_id
            try:
                if op.kind == "forward_backward" and op.body.error is None and not op.body.forward_only:
                    self._grad_pending.add(m)
                elif op.kind == "unload_model" and m not in self.ops.tenants:
                    self._grad_pending.discard(m)
                    self._compact(m, None)
                elif op.kind == "load_weights" and m not in self.ops.tenants:
                    self._compact(m, None)
                elif op.kind in ("optim_step", "save_weights", "load_weights") and m in self.ops.tenants:
                    value = self.state.results[op.request_id].value or {}
                    if op.kind == "load_weights":  # failed or not, what it left is the model now
                        self._unsnapped_load.add(m)
                    elif "error" in value:
                        continue
                    elif op.kind == "optim_step":
                        self._grad_pending.discard(m)
                    if m in self._grad_pending:
                        continue
                    steps = self.ops.steps(m) - self._snapped_at.get(m, 0)
                    if op.kind == "save_weights":  # save_state: its own checkpoint is the snapshot
                        self._compact(m, op.seq_id + 1, saved=value["path"])
                    elif m in self._unsnapped_load or steps >= self.snapshot_every:
                        self._compact(m, op.seq_id + 1)
            except Exception:  # noqa: BLE001 - the journal still holds every request: nothing is lost
                log.exception("journal snapshot of %s failed; its requests stay in the journal", m)
        # A model whose requests never call for a snapshot (a client that only runs `forward`, or saves for the
        # sampler) still gets one once it holds `ROWS_PER_SNAPSHOT * snapshot_every` journal rows: else its rows and
        # results grew without bound, and a restart replayed every one of them.
        last = {op.model_id: op for op in ran if op.kind not in ("create_model", "unload_model", "restore")}
        for m, op in last.items():
            with self.lock:  # the rows a snapshot removes: done ones (not those queued or in flight, which stay)
                keys = list(self._model_keys.get(m, ()))
            rows = sum(1 for k, _ in keys if (res := self.state.results.get(k)) is not None and res.value is not None)
            if rows < ROWS_PER_SNAPSHOT * self.snapshot_every or m not in self.ops.tenants or m in self._grad_pending:
                continue
            try:
                self._compact(m, op.seq_id + 1)
            except Exception:  # noqa: BLE001 - the journal still holds every request: nothing is lost
                log.exception("journal snapshot of %s failed; its requests stay in the journal", m)

    def _compact(self, model_id: str, next_seq: int | None, saved: str | None = None) -> None:
        """Swap the model's finished requests before `next_seq` (None: all, the model is gone) for a snapshot (the
        client's checkpoint `saved` when one was just written)."""
        steps = self.ops.steps(model_id) if next_seq is not None else 0
        key = f"snapshot.{model_id}.{next_seq}"
        info, blobs = self.ops.snapshot(model_id, key, saved) if next_seq is not None else (None, {})
        with self.lock:
            keys = list(self._model_keys.get(model_id, []))
        results: dict[str, dict[str, Any] | bytes] = {}
        samples = []
        for key, seq in keys:
            res = self.state.results.get(key)
            if res is None or res.value is None:
                continue  # still running (a sample in flight): it stays in the journal
            if seq is None and not key.endswith(".unload"):
                samples.append(key)
                results[key] = res.value
            elif next_seq is None or (seq is not None and seq < next_seq):
                results[key] = res.value
        self.journal.compact(model_id, next_seq if next_seq is not None else 2**62, info, blobs, results, samples)
        session = session_of(model_id)
        if next_seq is None and (session in self._finished or session in self._expired):
            self.journal.retire(model_id)  # nothing of it can come again: its results need not stay for ever
        with self.lock:
            self._model_keys[model_id] = [(k, q) for k, q in self._model_keys.get(model_id, []) if k not in results]
            if next_seq is None and not self._model_keys[model_id]:
                del self._model_keys[model_id]
        for key in results:  # kept in the journal (`done`), where retrieve_future and a retried POST find them
            self.state.results.pop(key, None)
        old = self._snap_folder.pop(model_id, None)  # a checkpoint the journal wrote for its last snapshot
        self._unsnapped_load.discard(model_id)
        if info is not None:
            if info["owned"]:
                self._snap_folder[model_id] = info["folder"]
            self._snapped_at[model_id] = steps
        if old is not None and old != (info or {}).get("folder"):
            name = slot_name(model_id)
            self.ops.ckpt.discard(self.ops.ckpt.adapter_dir(name) / old)

    def _record_live(self, op: Op) -> None:
        """Who holds a slot, for a restart's order (`Journal.live_models`); before the client hears of it."""
        if op.kind in ("create_model", "load_weights", "unload_model"):
            self.journal.set_live(op.model_id, op.model_id in self.ops.tenants)

    async def _sample(self, key: str, body: dict[str, Any], res: Result, owner: str | None = None) -> None:
        """Run sample request `key` and resolve `res`; once done, its journal row is swapped for its result
        (`Journal.finish`), so restarts do not sample it again and the journal does not grow with the server's
        sampling history (`owner`, the client model whose sampler weights it read, snapshots only when it trains: a
        model that only samples kept every sample in the journal). A recording sample once its stability records
        are gone (its replay would rebuild them until then)."""
        await self._run_sample(key, body, res)
        if res.value is None:
            return
        ids = body.get(SEQUENCE_IDS)
        if ids and self.ops.records.holds_any(ids):
            self._recorded[key] = (ids, res.value, owner)  # finished by `_finish_recorded` once its records are gone
            return
        await self._finish_sample(key, res.value, owner)

    async def _finish_recorded(self) -> None:
        """Finish the recording samples (`_sample`) none of whose stability records is left (expired, evicted, or
        their session ended): replaying them would record what nobody can name any more."""
        for key in [k for k, (ids, *_) in self._recorded.items() if not self.ops.records.holds_any(ids)]:
            _, value, owner = self._recorded.pop(key)
            await self._finish_sample(key, value, owner)

    async def _finish_sample(self, key: str, value: bytes | dict[str, Any], owner: str | None) -> None:
        """Swap a done sample's journal row for its result: retrieve_future and a retried POST find it there."""
        await asyncio.to_thread(self.journal.finish, key, value)
        self.state.results.pop(key, None)
        with self.lock:  # no snapshot of its model has it to compact any more
            if owner in self._model_keys:
                self._model_keys[owner] = [(k, q) for k, q in self._model_keys[owner] if k != key]

    async def _run_sample(self, key: str, body: dict[str, Any], res: Result) -> None:
        try:
            sid = body.get("sampling_session_id")
            await self._replay_done(None, sid)
            path = self._session_path(sid) if sid is not None else body.get("model_path")
            await self._replay_done(path)
            prompt = _prompt_tokens(body)
            seed = _sample_seed(key)  # replay samples the same tokens; another session's request, others
            version = self.ops.sampler(path)
            want_logprobs, last_n, topk = _prompt_scoring(body, len(prompt))
            scores = None
            if want_logprobs or topk:
                scores = await asyncio.to_thread(self.ops.score_prompt, version, prompt, last_n, topk)
            seqs = await self.ops.sample(
                version, prompt, int(body.get("num_samples", 1)), body["sampling_params"], seed
            )
            if body.get(SEQUENCE_IDS):  # recorded before the client can see (and name) the sequences
                self.ops.records.record(session_of(sid), body[SEQUENCE_IDS], prompt, seqs)
            self._resolve(
                res,
                wire.encode_sample_response(
                    seqs,
                    scores.logprobs if scores is not None and want_logprobs else None,
                    (scores.topk_ids, scores.topk_logprobs) if scores is not None and topk else None,
                ),
            )
        except Exception as e:  # noqa: BLE001
            category = "user" if isinstance(e, UserError) else "server"
            if category == "server":
                log.exception("sample %s failed", key)
            self._resolve(res, {"error": f"{type(e).__name__}: {e}", "category": category})
        finally:
            if res.sequence_ids:  # recorded (or failed): a forward_backward that named them may run now
                with self.lock:
                    self._recording.difference_update(res.sequence_ids)
                    self.lock.notify_all()


def _api_model_id(model_id: Any) -> None:
    """A UserError unless `model_id` is an API model id, `<session>:train:<n>` (not a plain adapter name, which
    `slot_name` takes for the server's own callers: over HTTP it would name a GRPO tenant or a made-up model)."""
    if not isinstance(model_id, str) or not MODEL_ID_PATTERN.fullmatch(model_id):
        raise bad_model_id(model_id)


def _optim_params(body: dict[str, Any]) -> dict[str, Any]:
    """An optim_step's optimizer parameters, under any of the SDK's names (`adam_params`; `optimizer_params` for
    another family, e.g. Dimuon, since SDK 0.38; `optim_params`); a UserError for a family other than AdamW."""
    params = body.get("adam_params") or body.get("optimizer_params") or body.get("optim_params") or {}
    if not isinstance(params, dict):
        raise UserError(f"adam_params={params!r} is not allowed; allowed: an object (the SDK's AdamParams)")
    _check_optimizer("optimizer_params", params)
    return {k: v for k, v in params.items() if k != "type"}


def _check_optimizer(field_name: str, config: Any) -> None:
    """A UserError when an optimizer config or optimizer params name a family other than AdamW (the SDK's
    `DimuonOptimizerConfig` / `DimuonParams`): this server trains every model with AdamW, and would otherwise run a
    Dimuon client's steps as Adam at its default settings without a word."""
    if config is None:
        return
    kind = config.get("type", "adamw") if isinstance(config, dict) else config
    if kind != "adamw":
        raise UserError(f"{field_name}.type={kind!r} is not allowed; allowed: 'adamw' (this server trains with AdamW)")


def _sample_seed(key: str) -> int:
    """The seed of a sample request without a seed of its own: a hash of its whole request id (the sampling session,
    with its session, and the seq_id), so a replay samples the same tokens and two sessions do not.

    >>> _sample_seed("s1.sampler.0.0") != _sample_seed("s2.sampler.0.0")
    True
    """
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % (2**31)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float as None: JSON has no NaN, and the SDK's parser refuses a bare one.

    >>> _finite({"loss": float("nan"), "xs": [1.0, float("inf")]})
    {'loss': None, 'xs': [1.0, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_REAPER = web.AppKey("reaper", asyncio.Task)
_STRICT_DUMPS = functools.partial(json.dumps, allow_nan=False)


def _model_path(body: dict) -> str | None:
    """A sampling request's `model_path`: None (the base) or a string (which sampler weights is checked later)."""
    path = body.get("model_path")
    if path is not None and not isinstance(path, str):
        raise UserError(f"model_path={path!r} is not allowed; allowed: null (the base) or a tinker:// path")
    return path


def _prompt_tokens(body: dict[str, Any]) -> list[int]:
    """A sample request's prompt as token ids (its encoded-text chunks; other chunk types are refused)."""
    tokens: list[int] = []
    for chunk in body["prompt"]["chunks"]:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt chunk type {chunk.get('type')!r} is not supported; allowed: encoded_text")
        tokens += chunk.get("tokens", [])
    return tokens


def _prompt_scoring(body: dict[str, Any], n_prompt: int) -> tuple[bool, int | None, int]:
    """(prompt log-probs wanted, `prompt_logprobs_last_n`, `topk_prompt_logprobs`) of a sample request; a UserError
    for a value out of range or a scoring option this server does not serve."""
    unsupported = {
        "target_prompt_logprobs": body.get("target_prompt_logprobs") is not None,
        "prompt_alt_tokens_k": bool(body.get("prompt_alt_tokens_k")),
        "topk_sample_logprobs": bool(body.get("topk_sample_logprobs")),
    }
    for name, asked in unsupported.items():
        if asked:
            raise UserError(f"{name} is not supported by this server; sample without it")
    want = bool(body.get("prompt_logprobs"))
    topk, last_n = body.get("topk_prompt_logprobs") or 0, body.get("prompt_logprobs_last_n")
    if type(topk) is not int or not 0 <= topk <= 1024:
        raise UserError(f"topk_prompt_logprobs={topk!r} is not allowed; allowed: an int in [0, 1024]")
    if last_n is not None and (type(last_n) is not int or not 1 <= last_n <= n_prompt - 1 or not (want or topk)):
        raise UserError(
            f"prompt_logprobs_last_n={last_n!r} is not allowed; allowed: an int in [1, {n_prompt - 1}] (the prompt's "
            "length - 1), with prompt_logprobs or topk_prompt_logprobs"
        )
    if (want or topk) and n_prompt < 2:
        raise UserError("prompt log-probs need a prompt of at least 2 tokens (the first has no context)")
    return want, last_n, topk


def _check_token(token: str) -> None:
    if not token.startswith("tml-"):
        raise ValueError("token must start with 'tml-' (the tinker SDK refuses other API keys)")


def build_server(
    model_path: str,
    state_dir: Path,
    token: str,
    base_model: str | None = None,
    max_loras: int = 8,
    max_rank: int = 32,
    poll_s: float = 20.0,
    seed: int = 0,
    batch_wait_s: float = 0.02,
    max_sampler_versions: int = 4,
    snapshot_every: int = 50,
    max_tokens_cap: int | None = None,
    session_timeout_s: float = 120.0,
    max_tenants: int | None = None,
    host_budget_gb: float | None = None,
    unembed_lora: bool = True,
    stability_ttl_s: float = DAY_S,
    stability_max_tokens: int = MAX_TOKENS,
    request_tokens: int = REQUEST_TOKENS,
) -> TinkerServer:
    """`request_tokens`: the most tokens an SDK that reads client/config puts in one forward_backward request.
    `max_tenants` > `max_loras`: clients beyond the slots are paged between them and host memory (the
    `model.max_tenants` of a run config), spilling past `host_budget_gb` to `state_dir/paged`. The budget counts the
    in-memory sampler versions too: past it the least recently used ones spill to `state_dir/paged/samplers`.
    `unembed_lora`: the model's LoRA targets are its `all-linear` modules plus its output head, which clients train
    with `train_unembed=True` (the SDK's default); False leaves the head out (`train_unembed` is then reported false).
    `stability_ttl_s` / `stability_max_tokens`: how long an unused stability record is kept and how many tokens the
    records hold at most, the least recently used evicted past it (`stability.StabilityRecords`)."""
    from rl_multilora import components
    from rl_multilora.checkpoint import CheckpointManager
    from rl_multilora.config import GRPOSettings, ModelConfig
    from rollout.engines.embedded import EmbeddedEngine

    _check_token(token)
    from rl_multilora.checkpoint import hold_run_dir

    held = hold_run_dir(Path(state_dir), "--state-dir")  # one server a state dir: held for the process's life
    torch.manual_seed(seed)
    m = ModelConfig(
        path=model_path,
        max_loras=max_loras,
        max_rank=max_rank,
        max_tenants=max_tenants,
        host_budget_gb=host_budget_gb,
        target_modules=lora_targets(model_path, unembed_lora),
    )
    tokenizer = components.build_tokenizer(m)
    pad = components.pad_token_id(tokenizer)
    # clients name their own loss per call
    backend = components.build_local_backend(m, GRPOSettings(), pad, spill_dir=str(state_dir / "paged"))
    engine = EmbeddedEngine(backend.shared_model, tokenizer, seed=seed)
    ckpt = CheckpointManager(state_dir)  # the run dir layout: adapters/<name>/step_<k>/
    for p in ckpt.remove_stale_temps():
        log.info("removed %s, left by an interrupted write", p)
    for p in sorted((state_dir / "paged" / "samplers").glob("*.safetensors")):  # a cache: the journal restores them
        p.unlink()
    limits = ModelLimits.of_config(backend.shared_model.config, max_tokens_cap)
    budget = None if host_budget_gb is None else int(host_budget_gb * 2**30)  # as the tenant store's (components)
    records = StabilityRecords(stability_ttl_s, stability_max_tokens)
    ops = ClientOps(backend, engine, pad, ckpt, max_sampler_versions, limits=limits, host_budget_bytes=budget,
                    spill_dir=state_dir / "paged" / "samplers", records=records)  # fmt: skip
    journal = Journal(state_dir / "requests.sqlite")
    live = journal.live_models()
    if len(live) > backend.max_tenants:  # a restart on fewer places: the models past them would fail, unlogged
        journal.close()
        raise ValueError(
            f"the request journal in {state_dir} holds {len(live)} models that held a place when the server stopped, "
            f"more than the {backend.max_tenants} this server has (--max-loras {max_loras}, --max-tenants "
            f"{max_tenants}); allowed: --max-loras or --max-tenants >= {len(live)}, or another --state-dir"
        )
    name = base_model or model_path
    server = TinkerServer(ops, journal, token, name, poll_s, batch_wait_s, snapshot_every=snapshot_every,
                          session_timeout_s=session_timeout_s, tokenizer_id=_local_folder(model_path),
                          request_tokens=request_tokens)  # fmt: skip
    server._state_dir_lock = held
    return server


def _local_folder(path: str) -> str | None:
    """`path` made absolute when it is a local folder (a model served from disk), else None (a Hub id)."""
    return str(Path(path).resolve()) if Path(path).is_dir() else None


def lora_targets(model_path: str, unembed: bool) -> str | list[str]:
    """The LoRA targets of a served model: "all-linear", and with `unembed` its module names plus the output head
    (the Linear `get_output_embeddings` returns, `lm_head` in every HF causal LM this serves), read from a skeleton of
    the model's config on the meta device (no weights are loaded)."""
    if not unembed:
        return "all-linear"
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_multilora.lora.model import select_targets

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    head = skeleton.get_output_embeddings()
    names = {name: module for name, module in skeleton.named_modules()}
    head_name = next((n for n, mod in names.items() if mod is head and isinstance(mod, torch.nn.Linear)), None)
    linears = select_targets(skeleton, "all-linear")
    return linears + [head_name] if head_name is not None else linears


def service_problems(cfg: Any) -> list[str]:
    """What keeps a GRPO service config (`RunConfig`) from serving the Tinker API, each naming the setting, its value
    and what is allowed. Trainer ranks, engine actors, several engines and async rollouts serve clients as they serve
    GRPO tenants; server engines (SGLang, http) are not served to clients yet."""
    from rl_multilora.errors import bad_value

    r = cfg.rollout
    if r.engine != "embedded":
        return [bad_value("rollout.engine", r.engine, "'embedded' with the Tinker API (server engines are not yet)")]
    return []


def build_service_server(
    core: Any,
    state_dir: Path,
    token: str,
    base_model: str | None = None,
    poll_s: float = 20.0,
    batch_wait_s: float = 0.02,
    max_sampler_versions: int = 4,
    snapshot_every: int = 50,
    max_tokens_cap: int | None = None,
    session_timeout_s: float = 120.0,
    stability_ttl_s: float = DAY_S,
    stability_max_tokens: int = MAX_TOKENS,
) -> TinkerServer:
    """The Tinker app on a GRPO service's Runtime (`core`: a `rl_multilora.service.ServiceCore`): its model,
    engine and TenantManager, its FIFO model lock, its checkpoints (`RUN_DIR/adapters/`); the journal under
    `state_dir`.

    Restart order: call this before `core.start()`. It holds a slot for every client the journal says held one
    (`TenantManager.reserve_client_slots`), so the start admits the run's GRPO tenants around them and the app's
    replay (its first worker turn) gets them back; then the holds end. Called on a started core, GRPO tenants
    admitted at its start went first."""
    from rl_multilora import components

    _check_token(token)
    rt = core.rt
    problems = service_problems(rt.cfg)
    if problems:
        raise ValueError("the Tinker API needs the embedded engine: " + "; ".join(problems))
    journal = Journal(state_dir / "requests.sqlite")
    with core.turn():  # the training thread may run already (a core started before this call)
        held = rt.tenants.reserve_client_slots([slot_name(m) for m in journal.live_models()])
    if held:
        log.info("holding %d slot(s) for the Tinker clients the journal replays: %s", len(held), ", ".join(held))
    ops = ClientOps(
        rt.backend,
        rt.engine,
        components.pad_token_id(rt.tokenizer),
        rt.ckpt,
        max_sampler_versions,
        slots=rt.tenants,
        shared_engine=True,
        limits=ModelLimits.of_path(rt.cfg.model.path, max_tokens_cap),  # the trainer ranks' model is not here
        records=StabilityRecords(stability_ttl_s, stability_max_tokens),
    )
    return TinkerServer(ops, journal, token, base_model or rt.cfg.model.path, poll_s, batch_wait_s,
                        turn=core.tinker_turn, snapshot_every=snapshot_every,
                        session_timeout_s=session_timeout_s,
                        tokenizer_id=_local_folder(rt.cfg.model.path))  # fmt: skip


# On close, requests still in flight (a client's long-poll of `retrieve_future`, which a keep-alive connection renews
# every poll) get this long before they are cancelled; aiohttp's default (60 s) outlasts the callers' own waits.
SHUTDOWN_S = 5.0
# Requests after which sampler versions may have been freed (a newer one past --max-sampler-versions, an unload).
_FREES_SAMPLERS = ("save_weights_for_sampler", "unload_model", "create_model", "load_weights")
# Requests whose result is told only after the turn's journal snapshot (`_resolve`): a save_state, a load_weights.
_TOLD_AFTER_COMPACT = ("save_weights", "load_weights")


class BackgroundApp:
    """A TinkerServer's app on its own event-loop thread (inside the service's process)."""

    def __init__(self, server: TinkerServer, host: str, port: int) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(server.app(), shutdown_timeout=SHUTDOWN_S)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, host, port).start())
        self._thread = threading.Thread(target=self.loop.run_forever, name="tinker-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def resolve_token(state_dir: Path, check: bool = False) -> str:
    """$RL_MULTILORA_TINKER_TOKEN, else the token in state_dir/token (created 0600 on first start). `check`: raise
    ValueError naming where the token came from (the variable or the file) when it is one the SDK refuses."""
    path = None
    if not (token := os.environ.get("RL_MULTILORA_TINKER_TOKEN")):
        path = state_dir / "token"
        if not path.exists():
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("tml-" + secrets.token_hex(24))
        token = path.read_text().strip()
    if check and not token.startswith("tml-"):
        shown = repr(token) if not token.strip() else f"<{len(token)} characters, not shown>"  # maybe another key
        if path is None:
            where, fix = (
                f"RL_MULTILORA_TINKER_TOKEN={shown}",
                "a tml-... token, or unset it to use --state-dir's token",
            )
        else:
            where, fix = (
                f"the token file {path} holding {shown}",
                "delete the file and the next start writes a new one",
            )
        raise ValueError(f"{where} is not allowed: token must start with 'tml-' (the tinker SDK refuses other API "
                         f"keys); allowed: {fix}")  # fmt: skip
    return token


def main(argv: list[str] | None = None, process_entry: bool | None = None) -> int:
    """`rl-multilora tinker-serve ARGS` (`argv`: ARGS; None: this process's own). `process_entry`: whether this call
    is the process's command, which `--host-allocator jemalloc` may start again (default: `argv` is None)."""
    from rl_multilora.host_memory import allocator_name, start_with_jemalloc

    process_entry = argv is None if process_entry is None else process_entry
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="rl-multilora tinker-serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="base model folder (e.g. artifacts/tiny/model)")
    p.add_argument("--state-dir", required=True, type=Path, help="request journal, checkpoints and token live here")
    p.add_argument("--base-model-name", default=None, help="name clients pass as base_model (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-rank", type=int, default=32)
    p.add_argument("--max-tenants", type=int, default=None,
                   help="models that may be live at once; more than --max-loras pages them between the slots and "
                   "host memory instead of refusing (default: --max-loras)")  # fmt: skip
    p.add_argument("--host-budget-gb", type=float, default=None,
                   help="with --max-tenants: host memory for paged-out models, the rest spills to state-dir/paged")  # fmt: skip
    p.add_argument("--max-sampler-versions", type=int, default=4,
                   help="in-memory sampler versions kept per model; the least recently used beyond it is freed")  # fmt: skip
    p.add_argument("--snapshot-every", type=int, default=50,
                   help="a model's optimizer steps between journal snapshots: a restart replays at most this many "
                   "steps' requests per model (default 50)")  # fmt: skip
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="the most tokens one sample may generate (default: the model's context length)")  # fmt: skip
    p.add_argument("--request-tokens", type=int, default=REQUEST_TOKENS,
                   help="the tokens SDK 0.38 puts in one forward_backward request at most (it splits a larger call "
                   "into several, whose gradients accumulate): a request's memory follows its tokens "
                   f"(default {REQUEST_TOKENS})")  # fmt: skip
    p.add_argument("--no-unembed-lora", dest="unembed_lora", action="store_false",
                   help="no LoRA on the output head: clients' train_unembed is then not applied (reported false); "
                   "by default lm_head is a LoRA target and train_unembed=True (the SDK's default) trains it")  # fmt: skip
    p.add_argument("--session-timeout-s", type=float, default=120.0,
                   help="a session without heartbeats for this long is ended: its queued requests fail and its "
                   "models are unloaded, checkpoints kept (the SDK beats every 10 s; default 120)")  # fmt: skip
    p.add_argument("--stability-max-tokens", type=int, default=MAX_TOKENS,
                   help="tokens of stability records (record_stability_info samples, for stable_reinforce) kept at "
                   "most; past it the least recently used are evicted; unused ones go after a day "
                   f"(default {MAX_TOKENS})")  # fmt: skip
    p.add_argument("--host-allocator", choices=("glibc", "jemalloc"), default="glibc",
                   help="the server's malloc: jemalloc (the jemalloc extra, Ray's wheel; Linux) reuses freed memory "
                   "by size class where glibc's heap keeps holes between live tensors; the command starts itself "
                   "again with it preloaded, as `rl-multilora run` does for model.host_allocator (default glibc)")  # fmt: skip
    args = p.parse_args(argv)
    # A flag's mistake is a usage error (exit 2) naming the flag, before a model is read or a token written.
    from pydantic import ValidationError

    from rl_multilora.config import ModelConfig
    from rl_multilora.errors import bad_value

    if not (Path(args.model) / "config.json").is_file():
        p.error(bad_value("--model", args.model, "a model folder in HF format, with its config.json"))
    for flag in ("--port", "--max-sampler-versions", "--snapshot-every", "--stability-max-tokens", "--max-tokens-cap",
                 "--request-tokens"):  # fmt: skip
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not 1 <= value <= (65535 if flag == "--port" else math.inf):
            p.error(bad_value(flag, value, "a port from 1 to 65535" if flag == "--port" else "an integer >= 1"))
    if not 0 < args.session_timeout_s < math.inf:
        p.error(bad_value("--session-timeout-s", args.session_timeout_s, "seconds > 0"))
    sized = {"max_loras": args.max_loras, "max_rank": args.max_rank, "max_tenants": args.max_tenants,
             "host_budget_gb": args.host_budget_gb}  # fmt: skip
    try:  # the bounds the server's ModelConfig holds them to
        ModelConfig(path=args.model, **sized)
    except ValidationError as e:
        problems = [
            bad_value(
                "--" + str(err["loc"][0]).replace("_", "-"), err["input"], err["msg"].removeprefix("Input should be ")
            )
            for err in e.errors()
        ]
        p.error("; ".join(problems))
    if args.max_tenants is not None and args.max_tenants < args.max_loras:
        p.error(bad_value("--max-tenants", args.max_tenants, f"an integer >= --max-loras ({args.max_loras}) or none"))
    from rl_multilora.engine_serve import bind_problem

    if problem := bind_problem(args.host, args.port):  # before the model loads, not at web.run_app after it
        p.error(problem)
    if args.state_dir.exists() and not args.state_dir.is_dir():
        p.error(bad_value("--state-dir", str(args.state_dir), "a folder, or a path to create one at (it is a file)"))
    try:
        args.state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(bad_value("--state-dir", str(args.state_dir), f"a folder this user can create ({e.strerror or e})"))
    logging.basicConfig(level=logging.INFO)
    try:
        if args.host_allocator == "jemalloc":  # `rl-multilora` (cli.main) restores the children's environment
            start_with_jemalloc(["tinker-serve", *argv], process_entry, "--host-allocator")
        try:
            token = resolve_token(args.state_dir, check=True)
        except OSError as e:  # the token file cannot be written or read
            where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
            p.error(bad_value("--state-dir", str(args.state_dir), f"a folder this user can write ({where})"))
        server = build_server(
            args.model, args.state_dir, token, args.base_model_name, args.max_loras, args.max_rank,
            max_sampler_versions=args.max_sampler_versions, snapshot_every=args.snapshot_every,
            max_tokens_cap=args.max_tokens_cap, session_timeout_s=args.session_timeout_s,
            max_tenants=args.max_tenants, host_budget_gb=args.host_budget_gb, unembed_lora=args.unembed_lora,
            stability_max_tokens=args.stability_max_tokens, request_tokens=args.request_tokens,
        )  # fmt: skip
    except ValueError as e:  # a setting or token the server refuses (each message names it and what is allowed)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tinker API on http://{args.host}:{args.port} (token in $RL_MULTILORA_TINKER_TOKEN or "
          f"{args.state_dir / 'token'}; host allocator {allocator_name()})", flush=True)  # fmt: skip
    web.run_app(server.app(), host=args.host, port=args.port, print=None, shutdown_timeout=SHUTDOWN_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
