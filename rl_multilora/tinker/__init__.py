"""A Tinker-API-compatible server: the unmodified `tinker` SDK (0.38) trains LoRA tenants of one multi-LoRA model.

`server.py` is the aiohttp app (the SDK's endpoints, futures, auth), `ops.py` the model work (mixed-batch
forward/backward, per-tenant AdamW, in-memory sampler versions), `wire.py` the protobuf bodies, `journal.py` the
durable SQLite request log that a restarted server replays.
"""

SUPPORTED_SDK = ">=0.38,<0.39"
