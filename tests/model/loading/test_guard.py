"""The load guards (model/loading/guard.py) on real files: absurd declared sizes refused in seconds under a memory
cap, naming the field and the file; weights too big for the memory left refused before they are read; NaN/Inf
weights refused naming the tensor (GGUF written by the `gguf` package, float and quantized; safetensors; scratchlm
checkpoints), with the scale offsets checked against gguf.quants' dequantizer; FIFOs, devices, sockets and
symlink loops named for what they are, with every wait bounded so a regression fails rather than hangs.

Each test fails on the code before the guards (run against main first): the absurd configs grew to the memory
cap (a MemoryError after ~50 s under 3 GiB, unbounded without a cap), NaN weights loaded silently, a FIFO blocked
`load` forever and a symlink loop read as "not found"."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from scratchlm.model import CheckpointError, ModelConfig, TransformerLM, load, save_model
from scratchlm.model.loading.dequant import TYPE_INFO
from scratchlm.model.loading.guard import GGUF_SCALES, MXFP4_OVERFLOW, check_gguf_finite
from tests.conftest import REPO_ROOT
from tests.model.loading.test_dequant import oracle, random_raw

gguf = pytest.importorskip("gguf")

MEMORY_CAP = int(os.environ.get("SCRATCHLM_TEST_AS_CAP", 3 << 30))  # RLIMIT_AS of the capped child
LOAD_BOUND_S = float(os.environ.get("SCRATCHLM_TEST_LOAD_BOUND_S", 10))  # each refusal, after the imports
CHILD_TIMEOUT_S = float(os.environ.get("SCRATCHLM_TEST_CHILD_TIMEOUT_S", 120))  # the whole child, imports too
WAIT_S = 10.0  # a FIFO open that blocks longer has hung

_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.down_proj": "ffn_down",
               "mlp.up_proj": "ffn_up"}


@pytest.fixture()
def stories_hf(data_dir, tmp_path) -> Path:
    """A writable copy of stories260K's HF folder (5 layers, d 64, ff 172, 8 heads, 4 kv heads, vocab 512)."""
    return Path(shutil.copytree(data_dir / "models/stories260K/hf", tmp_path / "hf"))


def _edit_config(folder: Path, **fields) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | fields))
    return folder


def write_gguf(out: Path, hf_dir: Path, *, block_count: int | None = None, ff: int | None = None,
               q8: tuple[str, ...] = (), nan_scale: str | None = None, nan_value: str | None = None) -> Path:
    """stories260K as a llama GGUF written by gguf.GGUFWriter: `q8` tensors as Q8_0 (the first block of row 2 of
    `nan_scale` gets a NaN d), the rest F32 (`nan_value` gets one NaN). q/k rows are not permuted: the tests
    here read the file's structure, not its outputs."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_block_count(block_count or cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(ff or cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if name in _GGUF_TOP:
            gname = _GGUF_TOP[name]
        else:
            _, _, i, local = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_LAYER[local.removesuffix('.weight')]}.weight"
        w = np.ascontiguousarray(t.numpy(), dtype=np.float32)
        if gname in q8:
            packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            if gname == nan_scale:
                packed[2, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
            writer.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            if gname == nan_value:
                w.reshape(-1)[3] = np.nan
            writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _checkpoint(path: Path, **config_fields) -> Path:
    """A scratchlm checkpoint of a small random model whose stored model_config gets `config_fields`: edited by
    hand, so without the per-tensor checksums a checkpoint may carry (they would refuse the edit before the
    guards see it; a checkpoint without them loads unverified, and the guards are what stands then)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64))
    save_model(path, model)
    ckpt = torch.load(path, weights_only=True)
    ckpt.pop("checksums", None)
    ckpt["model_config"] = ckpt["model_config"] | config_fields
    torch.save(ckpt, path)
    return path


def _sparse_big_hf(folder: Path, hf_dir: Path, vocab: int) -> Path:
    """stories260K with a `vocab`-row embedding: the config and the safetensors header agree, the embedding's
    bytes are a hole in a sparse file (nothing is written for them)."""
    folder.mkdir()
    _edit_config(Path(shutil.copy(hf_dir / "config.json", folder)).parent, vocab_size=vocab)
    state = load_file(hf_dir / "model.safetensors")
    big = "model.embed_tokens.weight"
    header, offset, blobs = {}, 0, []
    for name, t in sorted(state.items(), key=lambda kv: kv[0] == big):  # the embedding last: the hole at the end
        shape = (vocab, t.shape[1]) if name == big else tuple(t.shape)
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        if name != big:
            blobs.append(t.numpy().astype(np.float32).tobytes())
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
        f.truncate(8 + len(head) + offset)
    return folder


# ------------------------------------------------------------------------------- declared sizes, memory cap

_CHILD = """
import json, signal, sys, time
from scratchlm.model import load
from scratchlm.parallel.layout import read_model_config  # what the TP/PP/CP launcher reads before any rank starts
bound = float(sys.argv[1])
def _late(*_):
    raise TimeoutError(f"still running after {bound} s")
signal.signal(signal.SIGALRM, _late)
for job in sys.argv[2:]:
    how, path = job.split(":", 1)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, bound)
    try:
        (load if how == "load" else read_model_config)(path)
        error = None
    except BaseException as e:  # MemoryError and the timer's TimeoutError are results too
        error = f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    print(json.dumps({"job": job, "error": error, "seconds": time.monotonic() - start}), flush=True)
"""


def _capped() -> None:
    """preexec_fn of the child: an address-space cap, and death with the test process."""
    from scratchlm.lifecycle import die_with_parent

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    die_with_parent()


def test_absurd_sizes_are_refused_in_seconds_under_a_memory_cap(stories_hf, tmp_path):
    """One child under RLIMIT_AS (3 GiB) loads: an HF config declaring 1,000,000 layers over a file with 5, a
    GGUF declaring block_count 1,000,000, a scratchlm checkpoint whose model_config says 1,000,000 layers, and
    a consistent HF model whose 4 GiB of weights (a sparse file) cannot fit; and reads the first three as the
    tensor-parallel launcher does (`read_model_config`, before any rank starts). Each is refused within the
    bound, naming the field and the file (before: the loads grew to the cap, ~50 s to a MemoryError for the
    first; the launcher's stage planner, quadratic in the layer count, ran for good)."""
    gguf_path = write_gguf(tmp_path / "layers.gguf", stories_hf, block_count=1_000_000)
    ckpt = _checkpoint(tmp_path / "layers.pt", n_layers=1_000_000)
    big = _sparse_big_hf(tmp_path / "big", stories_hf, vocab=1 << 24)  # 2^24 x 64 float32 = 4 GiB
    hf = _edit_config(stories_hf, num_hidden_layers=1_000_000)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), SCRATCHLM_QUANT_NO_EXTENSION="1")
    env.pop("SCRATCHLM_SKIP_MEMORY_CHECK", None)
    jobs = {f"load:{hf}": f"{hf / 'config.json'} declares num_hidden_layers=1000000 but model.safetensors has "
                          "tensors for 5 layers",
            f"config:{hf}": f"{hf / 'config.json'} declares num_hidden_layers=1000000 but model.safetensors has "
                            "tensors for 5 layers",
            f"load:{gguf_path}": f"{gguf_path} declares llama.block_count=1000000 but it has tensors for 5 layers",
            f"config:{gguf_path}": f"{gguf_path} declares llama.block_count=1000000 but it has tensors for 5 layers",
            f"load:{ckpt}": f"{ckpt} declares model_config.n_layers=1000000 but its state dict has tensors for 2 "
                            "layers",
            f"config:{ckpt}": f"{ckpt} declares model_config.n_layers=1000000 but its state dict has tensors for 2 "
                              "layers",
            f"load:{big}": f"{big}: the weights need 4.00 GiB as float32"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(LOAD_BOUND_S), *jobs], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, env=env, preexec_fn=_capped, cwd=tmp_path)
    results = {r["job"]: r["error"] for r in map(json.loads, proc.stdout.splitlines())}
    assert len(results) == len(jobs), proc.stdout + proc.stderr[-3000:]
    for job, message in jobs.items():
        error = results[job]
        assert error is not None and error.startswith("CheckpointError") and message in error, (job, error)
    assert "available (address space left under RLIMIT_AS)" in results[f"load:{big}"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_size", 4096, "declares hidden_size=4096 but model.safetensors has model.embed_tokens.weight of shape "
                          "(512, 64) (64 columns)"),
    ("intermediate_size", 1_000_000, "declares intermediate_size=1000000 but model.safetensors has "
                                     "model.layers.0.mlp.down_proj.weight of shape (64, 172) (172 columns)"),
    ("vocab_size", 1_000_000, "declares vocab_size=1000000 but model.safetensors has model.embed_tokens.weight of "
                              "shape (512, 64) (512 rows)"),
    ("num_attention_heads", 800_000, "declares num_attention_heads=800000 (x head_dim 8 = 6400000 rows) but "
                                     "model.safetensors has model.layers.0.self_attn.q_proj.weight of shape (64, 64) "
                                     "(64 rows)"),
    ("num_key_value_heads", 8, "declares num_key_value_heads=8 (x head_dim 8 = 64 rows) but model.safetensors has "
                               "model.layers.0.self_attn.k_proj.weight of shape (32, 64) (32 rows)"),
])
def test_hf_declared_size_names_the_field_and_the_tensor(stories_hf, field, value, message):
    _edit_config(stories_hf, **{field: value})
    with pytest.raises(CheckpointError) as e:
        load(stories_hf)
    assert str(e.value) == f"{stories_hf / 'config.json'} {message}"


def test_gguf_and_checkpoint_declared_sizes_name_the_field(stories_hf, tmp_path):
    path = write_gguf(tmp_path / "ff.gguf", stories_hf, ff=4096)
    with pytest.raises(CheckpointError, match=r"declares llama\.feed_forward_length=4096 but the file has "
                                              r"blk\.0\.ffn_down\.weight of shape \(64, 172\) \(172 columns\)"):
        load(path)
    ckpt = _checkpoint(tmp_path / "ff.pt", d_ff=1_000_000)
    with pytest.raises(CheckpointError, match=r"declares model_config\.d_ff=1000000 but its state dict has "
                                              r"layers\.0\.ffn\.w2\.weight of shape \(32, 64\)"):
        load(ckpt)


def test_sharded_index_naming_a_tensor_its_shard_lacks(stories_hf):
    state = load_file(stories_hf / "model.safetensors")
    (stories_hf / "model.safetensors").unlink()
    names = sorted(state)
    save_file({k: state[k] for k in names[:5]}, stories_hf / "a.safetensors")
    save_file({k: state[k] for k in names[5:]}, stories_hf / "b.safetensors")
    weight_map = dict.fromkeys(names, "a.safetensors")  # every tensor claimed by the first shard
    (stories_hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"a.safetensors: the index lists tensor {names[5]} in this shard"):
        load(stories_hf)


# ------------------------------------------------------------------------------------------ finite weights


def test_gguf_with_a_nan_is_refused_naming_the_tensor(stories_hf, tmp_path):
    """A Q8_0 block whose fp16 scale is NaN, and a NaN in an F32 tensor: both loaders (float and packed) refuse
    the file before dequantizing, naming the tensor; the same file without the NaN loads (the control)."""
    from scratchlm.inference.quantization import load_gguf_packed

    q8 = ("blk.1.attn_q.weight", "blk.2.attn_v.weight")
    clean = write_gguf(tmp_path / "clean.gguf", stories_hf, q8=q8)
    assert load(clean).config.n_layers == 5
    scale = write_gguf(tmp_path / "scale.gguf", stories_hf, q8=q8, nan_scale="blk.1.attn_q.weight")
    value = write_gguf(tmp_path / "value.gguf", stories_hf, q8=q8, nan_value="blk.3.ffn_norm.weight")
    for loader in (load, load_gguf_packed):
        with pytest.raises(CheckpointError) as e:
            loader(scale)
        assert str(e.value).startswith(f"{scale}: tensor blk.1.attn_q.weight (Q8_0) has 1 block whose scale makes "
                                       "the weights NaN or Inf (first: block 4, row 2)"), str(e.value)
    with pytest.raises(CheckpointError, match=r"value\.gguf: tensor blk\.3\.ffn_norm\.weight \(F32\) has 1 "
                                              r"non-finite value \(first: nan at \[3\]\)"):
        load(value)


def test_safetensors_and_checkpoint_with_an_inf_are_refused(stories_hf, tmp_path):
    state = load_file(stories_hf / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][5, 7] = float("inf")
    save_file(state, stories_hf / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight "
                                              r"has 1 non-finite value \(first: inf at \[5, 7\]\)"):
        load(stories_hf)
    ckpt = _checkpoint(tmp_path / "c.pt")
    raw = torch.load(ckpt, weights_only=True)  # a NaN the training run itself saved: checksums would agree
    raw["model"]["layers.0.attn.k_proj.weight"][0, 1] = float("nan")
    torch.save(raw, ckpt)
    with pytest.raises(CheckpointError, match=r"c\.pt: tensor layers\.0\.attn\.k_proj\.weight has 1 non-finite "
                                              r"value \(first: nan at \[0, 1\]\)"):
        load(ckpt)


class _T:
    """A GGUFTensor stand-in: what check_gguf_finite reads."""

    def __init__(self, type_name: str, raw: np.ndarray, weights_per_row: int):
        self.type_name, self.data, self.shape = type_name, raw, (raw.size // TYPE_INFO[type_name][1] *
                                                                 TYPE_INFO[type_name][0] // weights_per_row,
                                                                 weights_per_row)


@pytest.mark.parametrize("type_name", [*GGUF_SCALES, "IQ1_M", "MXFP4"])
def test_the_scales_checked_are_the_ones_that_make_gguf_quants_nan(type_name):
    """For every quantized type: random blocks with finite scales dequantize (gguf.quants, the oracle) to finite
    values and pass; a NaN (MXFP4: an e8m0 byte of 255) written where the guard reads the scale makes the oracle's
    block non-finite and the guard names it."""
    bw, bb = TYPE_INFO[type_name]
    raw = random_raw(type_name, 4, np.random.default_rng(0))
    if type_name == "MXFP4":
        raw[:, 1:] = 0xFF  # every code -12: the largest magnitude
    assert torch.isfinite(oracle(raw, type_name, (4, bw))).all()
    check_gguf_finite({"w": _T(type_name, raw, bw)}, "x.gguf")
    nan = np.array([np.nan], dtype=np.float16).view(np.uint16)[0]
    if type_name == "MXFP4":
        raw[2, 0] = MXFP4_OVERFLOW
    elif type_name == "IQ1_M":  # d spread over the top nibbles of the four u16 words at bytes 48..56
        words = raw[2, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[k] = (words[k] & 0x0FFF) | (((nan >> (4 * k)) & 0xF) << 12)
        raw[2, 48:56] = words.view(np.uint8)
    else:
        off = GGUF_SCALES[type_name][-1]
        raw[2, off:off + 2] = np.array([nan], dtype="<u2").view(np.uint8)
    with np.errstate(over="ignore"):  # MXFP4: gguf.quants' multiply overflows to inf, which is the point
        assert not torch.isfinite(oracle(raw, type_name, (4, bw))[2]).all()
    with pytest.raises(CheckpointError, match=rf"tensor w \({type_name}\) has 1 block whose scale .* block 2, row 2"):
        check_gguf_finite({"w": _T(type_name, raw, bw)}, "x.gguf")


# ------------------------------------------------------------------------------------------- path kinds


def _load_within(path: Path, fifo: Path | None = None) -> BaseException | None:
    """`load(path)` in a thread, bounded by WAIT_S; the exception it raised, None if it loaded. A load still
    blocked in open() on `fifo` is released (a writer opens the FIFO) and the test fails."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            load(path)
            box.append(None)
        except BaseException as e:
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked open() returns
        thread.join(WAIT_S)
        pytest.fail(f"load({path}) still blocked after {WAIT_S} s")
    return box[0]


def test_a_fifo_is_named_not_opened(tmp_path, stories_hf):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    e = _load_within(fifo, fifo)
    assert isinstance(e, CheckpointError) and f"model path {fifo} is a FIFO (named pipe), not a model file" in str(e)
    inner = stories_hf / "model.safetensors"  # a FIFO where the weights should be
    inner.unlink()
    os.mkfifo(inner)
    e = _load_within(stories_hf, inner)
    assert isinstance(e, CheckpointError) and f"safetensors file {inner} is a FIFO (named pipe), not a file" in str(e)


def test_symlink_loops_dangling_links_sockets_and_devices(tmp_path):
    a, b, me = tmp_path / "a", tmp_path / "b", tmp_path / "me"
    os.symlink(b, a)
    os.symlink(a, b)
    os.symlink(me, me)
    e = _load_within(a)
    assert isinstance(e, CheckpointError) and f"model path {a} is a symlink loop ({a} -> {b} -> {a})" in str(e)
    e = _load_within(me)
    assert isinstance(e, CheckpointError) and f"{me} is a symlink loop ({me} -> {me})" in str(e)
    e = _load_within(a / "model.gguf")  # a loop on the way to the file
    assert isinstance(e, CheckpointError) and "is a symlink loop (a folder on the way loops" in str(e)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "gone.gguf", dangling)
    e = _load_within(dangling)
    assert isinstance(e, FileNotFoundError) and f"is a symlink to {tmp_path / 'gone.gguf'}, which does not" in str(e)
    assert isinstance(_load_within(tmp_path / "nothing"), FileNotFoundError)
    sock_path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        e = _load_within(sock_path)
    assert isinstance(e, CheckpointError) and "is a socket, not a model file or folder" in str(e)
    e = _load_within(Path("/dev/null"))
    assert isinstance(e, CheckpointError) and "/dev/null is a character device, not a model file" in str(e)


def test_the_cli_names_a_symlink_loop_and_a_fifo(tmp_path, capsys):
    """`generate` checks the model path itself before loading: a loop and a FIFO get the loader's words, not "not
    found" (a loop) or a hang (a FIFO)."""
    from scratchlm import cli

    a, b, fifo = tmp_path / "a", tmp_path / "b", tmp_path / "f.gguf"
    os.symlink(b, a)
    os.symlink(a, b)
    os.mkfifo(fifo)
    for path, words in ((a, "is a symlink loop"), (fifo, "is a FIFO (named pipe)")):
        box: list[int] = []
        thread = threading.Thread(target=lambda p=path, out=box: out.append(
            cli.main(["generate", "--model", str(p), "x"])), daemon=True)
        thread.start()
        thread.join(WAIT_S * 6)  # the engine's imports come first
        if thread.is_alive():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"scratchlm generate --model {path} still running after {WAIT_S * 6} s")
        assert box == [2] and words in capsys.readouterr().err


@pytest.mark.distributed
def test_tensor_parallel_ranks_refuse_an_inf_in_their_slice(stories_hf, capfd):
    """Each rank reads only its slice of an HF tensor (parallel/launch.py) and checks it: the rank holding the Inf
    fails its start-up naming the tensor, its rows and the file."""
    from scratchlm.inference import LLM

    state = load_file(stories_hf / "model.safetensors")
    state["model.layers.2.mlp.up_proj.weight"][100, 3] = float("inf")  # rows 86:172 are rank 1's
    save_file(state, stories_hf / "model.safetensors")
    with pytest.raises(Exception, match="start-up failed"):
        LLM(str(stories_hf), tensor_parallel_size=2)
    assert ("tensor model.layers.2.mlp.up_proj.weight[86:172] has 1 non-finite value (first: inf at [14, 3])"
            in capfd.readouterr().err)
