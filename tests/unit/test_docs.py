"""What a user copies from README.md and docs/ works: every `dsv4` command in a shell block
parses with the real parser, every flag a doc names for a `dsv4` subcommand exists, every
`make` target named is in the Makefile, and every relative link reaches a file and heading.

Parsing only: nothing runs, so the long commands (a full-size `dsv4 up`) cost nothing here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dsv4.commands.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "router_svc/README.md"]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", re.S)
INLINE_COMMAND = re.compile(r"`dsv4 ([a-z][a-z-]*)([^`]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


SUBS = _subparsers()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def shell_commands(text: str) -> list[str]:
    """The `dsv4 ...` commands of a doc's shell blocks: continuation lines joined, a trailing
    comment, redirection or `&` left off."""
    out = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split()).removeprefix("$ ")
            if line.startswith("dsv4 "):
                out.append(re.split(r"\s(?:&&|\|\|?|;|&|>|2>)(?:\s|$)|\s#", line)[0].strip())
    return out


def parse_error(command: str) -> str | None:
    """None when `dsv4` accepts the command line, else argparse's message (or what is left)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, extra = build_parser().parse_known_args(shlex.split(command)[1:])
            if extra and getattr(args, "accepts_extra_args", False):  # `up` passes them on
                _, extra = SUBS["prefill"].parse_known_args(extra)
    except SystemExit:
        return err.getvalue().strip() or "rejected"
    return f"unrecognized arguments: {' '.join(extra)}" if extra else None


def unknown_flags(text: str) -> list[str]:
    """`dsv4 SUB ... --flag` in inline code whose flag SUB (or, for up/demo, a service) lacks."""
    bad = []
    for sub, rest in INLINE_COMMAND.findall(text):
        if sub not in SUBS:
            bad.append(f"dsv4 {sub}: no such command")
            continue
        known = _options(SUBS[sub]) | _options(build_parser())
        if sub in ("up", "demo"):
            known |= _options(SUBS["prefill"])
        bad += [f"dsv4 {sub} {f}" for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
                if f not in known]  # fmt: skip
    return bad


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped)."""
    out, seen = set(), {}
    text = SHELL_BLOCK.sub("", path.read_text())
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for link in LINK.findall(SHELL_BLOCK.sub("", path.read_text())):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target) if target else path
        if not file.exists():
            bad.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{link}: no such heading")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_dsv4_command_in_a_shell_block_parses(doc: Path) -> None:
    failures = [f"{c}: {e}" for c in shell_commands(doc.read_text()) if (e := parse_error(c))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_flag_named_for_a_dsv4_command_exists(doc: Path) -> None:
    assert not unknown_flags(doc.read_text())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_reach_a_file_and_heading(doc: Path) -> None:
    assert not broken_links(doc)


def test_every_make_target_named_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    named = {t for doc in DOCS for t in re.findall(r"`make ([\w-]+)", doc.read_text())}
    assert named and named <= targets, named - targets


def test_the_checks_see_a_bad_command_flag_and_link(tmp_path: Path) -> None:
    """The checkers against a doc with one of each mistake (the real docs have none)."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Run it\n```bash\ndsv4 up --num-prefills 2 \\\n  --http-port 8000 &\n"
        "dsv4 plan --shape flash --gpu-mem 80  # fits\n```\n"
        "`dsv4 loadtest --target H:P --no-such-flag` and `dsv4 serve`; [ok](#run-it), "
        "[gone](missing.md), [typo](#run-itt)\n"
    )
    text = doc.read_text()
    assert shell_commands(text) == ["dsv4 up --num-prefills 2 --http-port 8000",
                                    "dsv4 plan --shape flash --gpu-mem 80"]  # fmt: skip
    assert "--num-prefills" in parse_error(shell_commands(text)[0])
    assert parse_error(shell_commands(text)[1]) is None
    assert unknown_flags(text) == ["dsv4 loadtest --no-such-flag", "dsv4 serve: no such command"]
    assert broken_links(doc) == ["missing.md: no such file", "#run-itt: no such heading"]
