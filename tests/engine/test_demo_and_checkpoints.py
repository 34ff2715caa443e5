"""The embedded demo checkpoint (model/demo.py) and the tiny-checkpoint helpers
(tests/helpers/checkpoints.py), checked against transformers itself."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tapserve.model.demo import (
    DEMO_VOCAB_SIZE,
    DemoHead,
    default_cache_dir,
    ensure_demo_checkpoint,
    qwen3_tensor_shapes,
)
from tests.helpers.checkpoints import (
    ARCHS,
    make_tiny_checkpoint,
    make_tiny_tokenizer,
    to_transformers4_format,
    to_transformers5_format,
)

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("cache") / "demo")


@pytest.fixture(scope="module")
def demo_tokenizer(demo_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_demo_tokenizer_special_tokens(demo_tokenizer) -> None:
    assert len(demo_tokenizer) == DEMO_VOCAB_SIZE
    ids = demo_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [1021, 1022, 1023]
    assert demo_tokenizer.eos_token == "<|im_end|>" and demo_tokenizer.eos_token_id == 1023
    assert demo_tokenizer.pad_token == "<|endoftext|>" and demo_tokenizer.pad_token_id == 1021
    assert demo_tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1022


@pytest.mark.parametrize(
    "text",
    [
        "héllo 世界 🙂",
        "The quick brown fox.",
        "  two  spaces\n\ttab\r\n",
        "naïve café ¿qué? Ωμέγα",
        "\x00\x7f end",
    ],
)
def test_demo_tokenizer_roundtrip_byte_exact(demo_tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < 1021 for i in ids)
    assert demo_tokenizer.decode(ids) == text


def test_demo_tokenizer_is_really_trained(demo_tokenizer) -> None:
    text = "The user asked the assistant a question about the lighthouse."
    assert len(demo_tokenizer.encode(text, add_special_tokens=False)) < len(text) // 3


def test_demo_chat_template(demo_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
    text = demo_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = demo_tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert plain == "<|im_start|>user\nHi!<|im_end|>\n"


def test_demo_config_files(demo_dir: Path) -> None:
    config = _read_json(demo_dir / "config.json")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == DEMO_VOCAB_SIZE and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["eos_token_id"] == 1023
    assert _read_json(demo_dir / "generation_config.json")["eos_token_id"] == [1023, 1021]
    assert _read_json(demo_dir / "tokenizer_config.json")["chat_template"].startswith("{%")


def test_demo_model_loads_in_transformers(demo_dir: Path, demo_tokenizer) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
    stored = load_file(str(demo_dir / "model.safetensors"))
    expected = set(model.state_dict()) - {"lm_head.weight"}
    assert set(stored) == expected | {"demo_head.weight", "demo_head.bias"}
    for name in expected:
        assert torch.equal(model.state_dict()[name], stored[name]), name
    ids = torch.tensor([demo_tokenizer.encode("Once upon a time there was")])
    other = ids.clone()
    other[0, 0] = 5
    with torch.no_grad():
        a, b = model(ids).logits[0, -1], model(other).logits[0, -1]
    assert a.shape == (DEMO_VOCAB_SIZE,) and torch.isfinite(a).all()
    assert not torch.allclose(a, b)  # attention carries context


def test_demo_tensor_names_match_transformers(demo_dir: Path) -> None:
    config = _read_json(demo_dir / "config.json")
    hf_config = transformers.Qwen3Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )
    shapes = {
        n: tuple(t.shape)
        for n, t in transformers.Qwen3ForCausalLM(hf_config).state_dict().items()
        if n != "lm_head.weight"
    }
    assert shapes == qwen3_tensor_shapes(config)


def test_demo_head_tensors_and_handler(demo_dir: Path) -> None:
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in DemoHead().weight_names()}
    assert tensors["demo_head.weight"].shape == (2, 64)
    assert tensors["demo_head.bias"].shape == (2,)
    head = DemoHead()
    head.load_weights(tensors)
    out = head.forward(torch.randn(3, 64, dtype=torch.bfloat16))
    assert out.shape == (3, 2) and out.dtype == torch.float32
    assert head.select_token_position([5, 6, 7], None) == 2
    assert head.select_token_position([5, 6, 7], {"position": 0}) == 0
    assert head.select_token_position([5, 6, 7], {"other": 1}) == 2
    for bad in ("1", 1.0, True, None):
        with pytest.raises(ValueError):
            head.select_token_position([5, 6, 7], {"position": bad})


def test_demo_head_forward_requires_weights() -> None:
    with pytest.raises(RuntimeError):
        DemoHead().forward(torch.zeros(1, 64))


def test_demo_checkpoint_is_deterministic(tmp_path: Path, demo_dir: Path) -> None:
    fresh = ensure_demo_checkpoint(tmp_path / "again")
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    for name in names:
        assert (demo_dir / name).read_bytes() == (fresh / name).read_bytes(), name


def test_ensure_demo_checkpoint_concurrent_and_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_demo_checkpoint(target)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3
    assert ensure_demo_checkpoint(target) == target
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]  # no temp dirs left


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TAPSERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "demo-v1"
    monkeypatch.delenv("TAPSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "tapserve" / "demo-v1"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    assert not (path / "tokenizer.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    stored = load_file(str(path / "model.safetensors"))
    for name, tensor in stored.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    config = _read_json(path / "config.json")
    assert config["vocab_size"] == 512 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is (arch == "qwen3")
    assert ("lm_head.weight" in stored) is (arch != "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in stored) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in stored) is (arch == "qwen3")
    assert _read_json(path / "generation_config.json")["eos_token_id"] == [2, 3]
    if arch == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"


def test_tiny_checkpoint_overrides_and_determinism(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(
        tmp_path / "a", "llama", num_key_value_heads=1, tie_word_embeddings=True
    )
    b = make_tiny_checkpoint(
        tmp_path / "b", "llama", num_key_value_heads=1, tie_word_embeddings=True
    )
    config = _read_json(a / "config.json")
    assert config["num_key_value_heads"] == 1 and config["tie_word_embeddings"] is True
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_tiny_checkpoint_sharded_with_extra_tensors(tmp_path: Path) -> None:
    extra = {"head.weight": torch.arange(128.0).reshape(2, 64), "head.bias": torch.ones(2)}
    path = make_tiny_checkpoint(tmp_path / "sh", "qwen3", sharded=True, extra_tensors=extra)
    index = _read_json(path / "model.safetensors.index.json")
    assert not (path / "model.safetensors").exists()
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((path / s).exists() for s in shards)
    with safe_open(str(path / index["weight_map"]["head.weight"]), framework="pt") as f:
        assert torch.equal(f.get_tensor("head.weight"), extra["head.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    assert "head.weight" not in model.state_dict()


def test_tiny_checkpoint_unsharded_extra_tensors(tmp_path: Path) -> None:
    extra = {"head.weight": torch.full((1, 64), 0.5, dtype=torch.bfloat16)}
    path = make_tiny_checkpoint(tmp_path / "x", "qwen2", extra_tensors=extra)
    stored = load_file(str(path / "model.safetensors"))
    assert stored["head.weight"].dtype == torch.bfloat16
    assert "model.embed_tokens.weight" in stored
    with pytest.raises(ValueError):
        make_tiny_checkpoint(
            tmp_path / "y", "qwen2", extra_tensors={"model.norm.weight": torch.ones(64)}
        )


def test_transformers_format_conversion(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    original = _read_json(path / "config.json")
    to_transformers4_format(path)
    v4 = _read_json(path / "config.json")
    assert "rope_parameters" not in v4 and "dtype" not in v4
    assert v4["rope_theta"] == 500000.0 and v4["torch_dtype"] == "float32"
    assert v4["rope_scaling"]["rope_type"] == "llama3" and "rope_theta" not in v4["rope_scaling"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    assert model.config.rope_parameters == original["rope_parameters"]
    to_transformers5_format(path)
    assert _read_json(path / "config.json") == original


def test_transformers4_format_default_rope(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "q", "qwen3")
    v4 = _read_json(to_transformers4_format(path))
    assert v4["rope_theta"] == 1000000.0 and v4["rope_scaling"] is None
    assert "rope_parameters" not in v4


def test_tiny_tokenizer(tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = make_tiny_checkpoint(tmp_path / "small", "qwen3")
    with pytest.raises(ValueError):
        make_tiny_tokenizer(small, demo_dir)
    path = make_tiny_checkpoint(tmp_path / "tok", "llama", vocab_size=DEMO_VOCAB_SIZE)
    make_tiny_tokenizer(path, demo_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert tok.decode(tok.encode("héllo 世界 🙂", add_special_tokens=False)) == "héllo 世界 🙂"
    assert _read_json(path / "config.json")["eos_token_id"] == 1023
    assert _read_json(path / "generation_config.json")["eos_token_id"] == [1023, 1021]
    monkeypatch.setenv("TAPSERVE_CACHE", str(tmp_path / "cache"))
    auto = make_tiny_checkpoint(tmp_path / "auto", "qwen2", tokenizer=True)
    assert _read_json(auto / "config.json")["vocab_size"] == DEMO_VOCAB_SIZE
    assert (auto / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()
