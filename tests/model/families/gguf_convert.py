"""Tiny GGUFs written by llama.cpp's own `convert_hf_to_gguf.py`, the one the llama-cpp-python sdist vendors.

The sdist lands in `.peers/` (`python -m benchmarks.llamacpp_decode --setup-peers`, or just its download and
unpack step); nothing here downloads. `convert_dir()` is None when it is absent, and the tests skip.

Each tiny HF checkpoint (`tiny.save_tiny`) gets a tokenizer the converter accepts for its family:

- SentencePiece families (llama, mistral, qwen2/qwen3, gemma 1-3, phi3, granite: convert tries `tokenizer.model`
  first): a SentencePiece BPE model of exactly `vocab_size` pieces trained here (~30 ms). Gemma's has no dummy
  prefix, as Google's, since convert writes `add_space_prefix = false` for Gemma.
- byte-level BPE families (gpt2, olmo2, qwen2_moe / qwen3_moe, deepseek: convert only reads `tokenizer.json` through
  `AutoTokenizer`): a
  `tokenizers` byte-level BPE of `vocab_size` tokens with GPT-2's pre-tokenizer. convert identifies the
  pre-tokenizer by hashing the ids of a fixed text and refuses unknown hashes (a trained tiny vocabulary never
  matches a published one), so for these the run subclasses convert's model class with one override,
  `get_vocab_base_pre` -> "gpt-2", the name convert writes for GPT-2's own tokenizer. Every other step (tensor
  names and transforms, metadata) is convert's code.

All conversions of a session run in one subprocess (`python gguf_convert.py jobs.json`): importing convert costs
seconds, converting a tiny model a fraction of one.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

#: Families whose converter reads a byte-level BPE `tokenizer.json` only.
BPE_CASES = {"gpt2", "olmo2", "qwen2_moe", "qwen2_moe_sparse", "qwen3_moe", "qwen3_moe_sparse", "deepseek_v2",
             "deepseek_v2_groups", "deepseek_v3", "deepseek_v3_yarn", "deepseek_v3_mscale"}
#: SentencePiece models without the dummy space prefix (Gemma's; convert writes add_space_prefix = false).
NO_DUMMY_PREFIX = {"gemma", "gemma2", "gemma3"}
#: The pre-tokenizer name given to convert for the tiny byte-level BPEs (their pre-tokenizer is GPT-2's).
BPE_PRE = "gpt-2"

TEXT = (
    "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog, Max. "
    "One day they found a big red ball under a tree. Lily said, \"Look, Max! A ball!\" Max barked and ran to it. "
    "They played all day until the sun went down. Then Lily's mom called them home for dinner. "
    "The next morning it was raining, so Lily stayed inside and read a book about the sea, the fish and the "
    "boats. She wanted to be a sailor when she grew up. 1 2 3 4 5 6 7 8 9 10 11 12 2024.\n"
)


def convert_dir() -> Path | None:
    """llama.cpp's sources in the unpacked sdist, or None when `.peers/` has no sdist."""
    from benchmarks.llamacpp_decode import SDIST_DIR

    path = SDIST_DIR / "vendor" / "llama.cpp"
    return path if (path / "convert_hf_to_gguf.py").is_file() else None


def write_sentencepiece(directory: Path, vocab_size: int, dummy_prefix: bool = True) -> None:
    """`tokenizer.model`: a SentencePiece BPE of exactly `vocab_size` pieces (<unk> <s> </s> first)."""
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [ln for ln in (TEXT * 4).split(". ") if ln.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    (directory / "tokenizer.model").write_bytes(model.getvalue())


def write_byte_level_bpe(directory: Path, vocab_size: int) -> None:
    """`tokenizer.json` (+ a config naming the fast tokenizer): a byte-level BPE of at most `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"trained {tok.get_vocab_size()} tokens for a vocabulary of {vocab_size}")
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_prefix_space": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_tokenizer(name: str, directory: Path, vocab_size: int) -> str:
    """The tokenizer convert reads for case `name`; returns its kind ("spm" or "bpe")."""
    if name in BPE_CASES:
        write_byte_level_bpe(directory, vocab_size)
        return "bpe"
    write_sentencepiece(directory, vocab_size, dummy_prefix=name not in NO_DUMMY_PREFIX)
    return "spm"


def convert(jobs: list[dict], timeout: float = 600.0) -> None:
    """Run convert on every job ({"dir", "out", "outtype" ("f32"/"q8_0"), "bpe_pre": str | None}) in one
    subprocess; raises RuntimeError with convert's output when it fails."""
    src = convert_dir()
    if src is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not in .peers/ (benchmarks/llamacpp_decode.py)")
    spec = Path(jobs[0]["out"]).parent / "convert_jobs.json"
    spec.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, __file__, str(src), str(spec)], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"convert_hf_to_gguf failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-8000:]}")


def _run(src: Path, spec: Path) -> None:
    """In the subprocess: convert's own model classes write each job's GGUF (see the module docstring)."""
    import logging

    sys.path.insert(0, str(src))
    logging.basicConfig(level=logging.WARNING)
    import convert_hf_to_gguf  # noqa: F401  (puts the vendored gguf-py first on sys.path, as its main does)
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    ftypes = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    for job in json.loads(spec.read_text()):
        directory = Path(job["dir"])
        hparams = ModelBase.load_hparams(directory, False)
        cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
        if job.get("bpe_pre"):
            pre = job["bpe_pre"]
            cls = type(cls.__name__, (cls,), {"model_arch": cls.model_arch,
                                             "get_vocab_base_pre": lambda self, tokenizer, pre=pre: pre})
        with torch.inference_mode():
            model = cls(directory, ftypes[job["outtype"]], Path(job["out"]), eager=True)
            model.write()


if __name__ == "__main__":
    _run(Path(sys.argv[1]), Path(sys.argv[2]))
