"""Executors: the engine is given one, and inference/ (and the server) never import parallel/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scratchlm
from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.executor import Executor, UniProcExecutor, default_executor_class, resolve_executor

from .helpers import CharTokenizer, block_bytes, naive_greedy, tiny_model

PACKAGE = Path(scratchlm.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, at any depth (function-local ones too), relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(("scratchlm", *path.relative_to(PACKAGE).with_suffix("").parts[:-1]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # `from scratchlm import parallel`
    return found


@pytest.mark.parametrize("layer", ["inference", "server"])
def test_layer_never_imports_parallel(layer) -> None:
    """Dependencies point one way: parallel/ plugs into the engine (an executor) and the CLI from above."""
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
                 for path in sorted((PACKAGE / layer).rglob("*.py"))
                 for line, module in _imports(path)
                 if module == "scratchlm.parallel" or module.startswith("scratchlm.parallel.")]
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_every_kind_of_import(monkeypatch) -> None:
    fake = PACKAGE / "inference" / "_scan_probe.py"  # a path inside the package, never written: parsed from text
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: (
        "import scratchlm.parallel.comm\nfrom scratchlm import parallel\n"
        "def f():\n    from ..parallel.launch import x\n"))
    assert [m for _, m in _imports(fake) if "parallel" in m] == [
        "scratchlm.parallel.comm", "scratchlm.parallel", "scratchlm.parallel.launch", "scratchlm.parallel.launch.x"]


class CountingExecutor(UniProcExecutor):
    """A user-supplied executor: the engine must run every forward through it."""

    instances: list[CountingExecutor] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.stopped = False
        CountingExecutor.instances.append(self)

    def start(self, num_blocks):
        runner = super().start(num_blocks)
        execute = runner.execute

        def counted(inp):
            self.steps += 1
            return execute(inp)

        runner.execute = counted
        return runner

    def shutdown(self) -> None:
        self.stopped = True


def test_engine_runs_through_the_executor_it_is_given() -> None:
    model, cfg = tiny_model()
    config = EngineConfig(kv_cache_memory=64 * block_bytes(cfg, 16))
    executor = CountingExecutor(model, cfg, CharTokenizer(cfg.vocab_size), config)
    assert isinstance(executor, Executor)
    engine = LLMEngine(None, CharTokenizer(cfg.vocab_size), cfg, config, executor=executor)
    assert engine.executor is executor and engine.runner is executor.runner
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.outputs[0].token_ids
    assert got == naive_greedy(tiny_model()[0], [1, 2, 3], 6)  # the same weights, a model no engine has run
    assert executor.steps >= 6
    engine.shutdown()
    assert executor.stopped


def test_from_pretrained_takes_an_executor_class(data_dir) -> None:
    stories = data_dir / "models/stories260K/stories260K.bin"
    CountingExecutor.instances.clear()
    engine = LLMEngine.from_pretrained(stories, EngineConfig(max_num_seqs=2), executor_class=CountingExecutor)
    assert CountingExecutor.instances == [engine.executor]
    engine.add_request("a", "Once", SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.executor.steps >= 3


def test_default_executor_by_world_size() -> None:
    assert default_executor_class(EngineConfig()) is UniProcExecutor
    from scratchlm.parallel.launch import MultiprocExecutor  # a test may import both sides

    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"context_parallel_size": 2}):
        assert default_executor_class(EngineConfig(**sizes)) is MultiprocExecutor
    assert resolve_executor("scratchlm.inference.executor:UniProcExecutor") is UniProcExecutor
    for bad in ("scratchlm.inference.executor", "no.such.module:X", "scratchlm.inference.executor:Nope"):
        with pytest.raises(ValueError, match="executor"):
            resolve_executor(bad)


def test_context_parallel_needs_the_multiprocess_executor() -> None:
    model, cfg = tiny_model()
    with pytest.raises(ValueError, match="context_parallel_size=2 needs the multi-process runner"):
        LLMEngine(model, CharTokenizer(cfg.vocab_size), cfg, EngineConfig(context_parallel_size=2))
