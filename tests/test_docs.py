"""The docs stay true to the code: the config table is generated from hetjax/config.py,
the README stays short and keeps CI's command, every relative link resolves, every
module path cited exists, docs/design.md names every module and its dependency list is
what the imports do, and one word names each concept."""

import ast
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


# -- design.md against the code ------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"
_PATH = re.compile(r"\b((?:hetjax|models)/[A-Za-z0-9_/]+\.(?:py|cc)|docs/[A-Za-z0-9_/.-]+\.md)\b")
# a path inside hetjax/ without it, as docstrings cite their neighbours: runtime/loop/window.py
_SHORT_PATH = re.compile(
    r"(?<![\w/.])((?:storage|optimizer|parallel|runtime|planning|bench)/[\w/]+\.(?:py|cc))\b"
)
_GROUP_HEADING = re.compile(r"^### `(\w+)`", re.M)
_EDGE = re.compile(r"^(\w+)\s*->\s*(.*?)\s*$")


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown page."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _modules() -> list[str]:
    """Every module file of hetjax/ and models/, as a path from the repository root."""
    files = [*(ROOT / "hetjax").rglob("*.py"), *(ROOT / "models").rglob("*.py")]
    return sorted(p.relative_to(ROOT).as_posix() for p in files)


def _table_groups() -> dict[str, str]:
    """Module path -> its group, from design.md's modules table: each ``### `group```
    heading's table rows name its modules by path (a row may name several)."""
    modules = _section(DESIGN.read_text(), "Modules")
    groups: dict[str, str] = {}
    doubled = []
    for i, part in enumerate(_GROUP_HEADING.split(modules)[1:]):
        if i % 2 == 0:
            group = part
            continue
        for row in (line for line in part.splitlines() if line.startswith("| `")):
            for path in _PATH.findall(row.split("|")[1]):
                if groups.setdefault(path, group) != group:
                    doubled.append(path)
    assert not doubled, f"docs/design.md names these modules under two groups: {doubled}"
    return groups


def _group_of(path: str, groups: dict[str, str]) -> str | None:
    """A module's group; a package's ``__init__.py`` is its modules' group where they
    share one (``hetjax/__init__.py`` spans them all: none)."""
    if path in groups:
        return groups[path]
    if path.endswith("/__init__.py"):
        package = path.rpartition("/")[0] + "/"
        siblings = {g for p, g in groups.items() if p.rpartition("/")[0] + "/" == package}
        if len(siblings) == 1:
            return siblings.pop()
    return None


def _target(name: str) -> str | None:
    """The module file a dotted import name loads (its deepest existing module), or
    None for names outside the project."""
    parts = name.split(".")
    if parts[0] not in ("hetjax", "models"):
        return None
    while parts:
        base = ROOT.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate.relative_to(ROOT).as_posix()
        parts = parts[:-1]
    return None


def _imports(path: str) -> set[str]:
    """The project module files ``path`` imports, at module level or inside functions."""
    package = path.split("/")[:-1]
    names = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names += [f"{base}.{a.name}" for a in node.names]
    return {t for t in map(_target, names) if t is not None}


def _import_graph(groups: dict[str, str]) -> dict[str, set[str]]:
    """Group -> the other groups its modules import, computed from the code."""
    graph: dict[str, set[str]] = {g: set() for g in groups.values()}
    for path in _modules():
        source = _group_of(path, groups)
        for target in _imports(path):
            dest = _group_of(target, groups)
            if source is None or dest is None:
                continue  # a module in no group fails test_design_names_every_module
            if dest != source:
                graph[source].add(dest)
    return graph


def _diagram() -> dict[str, set[str]]:
    """Group -> the groups it imports, from design.md's dependency list (the fenced
    block of ``group -> group, group`` lines under ## Dependencies)."""
    block = _FENCE.search(_section(DESIGN.read_text(), "Dependencies"))
    assert block, "docs/design.md: no fenced dependency list under ## Dependencies"
    graph: dict[str, set[str]] = {}
    for line in block.group(0).splitlines()[1:-1]:
        m = _EDGE.match(line.strip())
        assert m, f"docs/design.md dependency list: not 'group -> groups': {line!r}"
        deps = m.group(2)
        assert m.group(1) not in graph, f"docs/design.md dependency list: {line!r} again"
        graph[m.group(1)] = set() if deps == "(nothing)" else {d.strip() for d in deps.split(",")}
    return graph


def test_design_names_every_module():
    groups = _table_groups()
    missing = [p for p in _modules() if not p.endswith("__init__.py") and p not in groups]
    assert not missing, (
        "docs/design.md's modules table does not name these modules by path (add a row "
        f"under their group's ### heading): {missing}"
    )


def test_cited_module_paths_exist():
    sources = [*_markdown_files()]
    for top in ("hetjax", "models"):
        sources += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in (".py", ".cc")]
    stale = []
    for source in sources:
        for n, line in enumerate(source.read_text().splitlines(), 1):
            paths = _PATH.findall(line) + [f"hetjax/{p}" for p in _SHORT_PATH.findall(line)]
            for path in paths:
                if not (ROOT / path).is_file():
                    stale.append(f"{source.relative_to(ROOT)}:{n}: {path}")
    assert not stale, "module paths cited that do not exist:\n" + "\n".join(stale)


def test_dependency_list_is_what_the_imports_do():
    groups = _table_groups()
    code, doc = _import_graph(groups), _diagram()
    assert set(doc) == set(code), (
        f"docs/design.md's dependency list has groups {sorted(doc)}, its modules table "
        f"{sorted(code)}"
    )
    wrong = []
    for group in sorted(code):
        for dest in sorted(code[group] - doc[group]):
            wrong.append(f"{group} -> {dest}: imported, not in the list")
        for dest in sorted(doc[group] - code[group]):
            wrong.append(f"{group} -> {dest}: in the list, not imported")
    assert not wrong, "docs/design.md's dependency list against the code:\n" + "\n".join(wrong)


def test_groups_depend_one_way():
    """The groups' imports form a DAG, as the dependency list reads top to bottom."""
    graph = _diagram()
    order = list(graph)  # the list's order: every group imports only groups below it
    upward = [
        f"{group} -> {dest}"
        for group, deps in graph.items()
        for dest in deps
        if dest in graph and order.index(dest) <= order.index(group)
    ]
    assert not upward, f"docs/design.md's dependency list points up: {upward}"


# -- one word per concept --------------------------------------------------------------------

# "checkpoint" is the training checkpoint; the runtime is not an "executor"
_RETIRED = re.compile(r"\bexecutors?\b|\b(?:boundary|activation|input) checkpoints?\b", re.I)


def test_one_word_per_concept():
    sources = [*_markdown_files()]
    for top in ("hetjax", "models", "tests"):
        sources += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in (".py", ".cc")]
    found = [
        f"{source.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for source in sources
        if source.resolve() != Path(__file__).resolve()
        for n, line in enumerate(source.read_text().splitlines(), 1)
        for m in _RETIRED.finditer(line)
    ]
    assert not found, (
        "say 'runtime' for what runs a step and 'boundary activations' for each block's "
        "input kept for its backward:\n" + "\n".join(found)
    )


_GUIDE_POINTER = re.compile(r"docs/guide/(\w+\.md)#([\w-]+)")


def test_the_runs_output_points_at_guide_headings():
    """The pointers the run's output gives for its terms (``docs/guide/X.md#anchor``
    in hetjax's messages) name headings that exist (issue #54)."""
    broken = []
    for path in sorted((ROOT / "hetjax").rglob("*.py")):
        text = re.sub(r'"\s*\n\s*f?"', "", path.read_text())  # adjacent literals joined
        for page, anchor in _GUIDE_POINTER.findall(text):
            target = ROOT / "docs" / "guide" / page
            if not target.exists() or anchor not in _anchors(target):
                broken.append(f"{path.relative_to(ROOT)}: docs/guide/{page}#{anchor}")
    assert not broken, "\n".join(broken)


def test_every_benchmark_is_in_the_guide():
    """docs/guide/benchmarks.md has a row for every ``python -m hetjax.bench`` name."""
    from hetjax.bench import BENCHMARKS

    rows = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs/guide/benchmarks.md").read_text(), re.M))
    assert set(BENCHMARKS) <= rows, sorted(set(BENCHMARKS) - rows)
