"""Checkpoint formats against their oracles: HF logits, the stories260K golden ids, gguf.quants,
HF's own GGUF loader, and export round trips; plus the errors that bad files get."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from scratchlm.model import CheckpointError, ModelConfig, TransformerLM, export_hf, load, save_model
from scratchlm.model.generate import generate
from scratchlm.model.loading import detect_format
from scratchlm.model.loading.checkpoint import save_torch_checkpoint
from scratchlm.model.loading.dequant import dequantize
from tests.model.helpers import hf_logits, tiny_llama, tiny_qwen2

STORIES = Path("models/stories260K")


@pytest.fixture(scope="module")
def stories(data_dir) -> Path:
    return data_dir / STORIES


# ---------------------------------------------------------------- stories260K (llama2.c and HF)


def test_stories260k_hf_dir_logits_equal_hf(stories):
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    loaded = load(stories / "hf")
    assert loaded.config.n_kv_heads == 4 and loaded.config.tie_embeddings
    with torch.no_grad():
        ours = loaded.model(tokens)
    torch.testing.assert_close(ours, hf_logits(stories / "hf", tokens), atol=1e-4, rtol=0)


def test_stories260k_bin_greedy_reproduces_golden_ids(stories):
    golden = json.loads((stories / "golden_greedy.json").read_text())
    loaded = load(stories / "stories260K.bin")
    c = loaded.config
    assert (c.d_model, c.d_ff, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len) == (
        64, 172, 5, 8, 4, 512, 512)
    assert c.rope_layout == "adjacent" and c.tie_embeddings
    prompt = golden["prompt_ids"]
    new = generate(loaded.model, prompt, len(golden["ids"]) - len(prompt))
    assert prompt + new == golden["ids"]  # all 257 ids
    assert len(golden["ids"]) == 257
    if loaded.tokenizer is not None:
        assert loaded.tokenizer.decode(new).strip() == golden["text"].strip()


def test_stories260k_bin_and_hf_dir_agree(stories):
    """The adjacent-RoPE llama2.c weights and the row-permuted HF weights compute the same function."""
    tokens = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = load(stories / "stories260K.bin").model(tokens)
        b = load(stories / "hf").model(tokens)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_stories260k_tokenizer_is_loaded_next_to_bin(stories):
    pytest.importorskip("scratchlm.tokenizer.llama2c")
    loaded = load(stories / "stories260K.bin")
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 512


# ---------------------------------------------------------------- GGUF


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
}


def write_gguf_from_hf(hf_dir: Path, out: Path, qtype: str, arch: str = "llama") -> dict[str, np.ndarray]:
    """Convert a tiny HF Llama to GGUF the way llama.cpp does (q/k rows permuted, 2-D weights quantized).

    Returns the HF-named weights as the GGUF file stores them after dequantization (gguf.quants oracle).
    """
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta")))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    q = gguf.GGMLQuantizationType[qtype]
    effective = {}
    for name, w in state.items():
        if name.startswith("model.layers."):
            _, _, i, local = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_LAYER[local]}"
        else:
            gname = _GGUF_NAMES[name]
        if "q_proj" in name:
            w = _permute_like_llama_cpp(w, cfg["num_attention_heads"])
        elif "k_proj" in name:
            w = _permute_like_llama_cpp(w, cfg["num_key_value_heads"])
        if w.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(w, q)
            writer.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=q)
            w = gguf.quants.dequantize(packed, q).reshape(w.shape)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
        if "q_proj" in name:  # undo the permutation for the oracle (inverse of permute)
            h = cfg["num_attention_heads"]
            w = w.reshape(h, w.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        elif "k_proj" in name:
            h = cfg["num_key_value_heads"]
            w = w.reshape(h, w.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        effective[name] = np.array(w, dtype=np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return effective


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1", "Q4_0"])
def test_gguf_llama_matches_hf_with_the_same_weights(tmp_path, qtype):
    hf_dir = tiny_llama(tmp_path / "hf", vocab=128)  # 2-D dims multiple of 32 for the block formats
    effective = write_gguf_from_hf(hf_dir, tmp_path / "m.gguf", qtype)
    # oracle: the HF model carrying exactly the dequantized weights the GGUF file stores
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    (oracle_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({k: torch.from_numpy(v) for k, v in effective.items()}, oracle_dir / "model.safetensors")
    loaded = load(tmp_path / "m.gguf")
    assert loaded.tokenizer is None and loaded.config.rope_theta == 500.0 and not loaded.config.tie_embeddings
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(tokens)
    torch.testing.assert_close(ours, hf_logits(oracle_dir, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_torch_dequantizers_match_gguf_quants(qtype):
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).normal(size=(8, 96)).astype(np.float32) * 3
    packed = gguf.quants.quantize(w, q)
    ref = gguf.quants.dequantize(packed, q).reshape(8, 96)
    np.testing.assert_array_equal(dequantize(packed, qtype, (8, 96)).numpy(), ref)


def test_gguf_unsupported_quant_type_and_arch(tmp_path):
    import gguf

    with pytest.raises(ValueError, match="Q8_K is not supported"):
        dequantize(np.zeros((1, 292), np.uint8), "Q8_K", (1, 256))
    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'bert' is not supported"):
        load(tmp_path / "bert.gguf")


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    return load(default_model_path)


def test_smollm2_gguf_says_paris(smollm2):
    tok = smollm2.tokenizer
    assert tok is not None, "the GGUF tokenizer should load from the file's metadata"
    c = smollm2.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    reply = tok.decode(generate(smollm2.model, ids, 10, eos_id=tok.eos_id))
    assert "Paris" in reply, reply


@pytest.mark.slow
def test_smollm2_gguf_logits_match_hf_gguf_loader(smollm2, default_model_path):
    """HF dequantizes the same Q4_1/Q8_0 blocks to the same fp32 weights (checked bit-equal below), so
    logits differ only by fp32 summation order over 30 layers: |logits| reach ~40 and 1e-3 absolute
    (2.5e-5 relative) is far below any change a wrong permutation or scale would cause (O(1))."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf_state = hf.state_dict()
    ours = smollm2.model
    for name, hf_name in (("layers.0.attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
                          ("layers.29.attn.k_proj.weight", "model.layers.29.self_attn.k_proj.weight"),
                          ("tok_embeddings.weight", "model.embed_tokens.weight")):
        torch.testing.assert_close(ours.get_parameter(name), hf_state[hf_name], atol=0, rtol=0)
    tokens = torch.tensor([smollm2.tokenizer.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-3, rtol=0)


# ---------------------------------------------------------------- scratchlm checkpoints and export


def _random_model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    cfg.update(kw)
    model = TransformerLM(ModelConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_scratchlm_checkpoint_round_trip(tmp_path):
    model = _random_model(rope_layout="adjacent")
    path = save_model(tmp_path / "ckpt.pt", model)
    assert detect_format(path) == "scratchlm"
    loaded = load(path)
    assert loaded.config == model.config and loaded.tokenizer is None
    tokens = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens), model(tokens), atol=0, rtol=0)
    # compiled / DDP prefixes in the state dict are understood
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"] = {"_orig_mod." + k: v for k, v in ckpt["model"].items()}
    save_torch_checkpoint(ckpt, tmp_path / "compiled.pt")  # an edited checkpoint: re-saved with new checksums
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "compiled.pt").model(tokens), model(tokens))


def test_load_in_bfloat16():
    model = _random_model()
    state = model.state_dict()
    from scratchlm.model.loading import build_model

    bf = build_model(model.config, state.items(), "test", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    assert all(p.requires_grad for p in bf.parameters())


@pytest.mark.parametrize("kind", ["adjacent_tied", "half_untied", "qwen2_bias"])
def test_export_hf_round_trip(tmp_path, kind):
    kw = {"adjacent_tied": dict(rope_layout="adjacent", tie_embeddings=True),
          "half_untied": dict(rope_layout="half", tie_embeddings=False),
          "qwen2_bias": dict(qkv_bias=True, tie_embeddings=False, rope_layout="adjacent")}[kind]
    model = _random_model(**kw)
    save_model(tmp_path / "m.pt", model)
    loaded = load(tmp_path / "m.pt")
    out = export_hf(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "hf")
    tokens = torch.randint(0, 96, (2, 25), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(out, tokens), ours, atol=1e-4, rtol=0)
    again = load(out)  # and scratchlm reads its own export back
    with torch.no_grad():
        torch.testing.assert_close(again.model(tokens), ours, atol=1e-5, rtol=0)


def test_export_stories260k_bin_to_hf_matches_the_reference_hf_dir(tmp_path, stories):
    loaded = load(stories / "stories260K.bin")
    out = export_hf(loaded.model, loaded.config, None, tmp_path / "hf")
    ours = load_file(out / "model.safetensors")
    ref = load_file(stories / "hf" / "model.safetensors")
    assert set(ours) == set(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], atol=0, rtol=0, msg=name)


# ---------------------------------------------------------------- bad input


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path not found"):
        load(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)


def test_hf_dir_errors(tmp_path):
    path = tiny_qwen2(tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    bad = dict(cfg, model_type="gpt_neox")
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="model_type 'gpt_neox' is not supported"):
        load(path)
    (path / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "bogus", "factor": 4.0})))
    with pytest.raises(CheckpointError, match="RoPE scaling 'bogus' is not supported"):
        load(path)
    (path / "config.json").write_text(json.dumps(dict(cfg, rope_parameters={"rope_type": "linear", "factor": 2.0},
                                                      rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(CheckpointError, match=r"rope_parameters \('linear'\) and rope_scaling \('yarn'\) disagree"):
        load(path)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        load(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load(path)
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load(path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = tiny_llama(tmp_path / "l")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=128)))
    # checked from the safetensors header before any tensor is read (model/loading/guard.py), naming the field
    with pytest.raises(CheckpointError, match=r"config\.json declares intermediate_size=128 but model\.safetensors "
                                              r"has model\.layers\.0\.mlp\.down_proj\.weight of shape \(64, 160\)"):
        load(path)


def test_sharded_hf_checkpoint(tmp_path):
    path = tiny_llama(tmp_path / "l")
    state = load_file(path / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        ours = load(path).model(tokens)
    torch.testing.assert_close(ours, hf_logits(path, tokens), atol=1e-4, rtol=0)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is missing"):
        load(path)


def test_llama2c_errors(tmp_path, stories):
    data = (stories / "stories260K.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load(tmp_path / "short.bin")
    (tmp_path / "tiny.bin").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        load(tmp_path / "tiny.bin")
    (tmp_path / "junk.bin").write_bytes(struct.pack("<7i", -5, 3, 0, 1, 1, 9, 9) + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="implausible header"):
        load(tmp_path / "junk.bin")
    # untied classifier: negative vocab with an extra (vocab, dim) matrix at the end; no tokenizer next to it
    header = struct.unpack("<7i", data[:28])
    untied = struct.pack("<7i", *header[:5], -header[5], header[6]) + data[28:] + data[28:28 + 4 * 512 * 64]
    (tmp_path / "untied.bin").write_bytes(untied)
    loaded = load(tmp_path / "untied.bin")
    assert not loaded.config.tie_embeddings and loaded.tokenizer is None
    torch.testing.assert_close(loaded.model.lm_head.weight, loaded.model.tok_embeddings.weight)


def test_gguf_and_checkpoint_corruption(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load(tmp_path / "bad.gguf")
    (tmp_path / "notgguf.gguf").write_bytes(b"hello world")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load(tmp_path / "notgguf.gguf")
    model = _random_model()
    path = save_model(tmp_path / "m.pt", model)
    (tmp_path / "trunc.pt").write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load(tmp_path / "trunc.pt")
    torch.save({"format": "other", "model": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a scratchlm checkpoint"):
        load(tmp_path / "other.pt")
    torch.save({"format": "scratchlm", "model_config": {"d_model": 64, "bogus": 1}, "model": {}}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=r"invalid model_config.*bogus"):
        load(tmp_path / "c.pt")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="unrecognised model file"):
        load(tmp_path / "x.txt")
