"""What a load checks before it allocates or reads weights: the policy is to fail in seconds, naming the file and
the field, rather than block, allocate without bound or serve a broken model.

1. The path (`check_path`): a model is a regular file or a folder. `open()` on a FIFO blocks until a writer
   comes, so a FIFO is an error that says so, as are a character or block device, a socket, a symlink loop
   (which `Path.exists()` reports as "not found") and a symlink to nothing.
2. Declared sizes against the files (`check_layer_count`, `check_shapes`): a config declares sizes
   (`num_hidden_layers`, `hidden_size`, `intermediate_size`, `vocab_size`, `num_attention_heads`, GGUF's
   `<arch>.block_count`, a checkpoint's `model_config`); the files' headers give every tensor's shape without
   reading data (the safetensors JSON header, GGUF tensor infos, a checkpoint's mmap'd state dict). The layer
   count is compared first, before the config is translated and before any per-layer structure is built (a
   config claiming 1,000,000 layers over a file with 2 used to build a million modules' worth of tensor rules
   until memory ran out). Then every file tensor goes through its family rule's transform on the meta device,
   so the comparison with the model's shapes costs no memory and the message names the declared field.
3. Memory (`check_memory`): the weights' bytes at the load dtype against what the process may still use: host
   memory (`MemAvailable` + `SwapFree` of /proc/meminfo), the cgroup's limit less its working set (v1 or v2),
   the address space left under `RLIMIT_AS`; on CUDA, the device's free memory. Set
   ``SCRATCHLM_SKIP_MEMORY_CHECK=1`` to load anyway (the estimate counts the weights only: the KV cache is sized
   later from what is left).
4. Finite weights (`check_finite`, `check_gguf_finite`): a NaN or Inf weight makes every logit NaN, and the
   model then samples token 0 (or `<|endoftext|>`) forever. A float tensor is summed (a NaN or Inf anywhere
   makes the sum NaN or Inf, whatever the order of the additions; ~10x cheaper than a test per element) and only
   a non-finite sum is searched element by element. Quantized GGUF blocks are not dequantized: their fp16 scale
   fields are checked (d, and dmin where the type has one; IQ1_M's d is spread over four scale words). Every
   other field is an integer code, so a block decodes to finite float32 values exactly when its scales are
   finite (the largest code times the largest scale product stays far below float32's range). MXFP4's e8m0
   scale byte e gives 2^(e - 128) times codes up to 12, which overflows float32 from e = 253: such blocks are
   refused. NVFP4's e4m3 scales are at most 240, so every NVFP4 block is finite and is not read.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import CheckpointError, expected_shapes

SKIP_MEMORY_CHECK = "SCRATCHLM_SKIP_MEMORY_CHECK"

# ------------------------------------------------------------------------------------------------- 1. the path

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_path(path: str | Path, what: str = "model path", expected: str = "a model file or folder") -> Path:
    """`path` if it is a regular file or a folder (after symlinks); otherwise an error that says what it is.

    FileNotFoundError for a path that does not exist (naming a dangling symlink's target); CheckpointError for a
    symlink loop, a FIFO, a device or a socket. Nothing is opened, so a FIFO cannot block."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{what} {path} is a symlink loop ({_link_chain(path)}), not {expected}") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                raise FileNotFoundError(f"{what} {path} is a symlink to {os.readlink(path)}, which does not "
                                        "exist") from None
            raise FileNotFoundError(f"{what} not found: {path}") from None
        raise CheckpointError(f"{what} {path}: {e.strerror}") from None
    for test, kind in _KINDS:
        if test(mode):
            raise CheckpointError(f"{what} {path} is {kind}, not {expected}")
    return path


def _link_chain(path: Path, limit: int = 8) -> str:
    """'a -> b -> a' for the symlinks from `path` on (or the component of its parents that loops)."""
    seen, chain, p = {os.path.normpath(path)}, [str(path)], path
    while os.path.islink(p) and len(chain) <= limit:
        target = Path(os.readlink(p))
        p = target if target.is_absolute() else p.parent / target
        key = os.path.normpath(p)
        chain.append(str(target))
        if key in seen:
            return " -> ".join(chain)
        seen.add(key)
    if len(chain) > 1:
        return " -> ".join(chain + ["..."])
    return "a folder on the way loops back on itself"


# ------------------------------------------------------------------------------ 2. declared sizes vs the files

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blk|blocks)\.(\d+)\.")


def layers_present(names: Iterable[str]) -> int:
    """How many distinct layer indices the tensor names carry (`model.layers.3.`, `transformer.h.3.`, `blk.3.`)."""
    return len({m.group(1) for n in names if (m := _LAYER.search(n))})


def check_layer_count(declared: Any, field: str, names: Iterable[str], config_file: str, weights: str) -> None:
    """Raise CheckpointError when a config declares more layers than the files hold tensors for (the check that
    runs before any per-layer structure is built). A non-integer is left to the config translation's errors."""
    if not isinstance(declared, (int, np.integer)) or isinstance(declared, bool):
        return
    present = layers_present(names)
    if declared > present:
        raise CheckpointError(f"{config_file} declares {field}={declared} but {weights} has tensors for {present} "
                              f"layer{'s' * (present != 1)}")


def _probes(config: ModelConfig) -> list[tuple[str, str, int, str]]:
    """Probes of the declared sizes, in the order they are reported: (ModelConfig field, tensor, dim, what the
    dim holds). The first probe whose tensor disagrees names the field. A mixture of experts is probed in its
    first sparse layer: the expert count by the router's rows, the expert width by expert 0's w1 rows; the dense
    MLP width in the first dense layer."""
    n = config.n_layers
    dense = next((i for i in range(n) if not config.is_moe_layer(i)), None)
    sparse = next((i for i in range(n) if config.is_moe_layer(i)), None)
    probes = [("vocab_size", "tok_embeddings.weight", 0, "rows"), ("d_model", "tok_embeddings.weight", 1, "columns")]
    if sparse is not None:
        probes += [("n_experts", f"layers.{sparse}.ffn.gate.weight", 0, "rows"),
                   ("d_expert", f"layers.{sparse}.ffn.experts.0.w1.weight", 0, "rows")]
    if dense is not None:
        probes.append(("d_ff", f"layers.{dense}.ffn.w2.weight", 1, "columns"))
    return probes + [("n_heads", "layers.0.attn.q_proj.weight", 0, "rows"),
                     ("n_kv_heads", "layers.0.attn.k_proj.weight", 0, "rows"),
                     ("max_seq_len", "pos_embeddings.weight", 0, "rows")]

#: The HF config.json keys of each ModelConfig size field, across the families.
HF_FIELDS = {"n_layers": ("num_hidden_layers", "n_layer", "num_layers"), "d_model": ("hidden_size", "n_embd"),
             "d_ff": ("intermediate_size", "n_inner", "ffn_dim"), "vocab_size": ("vocab_size",),
             "n_heads": ("num_attention_heads", "n_head"), "n_kv_heads": ("num_key_value_heads",),
             "head_dim": ("head_dim",), "max_seq_len": ("max_position_embeddings", "n_positions"),
             "n_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
             "d_expert": ("moe_intermediate_size",)}

#: The GGUF metadata keys (after `<arch>.`) of each ModelConfig size field.
GGUF_FIELDS = {"n_layers": "block_count", "d_model": "embedding_length", "d_ff": "feed_forward_length",
               "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
               "head_dim": "attention.key_length", "max_seq_len": "context_length", "n_experts": "expert_count",
               "d_expert": "expert_feed_forward_length"}


def hf_field_names(cfg: Mapping[str, Any]) -> dict[str, str]:
    """{ModelConfig field: the config.json key that declares it}, for the keys this config.json has."""
    return {ours: next(k for k in keys if cfg.get(k) is not None) for ours, keys in HF_FIELDS.items()
            if any(cfg.get(k) is not None for k in keys)}


def gguf_field_names(meta: Mapping[str, Any]) -> dict[str, str]:
    """{ModelConfig field: the GGUF metadata key that declares it}, for the keys this file has."""
    arch = meta.get("general.architecture")
    return {ours: f"{arch}.{key}" for ours, key in GGUF_FIELDS.items() if f"{arch}.{key}" in meta}


def _field_value(config: ModelConfig, field: str) -> str:
    """`field`'s value, with what the probed dim actually holds when that is a product."""
    if field in ("n_heads", "n_kv_heads"):
        n = getattr(config, field)
        return f"{n} (x head_dim {config.head_dim} = {n * config.head_dim} rows)"
    if field == "n_experts":
        return str(config.moe.n_experts)
    return str(getattr(config, field))


def check_shapes(config: ModelConfig, rules: Iterable[Any], file_shapes: Mapping[str, tuple[int, ...]],
                 file_of: Callable[[str], str], fields: Mapping[str, str], config_file: str) -> None:
    """Compare every file tensor, through its rule's transform on the meta device, with `TransformerLM(config)`'s
    shapes; raise CheckpointError naming the declared field (`fields`: ModelConfig field -> the source's key)
    when a probe tensor shows which one is wrong, else the first tensor that does not fit. No data is read.

    Call it only after `check_layer_count`: the expected shapes come from a meta model with config.n_layers
    blocks."""
    expected = expected_shapes(config)
    got: dict[str, tuple[tuple[int, ...], str]] = {}  # our name -> (shape after the transform, file tensor)
    bad: list[str] = []
    for rule in rules:
        shape = tuple(file_shapes[rule.theirs])
        try:
            parts = rule.to_ours(torch.empty(shape, device="meta"))
        except (RuntimeError, ValueError) as e:  # a split or head permute the declared sizes cannot apply
            bad.append(f"{file_of(rule.theirs)} has {rule.theirs} of shape {shape}, which the config's sizes "
                       f"cannot split or permute ({str(e).splitlines()[0]})")
            continue
        for ours, t in parts:
            got[ours] = (tuple(t.shape), rule.theirs)
    for field, name, dim, what in _probes(config):
        if name in got and name in expected and got[name][0][dim] != expected[name][dim]:
            shape, theirs = got[name]
            key = fields.get(field, f"{field} (derived)")
            raise CheckpointError(f"{config_file} declares {key}={_field_value(config, field)} but "
                                  f"{file_of(theirs)} has {theirs} of shape {shape} ({shape[dim]} {what})")
    bad += [f"{file_of(theirs)} has {theirs} of shape {shape} where the config gives {ours} {expected[ours]}"
            for ours, (shape, theirs) in got.items() if ours in expected and shape != expected[ours]]
    if bad:
        declared = ", ".join(f"{key}={_field_value(config, f).split(' ')[0]}" for f, key in fields.items()
                             if f != "n_layers")
        raise CheckpointError(f"{config_file} ({declared}) does not fit the weights: {bad[0]}"
                              f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")


def check_state_dict(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str,
                     prefix: str = "model_config.") -> None:
    """The size checks of a scratchlm checkpoint (state-dict names are the model's own): layer count, then
    shapes, from the shapes alone (`build_model` checks memory and finiteness)."""
    check_layer_count(config.n_layers, f"{prefix}n_layers", shapes, source, "its state dict")
    from scratchlm.model.families.base import rename

    rules = [rename(n, n) for n in shapes]
    fields = {f: f"{prefix}{f}" for f in ("d_model", "d_ff", "vocab_size", "n_heads", "n_kv_heads", "max_seq_len")}
    fields |= {"n_experts": f"{prefix}moe.n_experts", "d_expert": f"{prefix}moe.d_expert"}
    check_shapes(config, rules, shapes, lambda _: "its state dict", fields, source)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's JSON header (8-byte length, then JSON; no data read)."""
    check_path(path, "safetensors file", expected="a file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
        return {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------------------------- 3. memory

def weight_bytes(shapes: Iterable[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of tensors of these shapes in `dtype`."""
    return sum(int(np.prod(s, dtype=object)) for s in shapes) * torch.empty((), dtype=dtype).itemsize


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (limit less usage less inactive file cache), or None
    when there is no limit (v2 memory.max, else v1 memory.limit_in_bytes; the cgroup's own folder, else the
    namespace root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
        names = ("memory.max", "memory.current", "inactive_file") if v2 else (
            "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        for folder in (base + rel.rstrip("/"), base):
            limit, usage = _read_int(f"{folder}/{names[0]}"), _read_int(f"{folder}/{names[1]}")
            if limit is None or usage is None:
                continue
            if limit >= 1 << 60:
                return None
            inactive = 0
            try:
                for stat_line in Path(f"{folder}/memory.stat").read_text().splitlines():
                    key, _, value = stat_line.partition(" ")
                    if key == names[2]:
                        inactive = int(value)
            except (OSError, ValueError):
                pass
            return max(limit - max(usage - inactive, 0), 0)
    return None


def _address_space_room() -> int | None:
    """Bytes of address space left under RLIMIT_AS, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        vm = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        return None
    return max(soft - vm, 0)


def available_memory(device: str | torch.device = "cpu") -> tuple[int, str] | None:
    """(bytes a load may still allocate on `device`, where the figure comes from), the tightest bound; None when
    nothing can be read (then the check is skipped)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return free, f"free memory on {dev}"
    if dev.type not in ("cpu", "meta"):
        return None
    bounds = []
    info = _meminfo()
    if "MemAvailable" in info:
        swap = info.get("SwapFree", 0)
        bounds.append((info["MemAvailable"] + swap,
                       "MemAvailable + SwapFree in /proc/meminfo" if swap else "MemAvailable in /proc/meminfo"))
    room = _cgroup_room()
    if room is not None:
        bounds.append((room, "left under the cgroup's memory limit"))
    room = _address_space_room()
    if room is not None:
        bounds.append((room, "address space left under RLIMIT_AS"))
    return min(bounds) if bounds else None


def check_memory(needed: int, source: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """Raise CheckpointError when the weights (`needed` bytes) cannot fit in what `available_memory` reports;
    ``SCRATCHLM_SKIP_MEMORY_CHECK=1`` skips it."""
    if os.environ.get(SKIP_MEMORY_CHECK, "") not in ("", "0"):
        return
    room = available_memory(device)
    if room is None or needed <= room[0]:
        return
    hint = " (a 16-bit dtype halves it)" if dtype == torch.float32 else ""
    raise CheckpointError(f"{source}: the weights need {needed / 2**30:.2f} GiB as {str(dtype).removeprefix('torch.')}"
                          f"{hint} but only {room[0] / 2**30:.2f} GiB is available ({room[1]}); "
                          f"set {SKIP_MEMORY_CHECK}=1 to try anyway")


# ------------------------------------------------------------------------------------------ 4. finite weights

def _where(mask: Tensor, t: Tensor) -> str:
    """'3 non-finite values (first: nan at [2, 5])'."""
    n = int(mask.sum())
    i = int(mask.reshape(-1).nonzero()[0, 0])
    at = [int(x) for x in np.unravel_index(i, tuple(mask.shape))]
    return f"{n} non-finite value{'s' * (n != 1)} (first: {float(t.reshape(-1)[i])} at {at})"


def check_finite(t: Tensor, name: str, source: str | Path) -> None:
    """Raise CheckpointError when the float tensor `t` holds a NaN or Inf, naming the tensor and the file.

    One vectorised sum first (a NaN or Inf anywhere makes the sum NaN or Inf, in any order of addition: ~10x
    cheaper than a per-element test); only a non-finite sum is looked at element by element (a sum that merely
    overflowed passes)."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())):
        return
    mask = ~torch.isfinite(t)
    if bool(mask.any()):
        raise CheckpointError(f"{source}: tensor {name} has {_where(mask, t)}; the model would compute NaN "
                              "(a corrupt or badly converted file)")


#: Byte offsets of the fp16 scale fields in one block of each quantized GGUF type (`dequant.py`'s layouts).
GGUF_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
    "TQ1_0": (52,), "TQ2_0": (64,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
    "IQ3_S": (0,), "IQ1_S": (0,),
}
#: Types whose scales cannot encode a non-finite value.
GGUF_ALWAYS_FINITE = ("NVFP4",)
#: MXFP4 blocks with an e8m0 scale byte from this one on decode to Inf (2^(e - 128) x 12 > float32's max).
MXFP4_OVERFLOW = 253


def _gguf_bad_scales(blocks: np.ndarray, type_name: str) -> np.ndarray | None:
    """(n_blocks,) bool: blocks whose fp16 scale is NaN/Inf; None for a type without fp16 scales."""
    if type_name == "MXFP4":
        return blocks[:, 0] >= MXFP4_OVERFLOW
    if type_name == "IQ1_M":  # d's 16 bits are the top nibbles of the four u16 scale words at bytes 48..56
        words = blocks.view("<u2")[:, 24:28]
        d = (words[:, 0] >> 12) | ((words[:, 1] >> 12) << 4) | ((words[:, 2] >> 12) << 8) | (words[:, 3] & 0xF000)
        return (d & 0x7C00) == 0x7C00
    offsets = GGUF_SCALES.get(type_name)
    if offsets is None:
        return None
    words = blocks.view("<u2")  # every block size and scale offset is even: the scales are whole u16 words
    bad = np.zeros(len(blocks), dtype=bool)
    for off in offsets:
        bad |= (words[:, off // 2] & 0x7C00) == 0x7C00
    return bad


def check_gguf_finite(tensors: Mapping[str, Any], source: str | Path) -> None:
    """Raise CheckpointError naming the first GGUF tensor with a NaN/Inf: float tensors by their sum, then element
    by element when it is not finite (BF16 directly on the bits), quantized ones by their blocks' fp16 scales (see
    the module docstring)."""
    from scratchlm.model.loading.dequant import TYPE_INFO

    for name, t in tensors.items():
        if t.type_name in ("F32", "F16", "BF16"):
            raw = np.asarray(t.data).reshape(-1)
            if t.type_name != "BF16" and np.isfinite(raw.sum(dtype=np.float32)):
                continue  # a NaN or Inf anywhere makes the sum non-finite (see check_finite)
            bits = raw.view("<u4" if t.type_name == "F32" else "<u2")
            exp = {"F32": 0x7F800000, "F16": 0x7C00, "BF16": 0x7F80}[t.type_name]
            bad = (bits & exp) == exp
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                value = float(raw[i]) if t.type_name != "BF16" else float(
                    np.array([int(bits[i]) << 16], dtype="<u4").view("<f4")[0])
                where = [int(x) for x in np.unravel_index(i, t.shape)]
                raise CheckpointError(f"{source}: tensor {name} ({t.type_name}) has {int(bad.sum())} non-finite "
                                      f"value{'s' * (int(bad.sum()) != 1)} (first: {value} at {where}); the model "
                                      "would compute NaN (a corrupt or badly converted file)")
            continue
        if t.type_name in GGUF_ALWAYS_FINITE or t.type_name not in TYPE_INFO:
            continue  # an unsupported type is check_types' error
        block_weights, block_bytes = TYPE_INFO[t.type_name]
        blocks = np.asarray(t.data).reshape(-1, block_bytes)
        bad = _gguf_bad_scales(blocks, t.type_name)
        if bad is not None and bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = i * block_weights // t.shape[-1] if t.shape else 0
            n = int(bad.sum())
            raise CheckpointError(f"{source}: tensor {name} ({t.type_name}) has {n} block{'s' * (n != 1)} whose "
                                  f"scale makes the weights NaN or Inf (first: block {i}, row {row}); the model would "
                                  "compute NaN (a corrupt or badly converted file)")
