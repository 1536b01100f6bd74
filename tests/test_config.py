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
