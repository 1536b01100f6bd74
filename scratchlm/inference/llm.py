"""`LLM`: the offline, vLLM-style API: `LLM(model).generate(prompts, SamplingParams(...))`.

`LLM.close()` (or leaving ``with LLM(...) as llm:``) finishes the step trace, if any, and stops the executor's
ranks; it is also what the engine's collection and interpreter exit do. A trace file is strict JSON after every
step already (inference/trace.py), so it reads as JSON after `generate`, after ``del llm`` and after an exit that
closed nothing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from scratchlm.inference.config import EngineConfig
from scratchlm.inference.engine import LLMEngine
from scratchlm.inference.outputs import RequestOutput
from scratchlm.inference.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model and generate for a list of prompts with continuous batching.

    `model` is an HF directory, a .gguf, a llama2.c .bin, a scratchlm checkpoint, or None for the
    default model (SmolLM2-135M-Instruct). Keyword arguments are `EngineConfig` fields (e.g.
    ``tokenizer=PATH`` for a model that has none). `threads` sets torch's CPU threads for the process:
    None keeps a count the program already set with ``torch.set_num_threads``, else applies the shared
    policy of `scratchlm.threads` (``$OMP_NUM_THREADS`` if set, else the free physical cores split over
    the ranks); the choice is logged on ``scratchlm.threads``.
    """

    def __init__(self, model: str | Path | None = None, threads: int | None = None, **engine_options: Any):
        from scratchlm.threads import apply_threads

        config = EngineConfig(**engine_options)
        apply_threads(threads, world_size=config.world_size, keep_caller_setting=True)
        self.engine = LLMEngine.from_pretrained(model, config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        self = cls.__new__(cls)
        self.engine = engine
        return self

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Finish the step trace (the other ranks' spans, then the file) and stop the ranks, if any (idempotent);
        the LLM cannot generate afterwards."""
        engine = self.__dict__.get("engine")
        if engine is None:
            return
        if engine.tracer is not None:
            engine.tracer.close()
        engine.shutdown()
        self._closed = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (a string, a list of token ids, or a list of either)."""
        if getattr(self, "_closed", False):
            raise RuntimeError("this LLM is closed (LLM.close() or the end of its `with` block): make a new one")
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids = [f"llm-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(prompts) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in ids and out.request_id not in done:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in done:
                    engine.abort_request(rid)
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
