"""GPU correctness (issue 6 item 4): float32 on CUDA with TF32 off gives greedy tokens identical
to transformers, eagerly and with CUDA-graph decode; bfloat16 teacher-forced top-1 agreement
with transformers and between eager and graph decode, over confident positions."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.offline import LLM
from tests.helpers.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LENGTHS = (1, 5, 16, 17, 33, 40, 3, 64)


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_greedy(path, prompts, new_tokens, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        # (an explicit attention mask: else a prompt token equal to pad_token_id is masked)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_float32_greedy_matches_transformers(tmp_path, arch, eager):
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    prompts = _prompts(512)
    llm = LLM(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cuda",
            enforce_eager=eager,
            max_num_seqs=16,
            max_model_len=256,
        )
    )
    assert (llm.runner.graphs is None) == eager
    got = [
        r.outputs[0].token_ids
        for r in llm.generate(
            prompts, SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
        )
    ]
    assert got == _hf_greedy(str(path), prompts, 32, torch.float32)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def _teacher_forced_top1(model_fn, seqs):
    return [model_fn(torch.tensor([s], device="cuda")).argmax(-1)[0] for s in seqs]


def _bf16_runs(path: str, prompts, eager_modes, one_at_a_time: bool = False) -> dict:
    """Each prompt plus its 48 greedy tokens from our bf16 engine, per eager mode; one prompt
    at a time decodes at batch 1 (the one-row GEMV of model/kernels/gemv.py)."""
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    runs = {}
    for eager in eager_modes:
        llm = LLM(
            EngineConfig(
                model=path,
                dtype="bfloat16",
                device="cuda",
                enforce_eager=eager,
                max_num_seqs=16,
                max_model_len=256,
            )
        )
        groups = [[p] for p in prompts] if one_at_a_time else [prompts]
        outs = [r for g in groups for r in llm.generate(g, params)]
        runs[eager] = [p + r.outputs[0].token_ids for p, r in zip(prompts, outs)]
        del llm
    return runs


def _agreement(path: str, prompts, seqs, seqs_eager=None) -> tuple[float, int, float, int]:
    """Teacher-forced top-1 agreement of transformers bf16 with our generated tokens, and of
    our eager tokens with our graph tokens (same context only), over the positions where the
    fp32 reference's top-2 margin exceeds 0.1: (hf rate, positions, graph rate, positions)."""
    from transformers import AutoModelForCausalLM

    ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    agree_hf = total = agree_graph = total_graph = 0
    with torch.no_grad():
        for i, (p, seq) in enumerate(zip(prompts, seqs)):
            ids = torch.tensor([seq], device="cuda")
            l32 = ref32(ids).logits[0].float()
            l16 = ref16(ids).logits[0].float()
            top2 = l32.topk(2, dim=-1).values
            for pos in range(len(p) - 1, len(seq) - 1):
                if top2[pos, 0] - top2[pos, 1] <= 0.1:
                    continue
                total += 1
                agree_hf += int(l16[pos].argmax()) == seq[pos + 1]
                if seqs_eager and seq[: pos + 1] == seqs_eager[i][: pos + 1]:  # same context
                    total_graph += 1
                    agree_graph += seq[pos + 1] == seqs_eager[i][pos + 1]
    return agree_hf / max(total, 1), total, agree_graph / max(total_graph, 1), total_graph


def test_bfloat16_agreement_with_transformers_and_graphs(tmp_path):
    """Generate 48 tokens per prompt with our bf16 engine (graphs) and eager; score every
    generated position teacher-forced with transformers bf16 and fp32; count agreement where the
    fp32 top-2 margin exceeds 0.1."""
    path = str(make_tiny_checkpoint(tmp_path / "q", "qwen3"))
    prompts = _prompts(512)
    runs = _bf16_runs(path, prompts, (False, True))
    hf, total, graph, total_graph = _agreement(path, prompts, runs[False], runs[True])
    assert total > 100 and total_graph > 50
    assert hf >= 0.99, (hf, total)
    assert graph >= 0.99, (graph, total_graph)


def test_bfloat16_batch1_agreement_with_transformers(tmp_path):
    """The same agreement with every prompt decoded alone in the batch-1 graph, where the
    q/k/v, o and down projections run on the project's GEMV under PDL."""
    from tapserve.model.kernels.pdl import use_pdl
    from tapserve.model.layers import GEMV_MAX_ROWS

    assert GEMV_MAX_ROWS >= 1, "run without TAPSERVE_GEMV_MAX_ROWS=0: this tests the GEMV"
    if torch.cuda.get_device_capability()[0] >= 9:
        assert use_pdl(torch.zeros(1, device="cuda")), "run without TAPSERVE_PDL=0"
    path = str(make_tiny_checkpoint(tmp_path / "q", "qwen3"))
    prompts = _prompts(512)
    seqs = _bf16_runs(path, prompts, (False,), one_at_a_time=True)[False]
    hf, total, _, _ = _agreement(path, prompts, seqs)
    assert total > 100, total
    assert hf >= 0.99, (hf, total)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_async_scheduling_gives_the_synchronous_tokens(tmp_path, eager):
    """Steps launched ahead of their predecessor's sampling (the CUDA default, with
    the ids passed on the device and copied home through pinned memory) give the tokens and
    finishes of the synchronous engine: greedy in float32 with requests ending one by one,
    and in bfloat16, with every request ending together (so the draws' seeds and noise come
    in the same order), a temperature draw and a batch mixing greedy, temperature, top-p and
    top-k rows (Sampler.plain_tensor)."""
    path = str(make_tiny_checkpoint(tmp_path / "q", "qwen3"))
    prompts = _prompts(512)
    cases = [
        (
            "float32",
            [
                SamplingParams(max_new_tokens=6 + 5 * i, temperature=0, ignore_eos=True)
                for i in range(len(prompts))
            ],
        ),
        ("bfloat16", SamplingParams(max_new_tokens=24, temperature=0.7, ignore_eos=True)),
        (
            "bfloat16",
            [
                SamplingParams(max_new_tokens=16, ignore_eos=True, **kind)
                for kind in (
                    {"temperature": 0},
                    {"temperature": 0.8, "top_p": 0.9},
                    {"temperature": 1.0, "top_k": 20},
                    {"temperature": 0.6},
                )
            ]
            * 2,
        ),
    ]
    for dtype, params in cases:
        got = {}
        for run_ahead in (False, True):
            llm = LLM(
                EngineConfig(
                    model=path,
                    dtype=dtype,
                    device="cuda",
                    enforce_eager=eager,
                    max_num_seqs=16,
                    max_model_len=256,
                    async_scheduling=run_ahead,
                    seed=3,
                )
            )
            got[run_ahead] = [
                (r.outputs[0].token_ids, r.outputs[0].finish_reason)
                for r in llm.generate(prompts, params)
            ]
            assert (llm.engine.num_ahead_steps > 10) == run_ahead, llm.engine.num_ahead_steps
            assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
            del llm
        assert got[True] == got[False], dtype


def test_async_scheduling_is_the_cuda_default_at_tp1():
    llm = LLM(EngineConfig(model=None, device="cuda", max_num_seqs=4, max_model_len=128))
    assert llm.engine.run_ahead
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, temperature=0))
    assert llm.engine.num_ahead_steps > 5


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_forked_samples_and_beams_fit_the_decode_workspace(tmp_path, eager):
    """Requests of n samples and beams fork after their prefill; they used to count as one
    row at admission, so a batch grew past max_num_seqs and past the Triton decode workspace
    sized for it (a RuntimeError from the step, found by an outside reviewer on an H200:
    256 requests of n=8). Now they take room for their widest step when admitted."""
    path = str(make_tiny_checkpoint(tmp_path / "q", "qwen3"))
    llm = LLM(
        EngineConfig(
            model=path,
            dtype="bfloat16",
            device="cuda",
            enforce_eager=eager,
            max_num_seqs=8,
            max_model_len=256,
        )
    )
    prompts = _prompts(512)
    params = [SamplingParams(max_new_tokens=8, n=4, temperature=1.0, ignore_eos=True)] * 6 + [
        SamplingParams(max_new_tokens=8, num_beams=4, n=2, temperature=0.0, ignore_eos=True)
    ] * 2
    results = llm.generate(prompts, params)
    assert [len(r.outputs) for r in results] == [4] * 6 + [2] * 2
    assert all(len(o.token_ids) == 8 for r in results for o in r.outputs)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
