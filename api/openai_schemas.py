"""Request schemas of the OpenAI-compatible endpoints (pydantic, unknown fields rejected).

OpenAI's fields, vLLM-style extras and tapserve's custom_output_params/_encoding; any other
field is a 400 naming it.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tapserve.api.errors import invalid
from tapserve.api.tokenizer import ChatTemplateError, TextTokenizer

# a logit_bias key: ASCII digits only (int() takes more), at most 19 (int() refuses over 4300)
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


class StrictModel(BaseModel):
    """A request body: no unknown fields, no coercion, as OpenAI; a null means the field's
    default (an unknown field's null is dropped), except where a field takes None."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or (k in fields and type(None) in get_args(fields[k].annotation))
        }


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored (no behaviour attached)
    # extras (vLLM style)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # tapserve
    custom_output_params: dict[str, Any] | None = None
    custom_output_encoding: Literal["json", "base64"] = "json"

    def sampling_kwargs(self, max_new_tokens: int) -> dict:
        """Keyword arguments for api.sampling_params.SamplingParams."""
        kw: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "n": self.n,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not _TOKEN_ID_KEY.fullmatch(k)]
            if bad:
                raise invalid(
                    f"logit_bias keys must be token ids (decimal digits), got {bad[:3]}",
                    "logit_bias",
                )
            kw["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's continuous_usage_stats, with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_unsupported(self) -> None:
        if self.echo:
            raise invalid("unsupported field 'echo' (echo=true is not supported)", "echo")
        if self.suffix:
            raise invalid("unsupported field 'suffix'", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("unsupported field 'best_of' (only best_of == n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise invalid("the prompt is empty", "prompt")
        if isinstance(p[0], int):  # (validated: the list's items are all of one kind)
            return [list(p)]
        return list(p)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to an assistant's call

    def template_dict(self, developer_as_system: bool = False) -> dict:
        """The message as the chat template sees it: text parts joined by newlines, as vLLM
        joins them; OpenAI's "developer" role as "system" if developer_as_system."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise invalid(
                        f"unsupported content part type {part.get('type')!r} (text only)",
                        "messages",
                    )
                try:
                    texts.append(TextPart(**part).text)
                except ValidationError as e:
                    problem = e.errors()[0]
                    where = ".".join(str(p) for p in problem.get("loc", ()))
                    raise invalid(
                        f"invalid text content part: {where}: {problem.get('msg')}", "messages"
                    ) from None
            content = "\n".join(texts)
        role = "system" if developer_as_system and self.role == "developer" else self.role
        out = {"role": role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:  # as vLLM, for templates that show it
            out["tool_call_id"] = self.tool_call_id
        return out


class ResponseFormat(StrictModel):
    type: Literal["text"]


class ChatTemplateFields(StrictModel):
    """How a request's messages become prompt text (vLLM's fields of these names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def render(self, tokenizer: TextTokenizer, messages: list[ChatMessage]) -> str:
        """The templated text; a 605 on "messages" when the template fails, and on
        add_generation_prompt set explicitly with continue_final_message (as vLLM)."""
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise invalid(
                "cannot set both continue_final_message and add_generation_prompt",
                "add_generation_prompt",
            )
        # a template that never names "developer" would drop such a message silently
        developer_as_system = "developer" not in (tokenizer.chat_template or "")
        try:
            return tokenizer.apply_chat_template(
                [m.template_dict(developer_as_system) for m in messages],
                self.add_generation_prompt and not self.continue_final_message,
                self.chat_template_kwargs,
                self.continue_final_message,
            )
        except ChatTemplateError as e:
            raise invalid(str(e), "messages") from None


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def max_tokens_param(self) -> str:
        """The field requested_max_tokens comes from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
