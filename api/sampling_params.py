"""Per-request sampling parameters. Pure Python (no torch): the API process imports it too."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields

# a temperature below this samples greedily, as vLLM's (1/T would overflow the logits)
GREEDY_TEMPERATURE = 1e-5
MAX_SCALE = 1e30  # temperature and repetition_penalty are clamped to [1e-30, 1e30]
MAX_LOGIT_BIAS = 100.0  # OpenAI's documented range for logit_bias values: [-100, 100]
# fields a model's generation_config.json may give defaults for (vLLM's list)
MODEL_DEFAULT_FIELDS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
}


def is_integer(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite_number(value: object) -> bool:
    """A real number (numpy's too, not a bool) that float holds, finite."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


class BatchDraw(enum.Enum):
    """How a request's decode rows sample once forked (SamplingParams.batch_draw)."""

    GREEDY = "greedy"
    TEMPERATURE = "temperature"
    PLAIN = "plain"
    GENERAL = "general"

    # hashed by identity, in C (Enum's hash runs Python; each step hashes each row's draw)
    __hash__ = object.__hash__


FAST_DRAWS = (BatchDraw.GREEDY, BatchDraw.TEMPERATURE, BatchDraw.PLAIN)  # in order of preference
_ANY = frozenset(FAST_DRAWS)  # the field does not shape a token's draw
_SHAPES = frozenset({BatchDraw.GREEDY, BatchDraw.PLAIN})  # a filter: greedy ignores it
_NONE: frozenset[BatchDraw] = frozenset()  # a non-default value needs the general path


def _param(default: object = None, draw: frozenset[BatchDraw] = _NONE, **kwargs) -> object:
    """A field whose metadata names the fast draws that tolerate a non-default value."""
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    return field(metadata={"draw": draw}, **kwargs)


@dataclass
class SamplingParams:
    max_new_tokens: int = _param(16, _ANY)
    temperature: float = _param(1.0, _ANY)
    top_k: int = _param(0, _SHAPES)  # 0 or -1: disabled
    top_p: float = _param(1.0, _SHAPES)
    min_p: float = _param(0.0, _SHAPES)
    repetition_penalty: float = _param(1.0)
    presence_penalty: float = _param(0.0)
    frequency_penalty: float = _param(0.0)
    seed: int | None = _param(None)
    n: int = _param(1, _ANY)  # each sample draws on its own once the prompt forked
    num_beams: int = _param(1)
    length_penalty: float = _param(1.0, _ANY)  # beams only
    stop: list[str] = _param(draw=_ANY, default_factory=list)  # the detokenizing side's
    stop_token_ids: list[int] = _param(draw=_ANY, default_factory=list)
    min_tokens: int = _param(0)
    ignore_eos: bool = _param(False, _ANY)
    logit_bias: dict[int, float] = _param(default_factory=dict)
    logprobs: bool = _param(False)
    top_logprobs: int = _param(0, _ANY)  # read only with logprobs
    skip_special_tokens: bool = _param(True, _ANY)
    include_stop_str_in_output: bool = _param(False, _ANY)

    def __post_init__(self) -> None:
        self._take_numbers()
        if self.top_k == -1:
            self.top_k = 0
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            (
                "temperature",
                math.isfinite(self.temperature) and self.temperature >= 0,
                "must be a finite number >= 0",
            ),
            ("top_k", self.top_k >= 0, "must be >= 0 (or -1 to disable)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be a finite number > 0",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("num_beams", self.num_beams >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be in [0, 20]"),
            ("length_penalty", math.isfinite(self.length_penalty), "must be finite"),
            (
                "seed",
                self.seed is None or -(2**63) <= self.seed < 2**64,
                "must be in [-2^63, 2^64) (the wire's integers)",
            ),
            (
                "logit_bias",
                all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()),
                f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if not all(isinstance(s, str) and s for s in self.stop):  # vLLM refuses them too
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be <= the maximum of new tokens, got "
                f"{self.min_tokens} > {self.max_new_tokens}"
            )
        if self.num_beams > 1 and self.n > self.num_beams:
            raise ValueError(f"n must be <= num_beams for beam search, got n={self.n}")
        if self.num_beams > 1 and (
            self.presence_penalty or self.frequency_penalty or self.logit_bias
        ):
            raise ValueError(
                "presence_penalty, frequency_penalty and logit_bias do not apply to "
                "beam search (repetition_penalty does, as in transformers)"
            )
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        # beyond these the sampler's float32 arithmetic overflows to NaN
        self.temperature = min(self.temperature, MAX_SCALE)
        self.repetition_penalty = min(max(self.repetition_penalty, 1 / MAX_SCALE), MAX_SCALE)

    def _take_numbers(self) -> None:
        """Each number field as a Python number of its type; a ValueError naming a field that
        holds no such number."""
        for name in (
            "max_new_tokens",
            "top_k",
            "n",
            "num_beams",
            "min_tokens",
            "top_logprobs",
            "seed",
        ):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            setattr(self, name, int(value))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "length_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            try:
                setattr(self, name, float(value))
            except OverflowError:
                raise ValueError(f"{name} is beyond float's range, got {value!r}") from None
        bias, stop_ids = self.logit_bias or {}, self.stop_token_ids or []
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        bad = [t for t in [*bias, *stop_ids] if not is_integer(t)]
        if bad:
            raise ValueError(
                f"logit_bias keys and stop_token_ids must be token ids (integers), got {bad[:3]}"
            )
        if not all(map(_finite_number, bias.values())):
            raise ValueError(
                f"logit_bias values must be finite numbers, got {list(bias.values())[:5]}"
            )
        self.logit_bias = {int(k): float(v) for k, v in bias.items()}
        self.stop_token_ids = [int(t) for t in stop_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def ends_on(self, token: int, eos_token_ids) -> bool:
        """token ends a sequence of this request: a stop token id, or one of the model's EOS
        ids unless ignore_eos."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    def hides_last(self, token_ids: list[int], eos_token_ids) -> bool:
        """The last of token_ids ends the sequence and its text is left out, as vLLM does."""
        return (
            bool(token_ids)
            and not self.include_stop_str_in_output
            and self.ends_on(token_ids[-1], eos_token_ids)
        )

    @property
    def batch_draw(self) -> BatchDraw:
        """The first fast draw that every field with a non-default value tolerates (GREEDY
        only for a greedy request), else GENERAL."""
        changed = [draw for name, default, draw in _DRAW_FIELDS if getattr(self, name) != default]
        for candidate in FAST_DRAWS:
            if candidate is BatchDraw.GREEDY and not self.greedy:
                continue
            if all(candidate in draw for draw in changed):
                return candidate
        return BatchDraw.GENERAL

    def to_dict(self) -> dict:
        d = asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        bias = d.get("logit_bias") or {}
        try:  # msgpack maps take string keys: to_dict wrote the token ids so
            d = {
                **d,
                "logit_bias": {int(k) if isinstance(k, str) else k: v for k, v in bias.items()},
            }
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {list(bias)[:3]}") from None
        return cls(**d)


def _draw_fields() -> tuple[tuple[str, object, frozenset[BatchDraw]], ...]:
    """(name, default, tolerated fast draws) per field; one without `draw` fails at import."""
    out = []
    for f in fields(SamplingParams):
        if "draw" not in f.metadata:
            raise TypeError(f"SamplingParams.{f.name} has no draw metadata (see BatchDraw)")
        default = f.default_factory() if f.default is MISSING else f.default
        out.append((f.name, default, f.metadata["draw"]))
    return tuple(out)


_DRAW_FIELDS = _draw_fields()
