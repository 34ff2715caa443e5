"""Per-request sampling parameters. Pure Python (no torch): the API process imports it too."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields

# a temperature below this samples greedily, as vLLM's (1/T would overflow the logits)
GREEDY_TEMPERATURE = 1e-5
MAX_SCALE = 1e30  # temperature and repetition_penalty are clamped to [1e-30, 1e30]
MAX_LOGIT_BIAS = 100.0  # OpenAI's documented range for logit_bias values: [-100, 100]
# fields a model's generation_config.json may give defaults for, with their types (vLLM's
# list; do_sample is ignored, as vLLM ignores it: top_k 1 or temperature 0 is greedy)
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


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    num_beams: int = 1
    length_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # honoured by the detokenizing side
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
        # beyond these the sampler's float32 arithmetic overflows (inf / inf is NaN, and an
        # all-NaN row samples token 0); within them the draws are already those of the limit
        self.temperature = min(self.temperature, MAX_SCALE)
        self.repetition_penalty = min(max(self.repetition_penalty, 1 / MAX_SCALE), MAX_SCALE)

    def _take_numbers(self) -> None:
        """Each number field as a Python number of its type (numpy scalars are welcome: the
        wire carries Python numbers only); a ValueError naming a field that holds no such
        number. None for logit_bias or stop_token_ids is none (as vLLM)."""
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
        """The last of token_ids ends the sequence and its text is left out of the output
        (unless include_stop_str_in_output), as vLLM writes a stop token's and an EOS's."""
        return (
            bool(token_ids)
            and not self.include_stop_str_in_output
            and self.ends_on(token_ids[-1], eos_token_ids)
        )

    @property
    def temperature_only(self) -> bool:
        """Sampled with a temperature alone: no top-k, top-p or min-p filter."""
        return self.temperature > 0 and self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0

    @property
    def batch_draw(self) -> str:
        """How a batch draw samples it (Request.batch_draw): "greedy", "temperature" (alone),
        "plain" (temperature with top-k / top-p / min-p), or "" (it needs a SampleRow)."""
        if self.num_beams > 1 or not self.plain:
            return ""
        if self.greedy:
            return "greedy"
        return "temperature" if self.temperature_only else "plain"

    @property
    def plain(self) -> bool:
        """Only temperature, top-k, top-p and min-p shape the choice: no logit processors
        (bias, penalties, min_tokens), no logprobs, no seed (Sampler.sample_plain)."""
        return (
            not self.logprobs
            and not self.logit_bias
            and self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.min_tokens
            and self.seed is None
        )

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
