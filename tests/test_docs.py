"""The docs stay true to the code: the config table is generated from hetjax/config.py,
the README stays short and keeps CI's command, and every relative link resolves."""

import re
import subprocess
import sys
from pathlib import Path

from hetjax.config import all_keys, markdown_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG_MD = ROOT / "docs" / "guide" / "config.md"
README_MAX_LINES = 250
# The README's other fresh-machine command (CI runs the test one, read from .ci/run).
DEFAULT_RUN = (
    "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/python -m hetjax.launch"
)


def test_config_doc_is_generated_from_config_py():
    out = subprocess.run(
        [sys.executable, "-m", "hetjax.config", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == CONFIG_MD.read_text(), (
        "docs/guide/config.md is out of date with hetjax/config.py; regenerate it with "
        "`python -m hetjax.config --markdown > docs/guide/config.md`"
    )


def test_config_table_has_every_key():
    table = markdown_table()
    missing = [k for k in all_keys() if f"| `{k}` |" not in table]
    assert not missing, f"keys missing from the config table: {missing}"


def _ci_test_command() -> str:
    lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if "pip install" in line and "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(lines) == 1, f".ci/run: expected one pip + pytest command line, got {lines}"
    return lines[0]


def test_readme_is_short_and_keeps_the_fresh_machine_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move detail "
        "into docs/guide/ or docs/results/"
    )
    for command in (_ci_test_command(), DEFAULT_RUN):
        assert command in lines, f"README.md lost the fresh-machine command line {command!r}"


# -- links -------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in _HEADING.findall(_FENCE.sub("", path.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_markdown_files_exist():
    names = {p.relative_to(ROOT).as_posix() for p in _markdown_files()}
    assert {"docs/design.md", "docs/guide/config.md"} <= names


def test_relative_links_resolve():
    broken = []
    for md in _markdown_files():
        for target in _LINK.findall(_prose(md.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            path = (md.parent / file_part).resolve() if file_part else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not path.exists():
                broken.append(f"{where}: no file {file_part}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{where}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
