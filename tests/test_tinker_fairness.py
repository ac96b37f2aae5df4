"""Queue fairness of the Tinker server: one client's long queue cannot delay another client's request by more than
one batch. The worker takes the next request of every model into each batch, so a request of client B that arrives
behind 12 queued requests of client A runs in the batch after the one in flight, not after A's queue."""

from __future__ import annotations

import tinker

from tests.test_tinker_server import BASE, TOKEN, _datum, _Running, tiny_model_folder  # noqa: F401


def _resolved(server, model_id: str) -> list[int]:
    """The server's resolve order of each of `model_id`'s finished requests (`Result.resolved`)."""
    results = server.server.state.results
    return [
        r.resolved for key, r in list(results.items()) if key.startswith(model_id + ".") and r.resolved is not None
    ]


def _done(server, model_id: str) -> int:
    return len(_resolved(server, model_id))


def test_a_long_queue_delays_another_client_by_at_most_one_batch(tmp_path):
    server = _Running(tmp_path / "state")
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        a = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        b = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        # A's requests done when B's reached the server, read by the server's own thread as it registers B's request
        # (not when the test sent it: on a loaded machine the SDK's thread can send it a few of A's batches later)
        arrived: dict[str, int] = {}
        dispatch = server.server._dispatch

        def recording(key, kind, *args, **kwargs):
            if kind == "forward_backward" and key.startswith(b.model_id + ".") and "before" not in arrived:
                arrived["before"] = _done(server, a.model_id)
            return dispatch(key, kind, *args, **kwargs)

        server.server._dispatch = recording
        long = [_datum(list(range(5, 60)))] * 4  # A's requests are 4 sequences each: each takes a while
        queued = [a.forward_backward(long, "cross_entropy") for _ in range(12)]
        queued[0].result()  # A's queue is being worked through
        b.forward_backward([_datum(list(range(5, 12)))], "cross_entropy").result()
        before = arrived["before"]
        # A's requests the server finished before B's, by its own order (not by when B's answer reached us: the
        # SDK's polling can lag a few of A's batches on a loaded machine)
        b_order = max(_resolved(server, b.model_id))
        after = sum(1 for order in _resolved(server, a.model_id) if order < b_order)
        print(f"A done when B arrived: {before}, finished before B on the server: {after}")
        assert before < 8, f"A's queue was nearly done before B arrived ({before}); the test measured nothing"
        # the batch in flight when B arrived, then the batch that holds B (and A's next request beside it): 2; 3 when
        # a batch of A's had finished on the worker but the server's loop had not resolved it yet as B arrived (a
        # loaded machine). A FIFO would be 12 - before - 1 >= 4.
        assert after - before <= 3, (before, after)
        for f in queued:
            f.result()
        assert _done(server, a.model_id) == 12  # all of A's queue ran, after B
    finally:
        server.close()
