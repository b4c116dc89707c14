"""``python -m kvcanary_jax tiny-model DIR --size tiny|1b|8b``: the config each size writes (8b is Llama-3-8B's
shape), weights only for ``tiny``, and the default output unchanged."""

from __future__ import annotations

import json

import pytest

from kvcanary_jax import __main__ as cli_main
from kvcanary_jax.integrations import tiny_llama, tiny_models


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_default_config_is_the_tiny_llama(tmp_path):
    assert _config(tiny_llama.write_config(tmp_path)) == tiny_llama.TINY_LLAMA
    assert _config(tiny_llama.write_config(tmp_path / "kv2", kv_heads=2))["num_key_value_heads"] == 2


def test_8b_config_is_llama3_8b_shaped(tmp_path):
    c = _config(tiny_llama.write_config(tmp_path, size="8b"))
    assert {k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "intermediate_size", "vocab_size", "head_dim")} == {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "head_dim": 128}  # fmt: skip
    assert c["architectures"] == ["LlamaForCausalLM"]


def test_1b_config_and_bad_size(tmp_path):
    c = _config(tiny_llama.write_config(tmp_path, size="1b"))
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]) == (2048, 16, 8, 128)
    with pytest.raises(ValueError, match="size must be one of"):
        tiny_llama.write_config(tmp_path, size="70b")


def test_cli_size_flag_writes_config_and_tokenizer_but_no_weights(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    assert cli_main.main(["tiny-model", str(tmp_path / "big"), "--size", "1b"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "big")
    assert _config(tmp_path / "big")["hidden_size"] == 2048
    assert (tmp_path / "big" / "tokenizer.json").exists() and not (tmp_path / "big" / "model.safetensors").exists()
    assert cli_main.main(["tiny-model", str(tmp_path / "tiny")]) == 0
    assert _config(tmp_path / "tiny") == tiny_llama.TINY_LLAMA
    assert (tmp_path / "tiny" / "model.safetensors").exists()


def test_arch_flag_names_the_families_and_refuses_a_size_outside_llama(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["tiny-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert exit_info.value.code == 2
    assert "arch must be one of llama" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    for arch in set(tiny_models.ARCHS) - {"llama"}:
        with pytest.raises(ValueError, match=f"--size 1b is a Llama shape; it takes --arch llama, got --arch {arch}"):
            tiny_models.write_arch(tmp_path / arch, arch=arch, size="1b")


@pytest.mark.parametrize("draft, arch", [("standalone", "LlamaForCausalLM"), ("eagle3", "LlamaForCausalLMEagle3"),
                                         ("dflash", "DFlashDraftModel")])  # fmt: skip
def test_draft_configs_share_the_tiny_vocabulary_with_one_layer(tmp_path, draft, arch):
    c = _config(tiny_llama.write_config(tmp_path, draft=draft))
    assert c["architectures"] == [arch] and c["num_hidden_layers"] == 1
    assert (c["vocab_size"], c["hidden_size"], c["head_dim"]) == (512, 256, 128)  # the target's: shared embeddings
    with pytest.raises(ValueError, match="draft must be one of standalone, eagle3, dflash, for size 'tiny'"):
        tiny_llama.write_config(tmp_path, draft=draft, size="1b")
    with pytest.raises(ValueError, match="draft must be one of"):
        tiny_llama.write_config(tmp_path, draft="medusa")


def test_cli_draft_flag_writes_weights_for_the_standalone_draft_only(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    safetensors = pytest.importorskip("safetensors.numpy")
    assert cli_main.main(["tiny-model", str(tmp_path / "s"), "--draft", "standalone"]) == 0
    weights = safetensors.load_file(str(tmp_path / "s" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "model.layers.1.mlp.up_proj.weight" not in weights
    assert cli_main.main(["tiny-model", str(tmp_path / "e"), "--draft", "eagle3"]) == 0
    assert _config(tmp_path / "e")["draft_vocab_size"] is None and not (tmp_path / "e" / "model.safetensors").exists()
    assert (tmp_path / "e" / "tokenizer.json").exists()
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["tiny-model", str(tmp_path / "x"), "--draft", "eagle3", "--size", "1b"])
    assert exit_info.value.code == 2
    assert "--draft writes a draft for the tiny Llama: drop --size and --arch" in capsys.readouterr().err
