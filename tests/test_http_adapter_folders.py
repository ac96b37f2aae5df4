"""The engine server loads adapters only through the one adapter-folder loader and never takes non-finite weights:
a NaN adapter, a pickle-only folder or a folder that links out answer 400 and change nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rollout.sglang.client import SGLangEngine, SGLangError
from tests.test_http_engine import CONFIG, served, tensors  # noqa: F401 - the served fixture


def test_non_finite_and_unsafe_adapters_are_refused(served, tmp_path):  # noqa: F811
    engine, server = served
    client = SGLangEngine(server.url, tensor_format="safetensors")
    nan = {k: torch.full_like(v, float("nan")) for k, v in tensors(1).items()}
    with pytest.raises(SGLangError, match="NaN or inf"):
        client.load_adapter("n", nan, CONFIG)
    folders = {}
    for name in ("nan", "pickle", "link"):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(CONFIG))
        folders[name] = d
    save_file(nan, str(folders["nan"] / "adapter_model.safetensors"))
    (folders["pickle"] / "adapter_model.bin").write_bytes(b"\x80\x04never opened")
    (folders["pickle"] / "adapter_model.safetensors").symlink_to(folders["pickle"] / "adapter_model.bin")
    outside = tmp_path / "outside.safetensors"
    save_file(tensors(2), str(outside))
    (folders["link"] / "adapter_model.safetensors").symlink_to(outside)
    expected = {"nan": "NaN or inf", "pickle": "cannot be read", "link": "outside the folder"}
    for name, folder in folders.items():
        with pytest.raises(SGLangError, match=expected[name]):
            client.load_adapter_from_path(name, str(folder))
    assert engine.calls == []  # nothing reached the engine
