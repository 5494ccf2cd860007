"""mkdocs hooks: the spec/ documents become pages of the site, links to them work in both places,
and the CLI page shows every command's own ``--help``.

The README and the pages under docs/ link spec documents by their place in the repository
(``../spec/tape-format.md`` from a docs page), which is what GitHub and
tests/e2e/test_readme.py resolve. The site serves spec/ beside the docs pages, so a link
that lands in spec/ on disk is rewritten to the page's site-relative path; any other link
is left alone, and mkdocs' strict validation fails on one that goes nowhere.

A page line ``<!-- ckpt-help -->`` becomes the help of ``ckpt`` and of every command and
subcommand, as click prints it: the reference cannot drift from the options the code takes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
_HELP_MARKER = "<!-- ckpt-help -->"
_HELP_WIDTH = 100


def on_files(files: Files, config: Any) -> Files:
    """Add every spec/*.md as a page at ``spec/NAME/`` of the site."""
    for path in sorted(SPEC.glob("*.md")):
        files.append(File(f"spec/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point links that reach spec/ on disk at the spec pages of the site."""
    here = Path(page.file.abs_src_path).parent
    site_dir_of_page = Path(page.file.src_uri).parent

    def fix(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:", target):
            return m.group(0)
        on_disk = (here / target).resolve()
        try:
            rel = on_disk.relative_to(SPEC)
        except ValueError:
            return m.group(0)
        site_rel = os.path.relpath(Path("spec") / rel, site_dir_of_page).replace(os.sep, "/")
        return f"{m.group(1)}{site_rel}{m.group(3) or ''}{m.group(4)}"

    markdown = _LINK.sub(fix, markdown)
    if _HELP_MARKER in markdown:
        markdown = markdown.replace(_HELP_MARKER, _cli_help())
    return markdown


def _cli_help() -> str:
    """``ckpt --help`` and each command's, subcommands included, as markdown sections."""
    import click

    from ckpt_cli.main import cli

    out: list[str] = []

    def walk(cmd: click.Command, parent: click.Context | None, path: list[str]) -> None:
        settings = {**cmd.context_settings, "terminal_width": _HELP_WIDTH, "max_content_width": _HELP_WIDTH}
        ctx = click.Context(cmd, info_name=path[-1], parent=parent, **settings)
        out.append(f"### `{' '.join(path)}`\n\n```text\n{cmd.get_help(ctx)}\n```\n")
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None:
                    walk(sub, ctx, [*path, name])

    walk(cli, None, ["ckpt"])
    return "\n".join(out)
