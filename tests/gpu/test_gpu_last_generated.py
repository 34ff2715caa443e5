"""LAST_GENERATED (-2) with CUDA-graph decode (issue 9 item 5): float32 on CUDA, TF32 off.
The scoring rows ride in replayed decode graphs (the handler reads the graph's hidden-state
output); each sequence's value matches the head on transformers' final hidden state of prompt +
generated ids (CPU, float32); greedy tokens equal those of the engine without the handler."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.model.custom_output import CustomOutputHandler
from tapserve.ranks.plan import StepKind
from tests.custom.test_custom_last_generated import check_values, one_call_per_step
from tests.helpers.custom import assert_no_leaks, make_llm, prompt, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("no_tf32"),
]
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref, no_tf32
pytest.importorskip("transformers")

LAST = {"position": CustomOutputHandler.LAST_GENERATED}


def test_last_generated_in_decode_graphs(ckpt, ref) -> None:
    gpu = dict(device="cuda", enforce_eager=False, max_num_seqs=8)
    llm, plain = make_llm(ckpt, **gpu), make_llm(ckpt, custom_module=None, **gpu)
    assert llm.runner.graphs is not None
    reqs = [
        (f"g{i}", prompt(n, 10 + i), SamplingParams(max_new_tokens=m, temperature=0), LAST)
        for i, (n, m) in enumerate([(5, 3), (13, 6), (21, 9), (8, 12)])
    ]
    reqs.append(("n3", prompt(17, 50), SamplingParams(max_new_tokens=5, n=3, seed=11), LAST))
    r = run(llm, reqs)
    assert not r.errors
    one_call_per_step(r)
    replayed = [p for p, _ in r.steps if p.kind is StepKind.DECODE and p.custom_rows.size]
    assert replayed and all(p.graph_bucket >= 0 for p in replayed)
    for rid, ids, params, _ in reqs:
        tokens = check_values(r, rid, ids, ref)
        assert all(len(t) == params.max_new_tokens for t in tokens.values())
    r0 = run(plain, [(rid, ids, params, None) for rid, ids, params, _ in reqs[:4]])
    for rid, *_ in reqs[:4]:
        assert r0.tokens(rid) == r.tokens(rid)
    assert_no_leaks(llm)
