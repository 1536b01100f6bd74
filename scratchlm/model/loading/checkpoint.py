"""scratchlm checkpoints: a torch `.pt` dict {"format": "scratchlm", "model_config", "model", "tokenizer", ...},
and the one way the tree reads and writes torch files.

The trainer writes richer checkpoints (optimizer, RNG, data state); the model loader only needs these keys.

The policy, for every torch file scratchlm opens (model checkpoints, training resume, TP/PP/CP ranks, DP replicas,
diffusion and fold files), through :func:`load_torch_file`:

1. **No code runs when a file is opened.** Files are unpickled ``weights_only=True``: tensors and plain data
   (dicts, lists, tuples, numbers, strings, dtypes). A file that needs any other Python object (a class, a function,
   possibly code) is refused with :class:`CheckpointError` naming the file and the object, before anything in it
   is executed. There is no ``weights_only=False`` anywhere in scratchlm.
2. **Corruption is caught.** Checkpoints written by :func:`save_torch_checkpoint` (the trainer's writer and
   :func:`save_model`) carry ``"checksums"``: a crc32 of every tensor's bytes, keyed by its path in the dict
   (``model/layers.0.attn.wq.weight``, ``optimizer/state/3/exp_avg``), and a crc32 of everything else (the keys,
   numbers and strings, tensor dtypes and shapes). :func:`verify_checksums` recomputes them on load: a flipped
   bit or an edited value (a NaN written into a tensor) is refused naming the tensor and the file. A checkpoint
   without checksums (written before they existed, ``version`` 1, or edited by hand with the entry removed)
   loads with a warning that it is unverified. crc32 (zlib) runs at 2-4 GB/s on one core (0.44 s for a 135M
   model's 1.6 GB training checkpoint).
3. **Writes are atomic** (`scratchlm.atomic`): the previous file survives a crash or a full disk, and a full disk
   is reported as such (:class:`scratchlm.atomic.DiskFullError`) rather than as torch's "unexpected pos".
"""

from __future__ import annotations

import pickle
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch

from scratchlm.atomic import atomic_write
from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import CheckpointError, LoadedModel, build_model, log, require_file
from scratchlm.model.loading.guard import check_state_dict
from scratchlm.model.transformer import TransformerLM

FORMAT = "scratchlm"
VERSION = 2  # 2: with per-tensor checksums; 1: without (loads unverified)
CHECKSUMS = "checksums"
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP wrappers
# what torch's weights-only unpickler says when a file asks for an object it does not allow (other errors from it,
# e.g. "Unsupported operand", mean a corrupt or foreign file)
_REFUSED = ("Unsupported global", "unsupported GLOBAL", "Can only create new object", "Trying to call reduce",
            "Can only build")


# --- reading torch files safely -------------------------------------------------------------------------------

def load_torch_file(src: str | Path | IO[bytes], what: str = "checkpoint", mmap: bool = False,
                    map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(src, weights_only=True)``; any failure is a :class:`CheckpointError` naming the file: a file
    that needs a Python object beyond tensors and plain data is refused (nothing in it runs), a corrupt or
    truncated one is reported as unreadable. `what` names the file's role in the messages."""
    name = str(src) if isinstance(src, str | Path) else getattr(src, "name", "<file object>")
    try:
        return torch.load(src, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        if any(m in str(e) for m in _REFUSED):
            raise CheckpointError(_refusal(name, what, str(e))) from None
        raise CheckpointError(f"{name}: not a readable {what} (corrupt or truncated file?): "
                              f"UnpicklingError: {_unpickler_detail(str(e))}") from None
    except Exception as e:  # zip/EOF/runtime errors on a truncated or foreign file
        raise CheckpointError(f"{name}: not a readable {what} (corrupt or truncated file?): "
                              f"{type(e).__name__}: {_first_line(e)}") from None


def _refusal(name: str, what: str, detail: str) -> str:
    """The message for a file that the weights-only unpickler refused, naming the Python object it asked for."""
    return (f"{name}: refused to load this {what}: it needs Python objects beyond tensors and plain data "
            f"({_unpickler_detail(detail)}), and scratchlm reads torch files weights-only so that no code in a file "
            "can run. Re-save it from the code that wrote it as plain data (tensors, dicts, lists, numbers, "
            "strings), or convert it to safetensors")


def _unpickler_detail(text: str) -> str:
    """What torch's weights-only unpickler objected to, without its advice to load with weights_only=False."""
    found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\s*\n|\s*Check the documentation|$)", text, re.S)
    detail = found.group(1) if found else text
    detail = " ".join(detail.split())
    return re.split(r"\. Please use `torch\.serialization", detail)[0][:300]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


# --- checksums ---------------------------------------------------------------------------------------------------

def _walk(obj: Any, key: str, tensors: dict[str, torch.Tensor], parts: list[str]) -> None:
    """Collect every tensor of `obj` by path into `tensors`, and a canonical text of everything else into `parts`."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        parts.append(f"T<{obj.dtype},{tuple(obj.shape)}>")
    elif isinstance(obj, dict):
        parts.append("{")
        for k, v in obj.items():
            if not key and k == CHECKSUMS:
                continue
            parts.append(repr(k) + ":")
            _walk(v, f"{key}/{k}" if key else str(k), tensors, parts)
            parts.append(",")
        parts.append("}")
    elif isinstance(obj, list | tuple):
        parts.append("[" if isinstance(obj, list) else "(")
        for i, v in enumerate(obj):
            _walk(v, f"{key}/{i}", tensors, parts)
            parts.append(",")
        parts.append("]" if isinstance(obj, list) else ")")
    elif isinstance(obj, set | frozenset):
        parts.append("set" + repr(sorted(map(repr, obj))))
    else:
        parts.append(repr(obj))


def tensor_crc32(t: torch.Tensor) -> int:
    """crc32 of a tensor's bytes in row-major order (the values as stored, whatever the strides or device)."""
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def compute_checksums(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``"checksums"`` entry of `obj`: crc32 of each tensor by path, and of the rest (``structure``)."""
    tensors: dict[str, torch.Tensor] = {}
    parts: list[str] = []
    _walk(obj, "", tensors, parts)
    return {"algorithm": "crc32", "structure": zlib.crc32("".join(parts).encode()),
            "tensors": {k: tensor_crc32(t) for k, t in tensors.items()}}


def verify_checksums(obj: dict[str, Any], name: str, only: Iterable[str] | None = None) -> bool:
    """Check `obj` (a loaded checkpoint dict) against its ``"checksums"``; True when verified, False (with a
    warning) for a checkpoint from before checksums. `only`: verify just the tensors under these top-level keys
    (e.g. the model loader skips the optimizer state it does not read). Raises :class:`CheckpointError` naming the
    file and the tensors that do not match."""
    sums = obj.get(CHECKSUMS)
    if sums is None:
        log.warning("%s: checkpoint has no per-tensor checksums (written before scratchlm recorded them): loaded "
                    "unverified", name)
        return False
    algorithm = sums.get("algorithm") if isinstance(sums, dict) else None
    if algorithm != "crc32" or not isinstance(sums.get("tensors"), dict):
        raise CheckpointError(f"{name}: the {CHECKSUMS!r} entry is damaged or of an unknown kind "
                              f"({type(sums).__name__}, algorithm {algorithm!r})")
    tensors: dict[str, torch.Tensor] = {}
    parts: list[str] = []
    _walk(obj, "", tensors, parts)
    problems = []
    if zlib.crc32("".join(parts).encode()) != sums.get("structure"):
        problems.append("its non-tensor content (keys, numbers, strings, tensor shapes) differs from what was "
                        "written")
    recorded: dict[str, int] = sums["tensors"]
    keep = tuple(only) if only is not None else None
    for key in sorted(set(tensors) | set(recorded)):
        if keep is not None and key.split("/", 1)[0] not in keep:
            continue
        if key not in recorded:
            problems.append(f"tensor {key!r} has no recorded checksum")
        elif key not in tensors:
            problems.append(f"tensor {key!r} has a checksum but is not in the file")
        else:
            got = tensor_crc32(tensors[key])
            if got != recorded[key]:
                problems.append(f"tensor {key!r} does not match its checksum (crc32 {got:08x}, recorded "
                                f"{recorded[key] & 0xFFFFFFFF:08x})")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{name}: corrupt checkpoint (a flipped bit or an edited value): "
                              + "; ".join(problems[:5]) + more + ". Restore it from a copy (a file edited on "
                              f"purpose: re-save it with save_torch_checkpoint, or delete its {CHECKSUMS!r} entry)")
    return True


def save_torch_checkpoint(obj: dict[str, Any], path: str | Path) -> Path:
    """Write the checkpoint dict `obj` with its checksums (``version`` 2) atomically: temp file in the same
    folder, fsync, rename, fsync the folder. A full disk raises :class:`scratchlm.atomic.DiskFullError` naming
    `path`; the previous file is left intact and the temp file removed."""
    path = Path(path)
    obj = {**obj, "version": max(VERSION, int(obj.get("version", VERSION)))}
    obj[CHECKSUMS] = compute_checksums(obj)
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)
    return path


# --- the model checkpoint format -----------------------------------------------------------------------------------

def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict (tensors mmap'd, weights-only unpickling, model and tokenizer checksums verified)."""
    path = require_file(Path(path), "scratchlm checkpoint")
    ckpt = load_torch_file(path, "torch checkpoint", mmap=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: not a scratchlm checkpoint (expected format 'scratchlm', found {found!r})")
    for key in ("model_config", "model"):
        if key not in ckpt:
            raise CheckpointError(f"{path}: scratchlm checkpoint has no {key!r} entry")
    verify_checksums(ckpt, str(path), only=("model", "tokenizer"))
    return ckpt


def read_checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a scratchlm checkpoint (weights-only read, mmap'd: no tensor is loaded)."""
    path = require_file(Path(path), "scratchlm checkpoint")
    ckpt = load_torch_file(path, "torch checkpoint", mmap=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model_config" not in ckpt:
        raise CheckpointError(f"{path}: not a scratchlm checkpoint with a 'model_config' entry")
    config = _config(ckpt, path)
    if isinstance(ckpt.get("model"), dict):  # its sizes against the state dict's shapes (model/loading/guard.py)
        check_state_dict(config, {_strip(k): tuple(v.shape) for k, v in ckpt["model"].items()}, str(path))
    return config


def _config(ckpt: dict[str, Any], path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(dict(ckpt["model_config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model_config ({e})") from None


def load_checkpoint_model(path: str | Path, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu") -> LoadedModel:
    """Load the model (and tokenizer, when stored) of a scratchlm checkpoint."""
    ckpt = read_checkpoint(path)
    config = _config(ckpt, Path(path))
    state = {_strip(k): v for k, v in ckpt["model"].items()}
    check_state_dict(config, {k: tuple(v.shape) for k, v in state.items()}, str(path))  # before building
    log.info("loading scratchlm checkpoint %s: %d layers, d_model %d, vocab %d", path, config.n_layers,
             config.d_model, config.vocab_size)
    model = build_model(config, state.items(), str(path), dtype, device)
    tokenizer = _tokenizer(ckpt) if ckpt.get("tokenizer") is not None else None
    return LoadedModel(model, tokenizer, config)


def _tokenizer(ckpt: dict[str, Any]) -> Any:
    try:
        from scratchlm.tokenizer import tokenizer_from_state
    except ImportError as e:
        log.warning("checkpoint has a tokenizer but scratchlm.tokenizer is unavailable (%s): tokenizer=None", e)
        return None
    return tokenizer_from_state(ckpt["tokenizer"])


def save_model(path: str | Path, model: TransformerLM, tokenizer: Any = None, **extra: Any) -> Path:
    """Write a minimal scratchlm checkpoint (model, config, tokenizer state, checksums) atomically."""
    tok_state = None
    if tokenizer is not None:
        from scratchlm.tokenizer import tokenizer_to_state

        tok_state = tokenizer_to_state(tokenizer)
    ckpt = {"format": FORMAT, "version": VERSION, "model_config": model.config.to_dict(),
            "model": model.state_dict(), "tokenizer": tok_state, **extra}
    return save_torch_checkpoint(ckpt, path)


__all__ = ["CHECKSUMS", "FORMAT", "VERSION", "compute_checksums", "load_checkpoint_model", "load_torch_file",
           "read_checkpoint", "read_checkpoint_config", "save_model", "save_torch_checkpoint", "tensor_crc32",
           "verify_checksums"]
