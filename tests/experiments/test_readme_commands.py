"""Every `python -m experiments.NAME --flags` command the README quotes still parses: a
validator made stricter must not refuse a documented run (`--batch_sizes=` of kv_dtypes, the
quality sweep alone, was refused once)."""

from __future__ import annotations

import importlib
import os
import re
import shlex

import pytest

from experiments.common import REPO
from tests.experiments.flags_util import parses

# README shorthand for a value the reader picks: --dtype=D, --llama_server=..., --draft_confidence=τ.
PLACEHOLDER = re.compile(r"=(D|N|τ|\.\.\.)$")


def readme_commands() -> list[tuple[str, list[str]]]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    commands = {}
    for name, rest in re.findall(r"`(?:\.venv/bin/)?python -m experiments\.(\w+)([^`]*)`", text):
        argv = [a for a in shlex.split(rest) if a.startswith("--")]
        if not any(PLACEHOLDER.search(a) for a in argv):
            commands[(name, tuple(argv))] = None
    return [(name, list(argv)) for name, argv in commands]


COMMANDS = readme_commands()


def test_the_readme_quotes_commands() -> None:
    assert len(COMMANDS) >= 50  # the pattern still finds them


@pytest.mark.parametrize("name, argv", COMMANDS, ids=[f"{n} {' '.join(a)}"[:90] for n, a in COMMANDS])
def test_a_readme_command_parses(name: str, argv: list[str]) -> None:
    parses(importlib.import_module(f"experiments.{name}").FLAGS, *argv)
