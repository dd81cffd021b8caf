"""`gpufed`'s parser as a user meets it: every flag described, defaults in the help,
`--version`, and completion scripts that bash (and zsh, where installed) really complete with."""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpufed import cli


def _commands(
    parser: argparse.ArgumentParser, path: str = "gpufed"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{path} {name}")


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_flag_and_argument_of_every_command_is_described() -> None:
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in _commands(cli.build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "flag", "default"),
    [
        pytest.param(["list"], "--limit LIMIT", "(default: 500)", id="list --limit"),
        pytest.param(["list"], "--sort {newest,oldest}", "(default: newest)", id="list --sort"),
        pytest.param(["get"], "--broker BROKER", "(default: http://127.0.0.1:8080)", id="broker"),
        pytest.param(["broker"], "--port PORT", "(default: 8080)", id="broker --port"),
        pytest.param(["broker"], "--heartbeat HEARTBEAT", "(default: 5.0)", id="heartbeat"),
        pytest.param(
            ["agent"], "--backend {simulated,kubernetes}", "(default: simulated)", id="backend"
        ),
        pytest.param(["demo"], "--jobs JOBS", "(default: 72)", id="demo --jobs"),
    ],
)
def test_help_shows_each_flags_default(
    argv: list[str],
    flag: str,
    default: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line a flag
    monkeypatch.delenv("GPUFED_BROKER", raising=False)
    lines = _help(argv, capsys).splitlines()
    [at] = [n for n, line in enumerate(lines) if line.strip().startswith(flag)]
    described = lines[at].strip().removeprefix(flag).strip() or lines[at + 1].strip()  # long
    assert described.endswith(default), described


def test_help_says_no_default_where_there_is_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    for path, _ in _commands(cli.build_parser()):
        text = _help(path.split()[1:], capsys)
        assert "(default: None)" not in text and "(default: False)" not in text, path
        assert not re.search(r"default.*\(default: ", text), path  # said twice


def test_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpufed.cli", "--version"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0
    assert re.fullmatch(r"gpufed \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout


@functools.cache
def _script(shell: str) -> str:
    """`gpufed completion SHELL`'s output (run once: the parser is the same each time)."""
    done = subprocess.run(
        [sys.executable, "-m", "gpufed.cli", "completion", shell],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _complete(shell: str, words: list[str]) -> list[str]:
    """What `gpufed completion SHELL` offers for the last of `words`, run in that shell."""
    script = _script(shell)
    quoted = " ".join(f"'{w}'" for w in words)
    if shell == "bash":
        call = (
            f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _gpufed; "
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        argv = ["bash", "--norc", "--noprofile", "-c", f"{script}\n{call}"]
    else:  # bashcompinit's compgen, as zsh's completion calls it (zsh then filters by prefix)
        call = f'COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; compgen -F _gpufed -- ""'
        argv = ["zsh", "-f", "-c", f"{script}\n{call}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert done.stderr == ""
    offered = done.stdout.split()
    prefix = words[-1]
    return [word for word in offered if word.startswith(prefix)]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize(
    ("words", "expected"),
    [
        pytest.param(["gpufed", "li"], ["list"], id="a command"),
        pytest.param(["gpufed", "list", "-o", ""], ["table", "wide", "json"], id="-o of list"),
        pytest.param(["gpufed", "get", "-o", ""], ["table", "json"], id="-o of get"),
        pytest.param(["gpufed", "get", "--w"], ["--watch"], id="a flag"),
        pytest.param(["gpufed", "token", "create", "--ro"], ["--role"], id="a sub-command's"),
        pytest.param(["gpufed", "completion", ""], ["bash", "zsh"], id="a choice"),
    ],
)
def test_completion_completes_commands_flags_and_choices(
    shell: str, words: list[str], expected: list[str]
) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed: its completion script is not run")
    assert _complete(shell, words) == expected
