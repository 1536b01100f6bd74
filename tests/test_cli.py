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


# ---------------------------------------------------------------- --device: one clear line, before any model loads

UNUSABLE_DEVICES = ["cuda:99", "mps", "xpu:7", "not-a-device"]  # unusable on any test machine (cuda:99: too high)


def test_unusable_device_is_one_line_in_a_real_process():
    out = subprocess.run([sys.executable, "-m", "scratchlm", "generate", "--model", "no-such-model", "--device",
                          "cuda:99", "Once"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda:99" in lines[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("device", UNUSABLE_DEVICES)
@pytest.mark.parametrize("argv", [["generate", "--model", "no-such-model", "Once"], ["chat", "no-such-model"],
                                  ["serve", "no-such-model"], ["train"]])
def test_unusable_device_is_refused_by_every_subcommand(argv, device, capsys):
    assert cli.main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--device {device}" in err and err.startswith(f"scratchlm {argv[0]}:"), err


def test_device_check_names_the_reason():
    assert cli.device_problem("cpu") is None and cli.device_problem("auto") is None
    assert "not a torch device" in cli.device_problem("gpu")
    assert "use --device cpu" in cli.device_problem("mps") or "visible" in cli.device_problem("mps")


# ---------------------------------------------------------- a mistyped flag: the subcommand's usage, the closest flag


def test_mistyped_flag_shows_the_subcommands_usage_and_the_closest_flag():
    out = subprocess.run([sys.executable, "-m", "scratchlm", "generate", "--temprature", "0.8", "Once"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: scratchlm generate"), out.stderr
    assert "--temprature (did you mean --temperature?)" in out.stderr


@pytest.mark.parametrize("argv,typo,meant", [
    (["serve", "--prot", "8001"], "--prot", "--port"),
    (["chat", "--max-tokns=5"], "--max-tokns=5", "--max-tokens"),
    (["tokenizer", "train", "--inptu", "x.txt"], "--inptu", "--input"),
])
def test_mistyped_flag_suggestions(argv, typo, meant, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{typo} (did you mean {meant}?)" in err
    assert f"usage: scratchlm {' '.join(a for a in argv[:2] if not a.startswith('-'))}" in err.splitlines()[0], err


def test_unknown_flag_without_a_close_one_is_listed_plainly(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--zzzzqqq", "Once"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err
