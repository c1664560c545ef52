"""Every flag of every `peer` command says what it does and what it defaults to."""

from __future__ import annotations

import argparse

from hivetrain.peer.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_has_help_with_its_default() -> None:
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        one_of = {a for g in sub._mutually_exclusive_groups if g.required for a in g._group_actions}
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings or action in one_of:
                continue
            if action.help == argparse.SUPPRESS:
                missing.append(f"{name} {action.option_strings[0]}: hidden")
                continue
            text = action.help or ""
            if action.required or "(only" in text:
                continue
            if not text or "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}: {text!r}")
    hidden = {f"start {flag}: hidden" for flag in ("--fault", "--fault-log")}  # test hooks (peer/faults.py)
    assert set(missing) == hidden, sorted(set(missing) - hidden)
