"""WeightSync: one pause per sync, only the named adapters pushed, versions bumped, unload before push."""

import torch

from rl_multilora.weight_sync import WeightSync


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def pause(self):
        self.calls.append(("pause",))

    def resume(self):
        self.calls.append(("resume",))

    def load_adapter(self, name, tensors, config, version=None):
        self.calls.append(("load", name, version))
        return version

    def unload_adapter(self, name):
        self.calls.append(("unload", name))


class FakeBackend:
    def adapter_state_dict(self, name):
        return {
            "base_model.model.x.lora_A.weight": torch.zeros(2, 8),
            "base_model.model.x.lora_B.weight": torch.zeros(8, 2),
        }

    def peft_config(self, name):
        return {"peft_type": "LORA", "r": 2, "lora_alpha": 4}


def test_one_pause_only_changed_pushed_versions_bump():
    eng = RecordingEngine()
    ws = WeightSync(eng, FakeBackend())
    st = ws.sync(push=[("a", 0), ("b", 0)], unload=[])
    assert st.adapters_pushed == ["a", "b"] and st.bytes_pushed == 2 * (16 + 16) * 4  # two adapters, fp32
    assert st.pushed == {"a": 0, "b": 0}  # what the tenant manager applies (versions, in_engine)
    st = ws.sync(push=[("a", 1)], unload=["b"])  # b left
    assert eng.calls[4:] == [("pause",), ("unload", "b"), ("load", "a", 1), ("resume",)]
    assert st.pushed == {"a": 1} and ws.pauses == 2
    assert st.adapters_unloaded == ["b"]
    # Nothing changed: no pause at all.
    assert not ws.sync(push=[], unload=[]).paused and ws.pauses == 2
