"""No code runs from a checkpoint, on any path (issue 30 item 1).

Each test hands a crafted torch file to one load path: a well-formed scratchlm checkpoint (format, model_config,
model, tokenizer) with one extra entry whose unpickling calls ``exec`` to write a marker file, the classic
``__reduce__`` payload. The path must refuse it with a `CheckpointError` (or a process exit) that names the file,
and the marker must not exist afterwards: the payload never ran. Paths: single process (`load`, `LLM`, the
tokenizer loader, quantized loading), TP / PP / CP engines (rank 0), a spawned rank (the real worker entry point,
in its own process), a DP replica (the router's real replica command), training resume (`Trainer`, CS336
`load_checkpoint`), the diffusion pipeline, and fold's Boltz checkpoint reader. A last test reads the source tree:
every `torch.load` passes ``weights_only=True`` and nothing else unpickles files.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from scratchlm.model import CheckpointError, ModelConfig, TransformerLM
from scratchlm.model.loading.checkpoint import FORMAT
from tests.conftest import REPO_ROOT

TIMEOUT_S = 120  # bound on each child process (they fail in seconds; a hang fails the test instead)


class _Payload:
    """Unpickling this calls ``exec(code)``: what a malicious checkpoint carries."""

    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').write('code from a checkpoint ran')"

    def __reduce__(self):
        return (exec, (self.code,))


def _tiny_model() -> TransformerLM:
    torch.manual_seed(0)  # a shape every parallel layout accepts: TP 2 (4 heads, 2 kv heads), PP 2 (2 layers)
    return TransformerLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                     max_seq_len=64))


def write_malicious(path: Path, marker: Path, **entries) -> Path:
    """A scratchlm checkpoint that would pass every check, plus the payload."""
    model = _tiny_model()
    ckpt = {"format": FORMAT, "version": 1, "model_config": model.config.to_dict(), "model": model.state_dict(),
            "tokenizer": None, "optimizer": {}, "step": 1, "data": {}, "rng": {}, "payload": _Payload(marker),
            **entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


@pytest.fixture
def evil(tmp_path):
    marker = tmp_path / "MARKER"
    path = write_malicious(tmp_path / "evil.pt", marker)
    yield path
    assert not marker.exists(), "the checkpoint's code ran"


def _refused(path: Path):
    return pytest.raises(CheckpointError, match=rf"{path}: refused to load .*weights-only")


def test_the_payload_is_live(tmp_path):
    """The oracle: unpickled without weights_only, the file does run its code (so the tests below can fail)."""
    marker = tmp_path / "MARKER"
    path = write_malicious(tmp_path / "evil.pt", marker)
    torch.load(path, weights_only=False)
    assert marker.read_text() == "code from a checkpoint ran"


def test_single_process_loaders_refuse(evil):
    from scratchlm.inference.quantization.loading import load_model_quantized
    from scratchlm.inference.quantization.transform import load_quantized
    from scratchlm.model import load
    from scratchlm.model.loading.tokenizers import load_tokenizer
    from scratchlm.parallel.layout import read_model_config

    for loader in (load, load_tokenizer, read_model_config, load_quantized,
                   lambda p: load_model_quantized(p, "int8")):
        with _refused(evil):
            loader(evil)


def test_llm_refuses(evil):
    from scratchlm.inference import LLM

    with _refused(evil):
        LLM(str(evil))


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                   {"context_parallel_size": 2}], ids=["tp", "pp", "cp"])
def test_parallel_engines_refuse(evil, sizes):
    """Rank 0 reads the model config before it starts any rank: the file is refused there (before the fix it
    was unpickled with weights_only=False and the payload ran)."""
    from scratchlm.inference import LLM

    with _refused(evil):
        LLM(str(evil), **sizes)


def test_spawned_rank_refuses(evil):
    """A spawned rank (`python -P -m scratchlm.parallel.worker --spawned SPEC`, as `MultiprocExecutor` starts
    it) reads the file itself: it exits naming the file, before it contacts rank 0."""
    from scratchlm.inference import EngineConfig

    spec = {"rank": 1, "world_size": 2, "store": ["127.0.0.1", 9], "path": str(evil),
            "config": asdict(EngineConfig(tensor_parallel_size=2)), "threads": 1, "parent_pid": os.getpid()}
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-P", "-m", "scratchlm.parallel.worker", "--spawned", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert f"{evil}: refused to load" in proc.stderr + proc.stdout


@pytest.mark.distributed  # starts a `scratchlm serve` process (~10-20 s on a loaded 2-core machine)
def test_dp_replica_refuses(evil, capfd):
    """The router's replicas are `scratchlm serve MODEL ...` processes (`launch_replicas`): one refuses the file
    and exits, and the router reports it during start-up."""
    from scratchlm.parallel.router import RouterConfig, launch_replicas, replica_argv

    argv = replica_argv(argparse.Namespace(model=evil))
    with pytest.raises(RuntimeError, match="replica 0 exited with code"):
        launch_replicas(argv, 1, RouterConfig(startup_timeout_s=TIMEOUT_S), cwd=REPO_ROOT)
    assert f"{evil}: refused to load" in capfd.readouterr().err


def test_training_resume_refuses(evil, data_dir, tmp_path):
    from scratchlm.training import AdamW, TrainConfig, load_checkpoint
    from scratchlm.training.checkpoint import read_checkpoint
    from scratchlm.training.trainer import Trainer
    from tests.training.corpus import byte_corpus

    train, val = byte_corpus(data_dir, tmp_path / "corpus", train_bytes=4_000, val_bytes=1_000)
    cfg = TrainConfig(train_data=train, val_data=val, out_dir=tmp_path / "run", batch_size=2, context_length=16,
                      max_steps=2, resume=evil, progress=False, threads=1)
    with _refused(evil):
        Trainer(cfg, {"d_model": 32, "n_layers": 1, "n_heads": 4})
    model = _tiny_model()
    with _refused(evil):
        load_checkpoint(evil, model, AdamW(model.parameters()))
    with _refused(evil), open(evil, "rb") as f:
        read_checkpoint(f)


def test_diffusion_pipeline_refuses(tmp_path):
    """A pipeline folder's weights are safetensors (no pickle); its tokenizer.pt is a torch file."""
    from scratchlm.diffusion.pipeline import DiffusionPipeline

    marker = tmp_path / "MARKER"
    pipe = tmp_path / "pipe"
    for sub in ("tokenizer", "text_encoder", "transformer", "vae"):  # the loader checks the folders first
        (pipe / sub).mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "scratchlm.DiffusionPipeline"}))
    bad = pipe / "tokenizer" / "tokenizer.pt"
    torch.save({"tokenizer": _Payload(marker), "max_len": 8}, bad)
    with pytest.raises(CheckpointError, match=rf"{bad}: refused to load this diffusion tokenizer"):
        DiffusionPipeline.from_pretrained(pipe)
    assert not marker.exists()


def test_fold_checkpoint_refuses(tmp_path):
    from scratchlm.fold import Pairformer, PairformerConfig, load_boltz_checkpoint

    marker = tmp_path / "MARKER"
    bad = tmp_path / "boltz.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _Payload(marker)}, bad)
    cfg = PairformerConfig(c_s=16, c_z=8, num_heads=2, pair_heads=2, pair_head_dim=4, n_blocks=1)
    with pytest.raises(CheckpointError, match=rf"{bad}: refused to load this Boltz checkpoint"):
        load_boltz_checkpoint(Pairformer(cfg), bad)
    assert not marker.exists()


# --- the source tree ---------------------------------------------------------------------------------------

# Unpickling that is not a file read: results a spawned process of the same run sends back through a pipe.
PICKLE_ALLOWED = {("scratchlm/parallel/sequence.py", "loads")}


def _calls(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name):
                yield rel, node.lineno, node.func.value.id, node.func.attr, node


def test_every_file_read_in_the_tree_is_weights_only():
    """Every `torch.load` in scratchlm/ and benchmarks/ passes ``weights_only=True`` (literally), no `pickle.load`
    reads a file, and no `np.load` allows pickles."""
    problems = []
    for root in (REPO_ROOT / "scratchlm", REPO_ROOT / "benchmarks"):
        for rel, line, mod, attr, node in _calls(root):
            kw = {k.arg: k.value for k in node.keywords}
            if mod == "torch" and attr == "load":
                value = kw.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    problems.append(f"{rel}:{line}: torch.load without weights_only=True")
            elif mod in ("pickle", "cPickle", "dill", "joblib") and attr in ("load", "loads", "Unpickler"):
                if (rel, attr) not in PICKLE_ALLOWED:
                    problems.append(f"{rel}:{line}: {mod}.{attr}")
            elif mod in ("np", "numpy") and attr == "load":
                value = kw.get("allow_pickle")
                if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                    problems.append(f"{rel}:{line}: np.load with allow_pickle")
    assert not problems, "\n".join(problems)
