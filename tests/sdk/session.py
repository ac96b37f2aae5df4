"""One small Tinker client session, run by a `tinker` SDK release in a venv of its own (tests/sdk_versions.sh):
only the SDK (and numpy, its dependency) is imported, so it runs unchanged on every supported release.

create -> forward -> forward_backward x3 with optim_step -> save_state -> sampler weights -> sample (with the
sampled tokens' log-probs), and a check of each answer's shape. Prints one JSON line with the SDK version and what
it saw; exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import tinker
from tinker import types


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--base-model", required=True)
    args = p.parse_args()
    sc = tinker.ServiceClient(base_url=args.base_url)  # the key comes from $TINKER_API_KEY
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=4, seed=0)
    tc = tc if isinstance(tc, tinker.TrainingClient) else tc.result()  # a client (older SDKs) or a future of one
    tokens = list(range(5, 25))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
    forward = tc.forward([datum], "cross_entropy").result()
    logprobs = forward.loss_fn_outputs[0]["logprobs"]
    lp = np.asarray(logprobs.tolist() if hasattr(logprobs, "tolist") else logprobs.data, dtype=np.float64)
    assert lp.shape == (len(tokens) - 1,) and np.isfinite(lp).all() and (lp < 0).all(), lp
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss:sum"])
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert abs(losses[0] + lp.sum()) < 1e-3 * abs(losses[0]), (losses[0], lp.sum())  # forward = the first step's loss
    saved = tc.save_state("sdk-check").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/sdk-check"), saved
    sampler = tc.save_weights_and_get_sampling_client(name="sdk-check-sampler")
    sampler = sampler if isinstance(sampler, tinker.SamplingClient) else sampler.result()
    result = sampler.sample(
        types.ModelInput.from_ints(tokens[:4]), num_samples=2, sampling_params=types.SamplingParams(max_tokens=5)
    ).result()
    assert len(result.sequences) == 2, result
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens), seq
        assert all(math.isfinite(v) and v <= 0 for v in seq.logprobs), seq
    print(json.dumps({"sdk": tinker.__version__, "losses": losses, "saved": saved,
                      "sampled": [list(s.tokens) for s in result.sequences]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
