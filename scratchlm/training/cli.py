"""`scratchlm train`: train a transformer LM from a config file plus CLI overrides.

    scratchlm train --config tinystories --max-steps 2000 --model-d-model 384   # a shipped recipe, by name
    torchrun --nproc-per-node 2 -m scratchlm train --config run.toml      # data parallel

Values come from the field defaults, then the ``--config`` file (TrainConfig keys at the top,
ModelConfig keys in a ``[model]`` table), then the flags typed on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from scratchlm.config import add_dataclass_arguments, dataclass_from_args, from_dict, recipe_names, resolve_recipe

MODEL_PREFIX = "model_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.model import ModelConfig
    from scratchlm.training.config import TrainConfig
    from scratchlm.training.engines import ENGINES

    parser.add_argument("--config", metavar="FILE|NAME", default=None,
                        help="TOML/JSON run file: TrainConfig keys at the top, ModelConfig keys in [model]; or the "
                             f"name of a shipped recipe ({', '.join(recipe_names())})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")
    add_dataclass_arguments(parser, TrainConfig)
    add_dataclass_arguments(parser, ModelConfig, prefix=MODEL_PREFIX)
    parser.epilog = (
        "Model options (--model-*) default to the tokenizer's vocabulary and max_seq_len = context_length. "
        f"Gradient engines: {', '.join(sorted(ENGINES))} or 'package.module:function'. "
        "Launch with `torchrun --nproc-per-node N -m scratchlm train ...` for data parallelism."
    )


def configs_from_args(args: argparse.Namespace):
    """(TrainConfig, model overrides) from the config file and the typed flags."""
    from scratchlm.model import ModelConfig
    from scratchlm.training.config import TrainConfig, check_model_overrides, load_run_config

    if args.config is not None:
        base, model = load_run_config(resolve_recipe(args.config))
    else:
        base, model = from_dict(TrainConfig, {}), {}
    cfg = dataclass_from_args(TrainConfig, args, base=base)
    for f in dataclasses.fields(ModelConfig):
        value = getattr(args, MODEL_PREFIX + f.name, None)
        if value is not None:
            model[f.name] = value
    check_model_overrides(model)
    return cfg, model


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    from scratchlm.training.checkpoint import CheckpointError
    from scratchlm.training.data import TokenFileError
    from scratchlm.training.trainer import Trainer

    try:
        cfg, model = configs_from_args(args)
        trainer = Trainer(cfg, model)
    except (ValueError, FileNotFoundError, CheckpointError, TokenFileError) as e:
        print(f"scratchlm train: error: {e}", file=sys.stderr)
        return 2
    from scratchlm.atomic import DiskFullError

    try:
        result = trainer.train()
    except DiskFullError as e:  # the message names the file, says the disk is full, and that the last one is intact
        print(f"scratchlm train: error: {e}", file=sys.stderr)
        return 1
    if trainer.ctx.is_main and result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    from scratchlm.training.distributed import shutdown_distributed

    shutdown_distributed(trainer.ctx)
    return 0
