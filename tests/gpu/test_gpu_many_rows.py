"""Multi-row selections with CUDA-graph decode: float32 on CUDA, TF32 off. Every generated
token's row (-3) rides in replayed decode graphs, with asynchronous scheduling on; each row
matches the head on transformers' final hidden state of prompt + generated ids (CPU, float32);
greedy tokens equal those of the engine without the handler."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.model.custom_output import CustomOutputHandler
from tapserve.ranks.plan import StepKind
from tests.helpers.custom import assert_no_leaks, make_llm, prompt, run
from tests.helpers.custom_rows import check_against_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("no_tf32"),
]
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref, no_tf32
pytest.importorskip("transformers")

ALL = CustomOutputHandler.ALL_GENERATED


def test_all_generated_rows_in_decode_graphs(ckpt, ref) -> None:
    gpu = dict(device="cuda", enforce_eager=False, max_num_seqs=8, async_scheduling=True)
    llm, plain = make_llm(ckpt, **gpu), make_llm(ckpt, custom_module=None, **gpu)
    assert llm.runner.graphs is not None
    reqs = [
        (f"g{i}", prompt(n, 10 + i), SamplingParams(max_new_tokens=m, temperature=0), sel)
        for i, (n, m, sel) in enumerate(
            [(5, 3, [ALL]), (13, 6, [2, ALL]), (21, 9, [20, ALL]), (8, 12, [ALL])]
        )
    ]
    n3 = SamplingParams(max_new_tokens=5, n=3, seed=11, temperature=1.0)
    reqs.append(("n3", prompt(17, 50), n3, [0, ALL]))
    r = run(llm, [(rid, ids, p, {"position": sel}) for rid, ids, p, sel in reqs])
    assert not r.errors
    replayed = [p for p, _ in r.steps if p.kind is StepKind.DECODE and p.graph_bucket >= 0]
    assert replayed
    for rid, ids, params, _ in reqs:
        positions = check_against_reference(r, rid, ids, ref)
        for i, out in r.tokens(rid).items():
            assert len(out) == params.max_new_tokens
            assert positions[i][-len(out) :] == list(range(len(ids), len(ids) + len(out)))
    r0 = run(plain, [(rid, ids, params, None) for rid, ids, params, _ in reqs[:4]])
    for rid, *_ in reqs[:4]:
        assert r0.tokens(rid) == r.tokens(rid)
    assert_no_leaks(llm)
