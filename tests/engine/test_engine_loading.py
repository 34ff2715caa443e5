"""Checkpoint loading: the transformers 5 and transformers 4 config formats, sharded
checkpoints, unused tensors, EOS ids from generation_config.json, and clear errors for a
missing or mis-shaped tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tapserve.api.sampling_params import SamplingParams
from tapserve.model.config import ModelConfig
from tests.helpers.checkpoints import make_tiny_checkpoint, to_transformers4_format
from tests.helpers.engine import (
    greedy,
    hf_greedy,
    hf_model,
    make_llm,
    random_prompts,
    run,
    token_ids,
)

VOCAB = 512
NEW = 32


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([1, 12, 33], VOCAB, seed=41)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def v5_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"{request.param}-v5"), request.param)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_transformers5_and_4_formats_load_alike(v5_ckpt, tmp_path, prompts) -> None:
    v5 = read_config(v5_ckpt)
    assert "rope_parameters" in v5 and "rope_theta" not in v5 and "dtype" in v5
    v4_ckpt = copy_checkpoint(v5_ckpt, tmp_path / "v4")
    to_transformers4_format(v4_ckpt)
    v4 = read_config(v4_ckpt)
    assert "rope_parameters" not in v4 and "rope_theta" in v4 and "torch_dtype" in v4
    cfg5, cfg4 = ModelConfig.from_dir(v5_ckpt), ModelConfig.from_dir(v4_ckpt)
    assert cfg4 == cfg5
    if cfg5.architecture == "llama":
        assert cfg5.rope_scaling["rope_type"] == "llama3" and cfg5.rope_theta == 500000.0
    else:
        assert cfg5.rope_scaling is None and cfg5.rope_theta == 1000000.0
    tokens5 = token_ids(run(make_llm(v5_ckpt), prompts, greedy(NEW)))
    tokens4 = token_ids(run(make_llm(v4_ckpt), prompts, greedy(NEW)))
    assert tokens4 == tokens5 == hf_greedy(hf_model(v5_ckpt), prompts, NEW)


def test_transformers4_legacy_rope_scaling_type_key(tmp_path, prompts) -> None:
    """Old Llama-3 configs spell the scaling kind `type`, not `rope_type`."""
    src = make_tiny_checkpoint(tmp_path / "v5", "llama")
    old = copy_checkpoint(src, tmp_path / "old")
    to_transformers4_format(old)
    config = read_config(old)
    config["rope_scaling"]["type"] = config["rope_scaling"].pop("rope_type")
    (old / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(old).rope_scaling["type"] == "llama3"
    assert token_ids(run(make_llm(old), prompts, greedy(NEW))) == token_ids(
        run(make_llm(src), prompts, greedy(NEW))
    )


def test_sharded_checkpoint_loads(tmp_path, prompts) -> None:
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen3", sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = make_tiny_checkpoint(tmp_path / "single", "qwen3")
    got = token_ids(run(make_llm(sharded), prompts, greedy(NEW)))
    assert got == token_ids(run(make_llm(single), prompts, greedy(NEW)))
    assert got == hf_greedy(hf_model(sharded), prompts, NEW)


def test_unused_tensors_are_ignored(tmp_path, prompts) -> None:
    extra = {"score.weight": torch.randn(3, 64), "value_head.bias": torch.randn(1)}
    with_extra = make_tiny_checkpoint(tmp_path / "extra", "qwen2", extra_tensors=extra)
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen2")
    assert token_ids(run(make_llm(with_extra), prompts, greedy(NEW))) == token_ids(
        run(make_llm(plain), prompts, greedy(NEW))
    )


def test_eos_ids_of_generation_config_stop(tmp_path, prompts) -> None:
    """Every EOS id of config.json and generation_config.json stops generation, where
    transformers (which reads the same files) stops too."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    free = token_ids(run(make_llm(src), prompts, greedy(NEW)))
    i, k = next((i, k) for i, t in enumerate(free) for k in range(3, NEW) if t[k] not in t[:k])
    eos = free[i][k]
    ckpt = copy_checkpoint(src, tmp_path / "eos")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"][0], eos]
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    assert eos in ModelConfig.from_dir(ckpt).eos_token_ids
    results = run(make_llm(ckpt), prompts, SamplingParams(max_new_tokens=NEW, temperature=0))
    assert results[i].outputs[0].token_ids == free[i][: k + 1]
    assert results[i].outputs[0].finish_reason == "stop"
    reference = hf_model(ckpt, disable_eos=False)
    for r, prompt in zip(results, prompts):
        ref = hf_greedy(reference, [prompt], NEW)[0]
        assert r.outputs[0].token_ids == ref


def test_checkpoint_without_tokenizer(tmp_path) -> None:
    """Token-id prompts work; a text prompt is refused clearly, not tokenized to nothing."""
    llm = make_llm(make_tiny_checkpoint(tmp_path / "c", "qwen3"))
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], greedy(4))
    assert len(run(llm, [[5, 6, 7]], greedy(4))[0].outputs[0].token_ids) == 4


# ---- broken checkpoints --------------------------------------------------------------------
def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("good"), "qwen2")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_is_named(good_ckpt, tmp_path, name) -> None:
    ckpt = copy_checkpoint(good_ckpt, tmp_path / "broken")
    edit_tensors(ckpt, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        make_llm(ckpt)
    assert name in str(info.value)


MISSHAPEN = [
    ("model.layers.1.self_attn.v_proj.weight", "fewer columns"),
    ("model.layers.0.mlp.down_proj.weight", "fewer columns"),
    ("model.embed_tokens.weight", "fewer columns"),
    ("model.layers.0.self_attn.k_proj.weight", "extra row"),
    ("model.layers.1.mlp.gate_proj.weight", "extra row"),
    ("model.layers.0.self_attn.o_proj.weight", "extra column"),
    ("model.layers.1.self_attn.q_proj.bias", "extra row"),
    ("model.layers.1.post_attention_layernorm.weight", "extra row"),
]


@pytest.mark.parametrize("name,change", MISSHAPEN, ids=[f"{n}-{c}" for n, c in MISSHAPEN])
def test_misshaped_tensor_is_named(good_ckpt, tmp_path, name, change) -> None:
    """Too small or too large (a larger tensor must not be silently cut to size)."""
    ckpt = copy_checkpoint(good_ckpt, tmp_path / "broken")

    def reshape(t):
        w = t[name]
        if change == "fewer columns":
            t[name] = w[:, :-1].contiguous()
        elif change == "extra row":
            t[name] = torch.cat([w, w[:1]]).contiguous()
        else:
            t[name] = torch.cat([w, w[:, :1]], dim=1).contiguous()

    edit_tensors(ckpt, reshape)
    with pytest.raises(ValueError) as info:
        make_llm(ckpt)
    assert name in str(info.value) and "shape" in str(info.value)


def test_misshaped_tensor_in_a_sharded_checkpoint_is_named(tmp_path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "sharded", "llama", sharded=True)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.gate_proj.weight"
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.zeros(7, 64)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        make_llm(ckpt)
    assert name in str(info.value) and "shape" in str(info.value)


@pytest.mark.parametrize(
    "arch,config",
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"attention_bias": True})],
)
def test_attention_and_mlp_biases_as_transformers(tmp_path, prompts, arch, config) -> None:
    """attention_bias puts a bias on o_proj too (Llama, Qwen3; not Qwen2), and Llama's
    mlp_bias on gate/up/down; they were dropped as unused tensors, with wrong tokens."""
    ckpt = make_tiny_checkpoint(tmp_path / arch, arch, **config)
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.o_proj_bias and cfg.mlp_bias == (arch == "llama")
    assert token_ids(run(make_llm(ckpt), prompts, greedy(NEW))) == hf_greedy(
        hf_model(ckpt), prompts, NEW
    )


def test_unsupported_layer_tensors_and_activations_are_refused(tmp_path) -> None:
    """A tensor of a layer's attention or MLP the model has no parameter for means computation
    tapserve would skip: refused, as is an MLP activation other than SiLU."""
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen2")
    tensors = load_file(plain / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.randn(64)
    save_file(tensors, plain / "model.safetensors")
    with pytest.raises(ValueError, match="o_proj.bias is part of a layer's attention"):
        make_llm(plain)
    gelu = make_tiny_checkpoint(tmp_path / "gelu", "llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dir(gelu)
    swish = make_tiny_checkpoint(tmp_path / "swish", "llama", hidden_act="swish")
    assert ModelConfig.from_dir(swish).architecture == "llama"  # transformers' SiLU too


def test_layers_past_the_configs_count_are_ignored(tmp_path, prompts) -> None:
    """A checkpoint holding more layers than config.json declares loads the declared ones,
    as transformers does (not refused as a layer tensor without a parameter)."""
    two = make_tiny_checkpoint(tmp_path / "two", "qwen3")
    config = read_config(two)
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)
    (two / "config.json").write_text(json.dumps(config))
    assert token_ids(run(make_llm(two), prompts, greedy(NEW))) == hf_greedy(
        hf_model(two), prompts, NEW
    )


def _transformers_config(arch: str, **kwargs) -> dict:
    """config.json as transformers writes it (save_pretrained's dict) for a tiny model."""
    from transformers import Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    config = cls(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **kwargs,
    )
    return {**config.to_dict(), "architectures": [cls.__name__.replace("Config", "ForCausalLM")]}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("legacy", [False, True], ids=["layer_types", "use_sliding_window"])
def test_sliding_window_layers_are_refused_where_the_window_is_shorter(arch, legacy) -> None:
    """A config whose layers slide (as transformers reads it: layer_types, or in the legacy
    layout use_sliding_window from max_window_layers on) over a window shorter than the
    context is refused; it was served as full attention, its tokens wrong past the window.
    Windows that never bind, and Qwen2.5's use_sliding_window false, load."""
    cases = [
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), True),
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), True),
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), False),
        (dict(use_sliding_window=True, sliding_window=4096, max_window_layers=0), False),
        (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), False),
    ]
    for kwargs, refused in cases:
        raw = _transformers_config(arch, **kwargs)
        assert refused == (
            "sliding_attention" in raw["layer_types"] and 16 == raw["sliding_window"]
        )
        if legacy:
            raw.pop("layer_types")
        if refused:
            with pytest.raises(ValueError, match="sliding-window attention"):
                ModelConfig.from_dict(raw)
        else:
            assert ModelConfig.from_dict(raw).architecture == arch


def test_config_errors_are_value_errors_naming_the_field() -> None:
    """Errors the launcher reports in one line (it catches ValueError): a rope scaling that
    lacks a field (a KeyError from the rotary tables, a traceback), an unserved kind, a
    missing config field, and an MLP width the TP degree does not divide."""
    from tapserve.model.decoder import MLP
    from tapserve.model.layers import TPGroup

    raw = _transformers_config("qwen3")
    raw.pop("rope_parameters", None)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match="llama3 rope scaling lacks a number for low_freq_factor"):
        ModelConfig.from_dict({**raw, "rope_scaling": llama3})
    assert ModelConfig.from_dict(
        {**raw, "rope_scaling": {**llama3, "low_freq_factor": 1.0}}
    ).rope_scaling
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="lacks the field 'num_attention_heads'"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_attention_heads"})
    wrong = [
        ("rope_scaling", "linear", "rope_scaling must be an object"),
        ("rms_norm_eps", "x", "rms_norm_eps must be a finite positive number"),
        ("rope_theta", float("inf"), "rope_theta must be a finite positive number"),
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ]
    for field, value, message in wrong:  # ("false" was served as tied: bool("false"))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict({**raw, field: value})
    assert ModelConfig.from_dict({**raw, "tie_word_embeddings": None}).tie_word_embeddings is False
    cfg = ModelConfig.from_dict({**raw, "intermediate_size": 97})
    with pytest.raises(ValueError, match=r"intermediate_size \(97\) is not divisible"):
        MLP(cfg, TPGroup(rank=0, size=2))
