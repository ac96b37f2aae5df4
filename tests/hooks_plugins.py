"""Hooks classes loaded by import path in tests/test_generate_state.py (the `module:Class` plugin contract)."""

from rollout.generate_state import GenerateStateHooks, MultiLoRAHooks


class RecordingHooks(GenerateStateHooks):
    """Records every hook call as (event, detail) so a test can check the exact order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.pending_at_submit: list[int] = []

    def on_rollout_start(self, state) -> None:
        self.events.append(("start", None))

    def on_group_submit(self, state, group) -> None:
        self.events.append(("submit", (group[0].adapter.name, group[0].group_index)))

    def on_sample_done(self, state, sample) -> None:
        self.events.append(("sample", (sample.adapter.name, sample.group_index, sample.index)))

    def on_group_done(self, state, group) -> None:
        self.events.append(("group", (group[0].adapter.name, group[0].group_index)))

    def on_rollout_end(self, state, samples) -> None:
        self.events.append(("end", len(samples)))


class CountingMultiLoRAHooks(MultiLoRAHooks):
    """Extends the default hooks: records each adapter's in-flight count whenever a sample finishes."""

    def __init__(self, registry=None) -> None:
        super().__init__(registry)
        self.seen_in_flight: dict[str, list[int]] = {}

    def on_sample_done(self, state, sample) -> None:
        super().on_sample_done(state, sample)
        self.seen_in_flight.setdefault(sample.adapter.name, []).append(self.in_flight(sample.adapter.name))


class NotAHooksClass:
    """Has the right method names but does not subclass GenerateStateHooks: load_hooks must reject it."""

    def on_rollout_start(self, state) -> None:
        pass


not_a_class = RecordingHooks()
