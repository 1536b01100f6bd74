import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from scratchlm.config import add_dataclass_arguments, dataclass_from_args, load_config


@dataclass
class Cfg:
    lr: float = field(default=1e-3, metadata={"help": "learning rate"})
    steps: int = 10
    name: str = "run"
    compile: bool = False
    device: Literal["cpu", "cuda"] = "cpu"
    out: Path | None = None
    files: list[str] = field(default_factory=list)


def parse(argv, base=None):
    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, Cfg)
    return dataclass_from_args(Cfg, p.parse_args(argv), base=base)


def test_defaults_and_overrides():
    assert parse([]) == Cfg()
    c = parse(["--lr", "0.5", "--steps", "3", "--compile", "--device", "cuda", "--out", "x", "--files", "a", "b"])
    assert c == Cfg(lr=0.5, steps=3, compile=True, device="cuda", out=Path("x"), files=["a", "b"])


def test_file_then_flags_priority(tmp_path):
    (tmp_path / "c.toml").write_text('lr = 0.1\nsteps = 7\nname = "file"\n')
    base = load_config(Cfg, tmp_path / "c.toml")
    assert base.lr == 0.1 and base.steps == 7
    c = parse(["--steps", "9"], base=base)
    assert (c.lr, c.steps, c.name) == (0.1, 9, "file")
    (tmp_path / "c.json").write_text(json.dumps({"steps": 4}))
    assert load_config(Cfg, tmp_path / "c.json").steps == 4


@pytest.mark.parametrize(
    "text, match",
    [("lrr = 0.1", "unknown option"), ('steps = "many"', "expected int"), ('device = "tpu"', "not one of"),
     ("steps = [", "not a valid TOML")],
)
def test_bad_config_files_name_the_problem(tmp_path, text, match):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(Cfg, tmp_path / "c.toml")


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(Cfg, tmp_path / "nope.toml")


def test_grouped_sub_configs_as_flags_and_tables(tmp_path):
    """ModelConfig's feature groups (rope, attn, norm, mlp) are --<group>-<field> flags and nested TOML tables,
    merged over the base's group field by field."""
    import argparse

    from scratchlm.config import add_dataclass_arguments, dataclass_from_args, load_config
    from scratchlm.model.config import ModelConfig

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, ModelConfig, prefix="model_")
    args = parser.parse_args(["--model-rope-scaling", "linear", "--model-rope-factor", "2", "--model-mlp-act",
                              "gelu_tanh", "--model-n-layers", "2"])
    base = ModelConfig(attn={"qk_norm": "head"}, rope={"original_max_seq_len": 64})
    cfg = dataclass_from_args(ModelConfig, args, base=base, prefix="model_")
    assert (cfg.rope.scaling, cfg.rope.factor, cfg.rope.original_max_seq_len) == ("linear", 2.0, 64)
    assert (cfg.mlp.act, cfg.attn.qk_norm, cfg.n_layers) == ("gelu_tanh", "head", 2)
    path = tmp_path / "m.toml"
    path.write_text('d_model = 64\nn_heads = 4\n[norm]\nplacement = "sandwich"\n[attn]\nsliding_window = 8\n')
    cfg = load_config(ModelConfig, path)
    assert cfg.norm.placement == "sandwich" and cfg.attn.sliding_window == 8 and cfg.window(0) == 8
    path.write_text('[norm]\nplacement = "diagonal"\n')
    with pytest.raises(ValueError, match="placement"):
        load_config(ModelConfig, path)
