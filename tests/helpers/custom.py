"""Shared helpers for tests/test_custom_*.py: a tiny transformers checkpoint with head weights
in its safetensors, the transformers reference for final hidden states, test handlers, and a
step-by-step driver that records every output the engine emits.

The handlers here are loaded by the engine itself (`custom_module="tests.helpers.custom:Name"`),
so they go through the same loading, weight lookup and dry run as a deployment's module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import RequestOutput
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.custom_outputs import RequestError, decode_value
from tapserve.coordinator.offline import LLM
from tapserve.model.custom_output import CustomOutputHandler
from tests.helpers.engine import capture_plans

HEAD_W, HEAD_B = "test_head.weight", "test_head.bias"
REWARD_W, REWARD_B = "reward_head.weight", "reward_head.bias"
HEAD_WIDTH = 3
HIDDEN = 64
VOCAB = 512
BLOCK = 8


# ---- checkpoint + transformers reference ---------------------------------------------------
def head_tensors(hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {
        HEAD_W: torch.randn(HEAD_WIDTH, hidden, generator=gen) / hidden**0.5,
        HEAD_B: torch.randn(HEAD_WIDTH, generator=gen),
        REWARD_W: torch.randn(1, hidden, generator=gen) / hidden**0.5,
        REWARD_B: torch.randn(1, generator=gen),
    }


def make_head_checkpoint(path: Path, arch: str = "qwen3") -> Path:
    """A tiny transformers checkpoint (float32) with the heads' weights added to its
    safetensors."""
    from tests.helpers.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(path, arch, extra_tensors=head_tensors())


def linear_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden.float(), weight.float(), bias.float())


class Reference:
    """transformers' own forward of the checkpoint: final hidden states of a whole prompt."""

    def __init__(self, path: Path, arch: str = "qwen3"):
        import transformers

        transformers.logging.set_verbosity_error()
        name = {
            "qwen3": "Qwen3ForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "llama": "LlamaForCausalLM",
        }[arch]
        self.model = (
            getattr(transformers, name).from_pretrained(str(path), dtype=torch.float32).eval()
        )
        self.tensors = head_tensors()
        self._checked = False

    @torch.no_grad()
    def final_hidden(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), hidden]: `output_hidden_states=True`'s last element."""
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        if not self._checked:  # that element is final-normed: lm_head of it gives the logits
            assert torch.allclose(self.model.lm_head(hidden), out.logits[0], atol=1e-4, rtol=1e-4)
            self._checked = True
        return hidden

    def head(self, ids: list[int], position: int) -> torch.Tensor:
        """The test head on the reference hidden state: [1, HEAD_WIDTH] float32."""
        h = self.final_hidden(ids)[position : position + 1]
        return linear_head(h, self.tensors[HEAD_W], self.tensors[HEAD_B])

    def reward(self, ids: list[int], position: int) -> torch.Tensor:
        h = self.final_hidden(ids)[position : position + 1]
        return linear_head(h, self.tensors[REWARD_W], self.tensors[REWARD_B])[:, 0]


def assert_close(actual: torch.Tensor | None, expected: torch.Tensor) -> None:
    assert actual is not None, "no custom output"
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# ---- handlers --------------------------------------------------------------------------------


class Unprintable(Exception):
    """What a careless handler may hand back: str() and repr() both raise."""

    def __str__(self) -> str:
        raise RuntimeError("str() of this object fails")

    def __repr__(self) -> str:
        raise RuntimeError("repr() of this object fails")


class ProbeHead(CustomOutputHandler):
    """Linear head [rows, 3] float32 on test_head.*, with switches the tests flip on the
    engine's instance (`llm.engine.handler`):

    - `calls`: rows of every forward call (the start-up dry run is call 0);
    - `fail_calls`: indices into `calls` whose forward raises;
    - `mode`: "ok", "float64", "extra_row", "3d", "int64", "list" or "dtype";
    - `out_dtype`: the dtype of mode "dtype" (extra columns of special values, bit patterns);
    - `outputs`: every tensor forward returned.

    Selection: params {"position": p} (returned unchecked: the engine range-checks),
    {"raise": "value"} -> ValueError, {"raise": "runtime"} -> RuntimeError, {"raise":
    "unprintable"} -> an exception whose str() raises, {"unprintable": true} -> returns an
    object whose repr() raises, {"none": true} -> -1; default the last prompt token.
    `fail_unprintable`: the failing forward calls raise an exception whose str() raises.
    """

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.fail_calls: set[int] = set()
        self.fail_unprintable = False
        self.mode = "ok"
        self.out_dtype = torch.float32
        self.outputs: list[torch.Tensor] = []
        self.weight = self.bias = None

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        params = params or {}
        if params.get("raise") == "value":
            raise ValueError("position spec is not valid")
        if params.get("raise") == "runtime":
            raise RuntimeError("selector crashed")
        if params.get("raise") == "unprintable":
            raise Unprintable()
        if params.get("unprintable"):
            return Unprintable()
        if params.get("none"):
            return -1
        return params.get("position", len(input_ids) - 1)

    def weight_names(self) -> list[str]:
        return [HEAD_W, HEAD_B]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight, self.bias = tensors[HEAD_W], tensors[HEAD_B]

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls.append(selected_hidden_states.shape[0])
        if len(self.calls) - 1 in self.fail_calls:
            raise Unprintable() if self.fail_unprintable else RuntimeError("injected head failure")
        out = linear_head(selected_hidden_states, self.weight, self.bias)
        if self.mode == "float64":
            out = out.double()
        elif self.mode == "extra_row":
            out = torch.cat([out, out[:1]])
        elif self.mode == "3d":
            out = out[:, None, :]
        elif self.mode == "int64":
            out = out.long()
        elif self.mode == "list":
            out = out.tolist()
        elif self.mode == "dtype":
            out = with_special_values(out, self.out_dtype)
        self.outputs.append(out.clone() if isinstance(out, torch.Tensor) else out)
        return out


class StopProbe(ProbeHead):
    """ProbeHead whose should_stop fires on a row whose column 0 reaches the request's
    params["threshold"] (no threshold: never); `stop_calls` records each call's rows;
    `stop_mode`: "ok", "raise", "float" (a float tensor) or "short" (one row too few)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_calls: list[int] = []
        self.stop_mode = "ok"

    def should_stop(self, outputs: torch.Tensor, params: list[dict | None]) -> torch.Tensor:
        self.stop_calls.append(outputs.shape[0])
        if self.stop_mode == "raise":
            raise RuntimeError("injected should_stop failure")
        limits = [(p or {}).get("threshold", float("inf")) for p in params]
        flags = outputs[:, 0] >= torch.tensor(limits, device=outputs.device)
        if self.stop_mode == "float":
            return flags.float()
        return flags[1:] if self.stop_mode == "short" else flags


class ReusedBufferProbe(ProbeHead):
    """ProbeHead returning a view of one output tensor it overwrites on every call (rows
    the engine keeps must be its copies)."""

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(selected_hidden_states)
        if getattr(self, "buffer", None) is None or self.buffer.shape[0] < out.shape[0]:
            self.buffer = torch.empty(max(out.shape[0], 64), out.shape[1], dtype=out.dtype)
        self.buffer.fill_(float("nan"))
        self.buffer[: out.shape[0]] = out
        return self.buffer[: out.shape[0]]


def with_special_values(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """base [rows, 3] float32 -> [rows, 3 + k] in dtype: the (cast) head values, then values
    whose bit patterns must survive exactly (NaN, +-inf, -0.0, the smallest subnormal, max)."""
    rows = base.shape[0]
    if dtype == torch.int32:
        info = torch.iinfo(torch.int32)
        special = torch.tensor([info.min, info.max, -1, 0, 1], dtype=torch.int32)
        head = (base * 1000).round().to(torch.int32)
    else:
        info = torch.finfo(dtype)
        special = torch.tensor(
            [float("nan"), float("inf"), float("-inf"), -0.0, info.max, info.smallest_normal],
            dtype=dtype,
        )
        special = torch.cat([special, (special[-1:] / 4)])  # a subnormal
        head = base.to(dtype)
    return torch.cat([head, special.expand(rows, -1)], dim=1)


class CountingReward(CustomOutputHandler):
    """1-D float32 head [rows] on reward_head.* (shape [1] per request)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def select_token_position(self, input_ids: list[int], params: dict | None) -> int:
        return (params or {}).get("position", len(input_ids) - 1)

    def weight_names(self) -> list[str]:
        return [REWARD_W, REWARD_B]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.weight, self.bias = tensors[REWARD_W], tensors[REWARD_B]

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls.append(selected_hidden_states.shape[0])
        return linear_head(selected_hidden_states, self.weight, self.bias)[:, 0]


class ModuleHead(torch.nn.Module):
    """A duck-typed handler built from nn.Linear (parameters require grad): forward must run
    without autograd on the engine's inference tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HEAD_WIDTH)

    def select_token_position(self, input_ids, params):
        return len(input_ids) - 1

    def weight_names(self):
        return [HEAD_W, HEAD_B]

    def load_weights(self, tensors):
        with torch.no_grad():
            self.proj.weight.copy_(tensors[HEAD_W])
            self.proj.bias.copy_(tensors[HEAD_B])

    def forward(self, selected_hidden_states):
        return self.proj(selected_hidden_states.float())


class NoForward:
    def select_token_position(self, input_ids, params):
        return 0


class MissingWeights(ProbeHead):
    def weight_names(self) -> list[str]:
        return [HEAD_W, "no_such_head.weight"]


class BadDryRun(ProbeHead):
    def forward(self, selected_hidden_states):
        return selected_hidden_states.double()  # float64: not an allowed dtype


class CrashingDryRun(ProbeHead):
    def forward(self, selected_hidden_states):
        raise RuntimeError("head not initialised")


# ---- engine driver ---------------------------------------------------------------------------
def make_llm(
    ckpt: Path, custom_module: str | None = "tests.helpers.custom:ProbeHead", **overrides
) -> LLM:
    kwargs = dict(
        model=str(ckpt),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=96,
        max_num_batched_tokens=32,
        max_model_len=256,
        custom_module=custom_module,
    )
    kwargs.update(overrides)
    from tests.helpers.invariants import watch_steps  # block-accounting invariants after every step

    return watch_steps(LLM(EngineConfig(**kwargs)))


@dataclass
class Run:
    """Everything the engine emitted for some requests, driven step by step."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    errors: dict[str, RequestError] = field(default_factory=dict)  # refused at add_request
    steps: list = field(default_factory=list)  # (plan, handler calls during the step)

    def final(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]

    def value(self, rid: str) -> torch.Tensor | None:
        raw = self.final(rid).custom_output
        return None if raw is None else decode_value(raw)

    def tokens(self, rid: str) -> dict[int, list[int]]:
        """Sequence index -> all its tokens."""
        seqs: dict[int, list[int]] = {}
        for out in self.outputs[rid]:
            for s in out.sequences:
                seqs.setdefault(s.index, []).extend(s.new_token_ids)
        return seqs

    def finish_reasons(self, rid: str) -> dict[int, str | None]:
        reasons: dict[int, str | None] = {}
        for out in self.outputs[rid]:
            for s in out.sequences:
                reasons[s.index] = s.finish_reason or reasons.get(s.index)
        return reasons


def run(
    llm: LLM,
    requests: list[tuple[str, list[int], SamplingParams, dict | None]],
    run_: Run | None = None,
    max_steps: int = 500,
) -> Run:
    """Add the requests, step the engine until idle (recording each step's plan and the
    number of handler calls during it), and check that no KV block leaked."""
    engine = llm.engine
    result = run_ or Run()
    with capture_plans(llm) as plans:
        for rid, ids, params, cop in requests:
            try:
                engine.add_request(rid, ids, params, cop)
            except RequestError as e:
                result.errors[rid] = e
        for _ in range(max_steps):
            if not engine.has_work():
                break
            before = len(getattr(engine.handler, "calls", []))
            n_plans = len(plans)
            for out in engine.step():
                result.outputs.setdefault(out.request_id, []).append(out)
            if len(plans) > n_plans:
                after = len(getattr(engine.handler, "calls", []))
                result.steps.append((plans[-1], after - before))
        else:
            raise AssertionError("engine did not finish")
    assert_no_leaks(llm)
    return result


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.check_invariants()
    from tests.helpers.invariants import check_engine

    check_engine(engine)


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (length,), generator=gen).tolist()


def greedy(max_new_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)
