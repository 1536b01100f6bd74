import subprocess
import sys

import pytest

from scratchlm import cli


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "chat", "generate", "train", "tokenizer", "bench"):
        assert name in out


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_each_subcommand_help_explains_itself(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert cli.SUBCOMMANDS[name].description.split()[0] in out


def test_unlanded_subcommand_says_so_and_fails(monkeypatch, capsys):
    monkeypatch.setitem(
        cli.SUBCOMMANDS, "serve", cli.Subcommand("scratchlm._no_such_module", "s", "d", "issue X")
    )
    assert cli.main(["serve"]) == 2
    assert "not implemented yet" in capsys.readouterr().err


def test_missing_dependency_is_not_mistaken_for_unlanded(monkeypatch, tmp_path):
    pkg = tmp_path / "fakecmd.py"
    pkg.write_text("import a_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.SUBCOMMANDS, "serve", cli.Subcommand("fakecmd", "s", "d", "issue X"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["serve"])


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "scratchlm", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "tokenizer" in out.stdout


def test_bench_lists_and_rejects_unknown(capsys):
    assert cli.main(["bench"]) == 0
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["chat", "generate", "serve", "train"])
def test_help_states_each_default_once(name, capsys):
    import re

    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    out = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", out)[1:]  # one chunk per option (not the usage and description)
    for chunk in options:
        text = " ".join(chunk.split())
        # e.g. chat's "(default: its first) (default: None)"
        assert text.lower().count("(default") <= 1, text
        assert not re.search(r"None = [^()]*\(default: None\)", text), text
