"""WeightSync: one pause per sync, only the named adapters pushed, versions bumped, unload before push."""

import torch

from rl_multilora.config import AdapterConfig
from rl_multilora.tenants import Tenant
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


def _tenant(name, slot):
    cfg = AdapterConfig(name=name, dataset={"path": "json"}, reward={"name": "gsm8k"}, max_steps=2, rank=2)
    return Tenant(cfg=cfg, slot=slot, dirty=True)


def test_one_pause_only_changed_pushed_versions_bump():
    eng = RecordingEngine()
    ws = WeightSync(eng, FakeBackend())
    a, b = _tenant("a", 0), _tenant("b", 1)
    st = ws.sync(push=[a, b], unload=[])
    assert st.adapters_pushed == ["a", "b"] and st.bytes_pushed == 2 * (16 + 16) * 4  # two adapters, fp32
    assert (a.weight_version, b.weight_version, a.in_engine, a.dirty) == (0, 0, True, False)
    b.slot = None  # b left
    st = ws.sync(push=[a], unload=[b])
    assert eng.calls[4:] == [("pause",), ("unload", "b"), ("load", "a", 1), ("resume",)]
    assert a.weight_version == 1 and not b.in_engine and ws.pauses == 2
    assert st.adapters_unloaded == ["b"]
    # Nothing changed: no pause at all.
    assert not ws.sync(push=[], unload=[]).paused and ws.pauses == 2
