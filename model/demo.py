"""The embedded demo checkpoint and its demo custom-output head.

`ensure_demo_checkpoint()` returns a folder holding a complete, tiny Hugging Face
checkpoint of the Qwen3 architecture (what `launch.py` serves when `--model` is
absent). It is written on first use, deterministically (byte-identical files on
every machine with the same torch/tokenizers), in well under five seconds:

- a real byte-level BPE tokenizer, trained here on an embedded English corpus
  (1024 tokens: 1021 learned + `<|endoftext|>`=1021, `<|im_start|>`=1022,
  `<|im_end|>`=1023), with a ChatML chat template like Qwen's;
- `config.json` (Qwen3ForCausalLM, hidden 64, 2 layers, 4 heads, 2 KV heads,
  head_dim 16, tied embeddings, float32) in the transformers-5 style plus a
  top-level `rope_theta` so transformers 4 reads the same RoPE;
- `model.safetensors`: seeded weights built with plain torch (no transformers
  import: it costs ~6 s and its init scheme changes between versions), with
  exactly the tensor names `transformers.Qwen3ForCausalLM` saves, plus
  `demo_head.weight` [2, 64] and `demo_head.bias` [2] for `DemoHead`; model
  loaders must ignore those two.

Weights use `spread_init`, not transformers' N(0, 0.02): every sub-layer then
moves the residual stream, so attention / KV-cache bugs change greedy tokens.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from tapserve.model.custom_output import CustomOutputHandler

if TYPE_CHECKING:
    import tokenizers

DEMO_VERSION = "demo-v1"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEMO_VOCAB_SIZE = 1024
DEMO_HEAD_NAMES = ("demo_head.weight", "demo_head.bias")
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROSE = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a story.
Once upon a time there was a little town by the sea. Every morning the fishermen
went out in their boats, and every evening they came back with stories about the
weather, the waves and the birds that followed them home. The children of the town
liked to sit on the wall by the harbour and listen. One of them, a girl named Anna,
wanted to know how the lighthouse worked. She asked her father, who said that a
lamp turns inside a glass lens, and the light can be seen from far away at night.
The next day Anna walked up the hill to the lighthouse and knocked on the door.
An old keeper opened it and smiled. "Come in," he said, "and I will show you."
They climbed the stairs together, one hundred and twenty steps, counting each one.
At the top the wind was strong and the sky was very blue. The keeper explained
that ships use the light to find their way, and that each lighthouse has its own
pattern of flashes, so sailors know which one they are looking at.
Computers work in a similar way: they follow simple rules, one step at a time,
very quickly. A program reads some input, does a computation, and writes an output.
A language model reads a sequence of tokens and predicts the next token. It repeats
this process to generate text, one token after another, until it reaches the end.
Questions and answers: What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. How many days are in a week? Seven.
The user asked the assistant for help, and the assistant answered the question.
The system message tells the assistant how to behave: be helpful, honest and kind.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 42, 100, 1000 and 2024 appear
in many documents, together with dates, prices, times and measurements.
In the garden there were roses, tulips and apple trees. The cat slept in the sun
while the dog chased a ball across the grass. Later it started to rain, and
everyone went inside for tea, bread and cheese. The café served croissants and a
naïve little cake, and the rain made a soft sound on the roof for the whole afternoon.
Science helps us understand the world. Water boils at one hundred degrees and
freezes at zero. The earth goes around the sun once every year, and the moon goes
around the earth about once every month. Light travels faster than sound, which is
why we see lightning before we hear the thunder.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
"""

_EXTRA_WORDS = (
    "model server request response token tokens prompt batch cache memory value "
    "score reward head hidden state layer attention query key engine stream chunk "
    "length position index sample greedy temperature probability output input "
    "hello world thank you please good morning evening yes no maybe today tomorrow"
)


def corpus_lines() -> list[str]:
    """The tokenizer training corpus: embedded prose plus seeded generated sentences."""
    lines = _PROSE.splitlines()
    words = sorted(set(_PROSE.replace("\n", " ").split()) | set(_EXTRA_WORDS.split()))
    rng = random.Random(0)
    for _ in range(400):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        lines.append(sentence[:1].upper() + sentence[1:] + rng.choice((".", "?", "!", ",")))
    return lines


def train_tokenizer() -> tokenizers.Tokenizer:
    """Train the demo byte-level BPE: 1021 learned tokens, then the 3 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != DEMO_VOCAB_SIZE:
        raise RuntimeError(
            f"demo tokenizer has {tok.get_vocab_size()} tokens, expected {DEMO_VOCAB_SIZE}"
        )
    return tok


def tokenizer_config_dict(ids: dict[str, int]) -> dict:
    """tokenizer_config.json content (loads in transformers 4 and 5)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def model_config_dict(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """config.json content: tiny Qwen3, transformers-5 fields + top-level rope_theta."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }


def spread_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Seeded float32 init by tensor name: norms 1+0.1·N, biases 0.1·N, embeddings
    0.25·N, o_proj/down_proj 2·N/sqrt(fan_in), other matrices N/sqrt(fan_in).
    Deterministic for a generator state. (Chosen so greedy output varies with the
    context and top-1/top-2 logit gaps stay well above float32 noise.)"""
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.1 * noise
    if "embed_tokens" in name:
        return 0.25 * noise
    gain = 2.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return gain * noise / float(shape[-1]) ** 0.5


def qwen3_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes exactly as transformers' Qwen3ForCausalLM saves them."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def build_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors: the model (seed 0) and the demo head (seed 1)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {n: spread_init(n, s, gen) for n, s in qwen3_tensor_shapes(cfg).items()}
    head_gen = torch.Generator().manual_seed(1)
    hidden = cfg["hidden_size"]
    tensors["demo_head.weight"] = spread_init("demo_head.weight", (2, hidden), head_gen)
    tensors["demo_head.bias"] = spread_init("demo_head.bias", (2,), head_gen)
    return tensors


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(folder: Path) -> None:
    """Write every demo file into an existing (empty) folder."""
    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    _write_json(folder / "tokenizer_config.json", tokenizer_config_dict(ids))
    _write_json(
        folder / "special_tokens_map.json",
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    cfg = model_config_dict(tok.get_vocab_size(), ids["<|im_end|>"], ids["<|endoftext|>"])
    _write_json(folder / "config.json", cfg)
    _write_json(
        folder / "generation_config.json",
        {
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "bos_token_id": None,
        },
    )
    save_file(build_weights(cfg), str(folder / "model.safetensors"), metadata={"format": "pt"})


def default_cache_dir() -> Path:
    """`$TAPSERVE_CACHE/demo-v1` if TAPSERVE_CACHE is set, else ~/.cache/tapserve/demo-v1."""
    root = os.environ.get("TAPSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "tapserve"
    return base / DEMO_VERSION


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def ensure_demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the folder holding the demo checkpoint, writing it on first use.

    `cache_dir` is the checkpoint folder itself (default: `default_cache_dir()`).
    Files are written into a sibling temp dir that is then renamed into place,
    so concurrent processes never see a partial checkpoint; the loser of a race
    discards its copy. An existing non-empty folder lacking the files is an error.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_demo_checkpoint(tmp)
        os.rename(tmp, target)  # atomic; fails if target exists and is not empty
    except OSError:
        if not _is_complete(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class DemoHead(CustomOutputHandler):
    """Demo custom-output handler: a 2-way linear "reward/classifier" head.

    Selects `params["position"]` (an int, or a list: prompt positions plus -2 or -3 for the
    generated tokens) when given, else the last prompt token;
    its weights are `demo_head.weight` / `demo_head.bias` from the demo checkpoint.
    """

    # its two columns, named as transformers names an unnamed classifier's (id2label)
    labels = ("LABEL_0", "LABEL_1")

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def weight_names(self) -> list[str]:
        """Tensor names to fetch from the checkpoint."""
        return list(DEMO_HEAD_NAMES)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the head's tensors (on the model's device, stored dtype)."""
        self.weight = tensors["demo_head.weight"]
        self.bias = tensors["demo_head.bias"]

    def forward(self, selected_hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, 2] float32."""
        if self.weight is None or self.bias is None:
            raise RuntimeError("DemoHead.forward called before load_weights")
        return torch.nn.functional.linear(
            selected_hidden_states.float(), self.weight.float(), self.bias.float()
        )
