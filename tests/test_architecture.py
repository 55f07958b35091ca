"""The package's shape: imports form a DAG, layered one way (issue: architecture)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each layer may import only from the layers after it (entry points first).
LAYERS = [
    {"hetjax.cli"},
    {
        "hetjax.launch",
        "hetjax.bench",
        "hetjax.export",
        "hetjax.tokenize",
        "hetjax.gpucheck",
        "hetjax.generate",
        "hetjax.evaluate",
        "hetjax.cli_config",  # the commands' config: --config, the workdir's, or --hf's
    },
    {
        "hetjax.train",
        "hetjax.guards",
        "hetjax.checkpoint",
        "hetjax.metrics",
        "hetjax.summary",
        "hetjax.inference",
    },
    {"hetjax.planning"},
    {"hetjax.runtime"},
    {"hetjax.parallel"},  # how devices split a run: rules, layouts, strategies
    {"hetjax.optimizer"},
    {
        "hetjax.storage",
        "hetjax.checkpoint_state",  # a checkpoint's state on disk: what the stores hand it
        "hetjax.checkpoint_drives",  # a checkpoint's page links on each drive
        "hetjax.hf",
        "hetjax.data",
        "hetjax.instruct",  # instruction records packed into rows (reads data's windows)
        "hetjax.chat",  # tokenizers and chat templates (the run's tokenizer, named)
        "hetjax.distributed",
        "models",
    },
    {
        "hetjax.memory",
        "hetjax.memory_host",
        "hetjax.placement",  # the one placement description (config -> placement)
        "hetjax.nvme_copies",  # one NVMe copy or two (config -> the choice)
        "hetjax.allocator",
        "hetjax.timeline",
        "hetjax.census",
        "hetjax.faults",
        "hetjax.preemption",
        "hetjax.run_lock",
        "hetjax.xla_env",
    },
    {
        "hetjax.config",
        "hetjax.config_model",
        "hetjax.config_offload",
        "hetjax.config_distributed",
        "hetjax.config_help",
        "hetjax.config_values",
        "hetjax.types",
        "hetjax.support",  # the support matrix: imports nothing of the project
        # the optimizer's state format, read by the memory model, the stores and
        # checkpoints as by the optimizer (docs/design.md's `formats` group)
        "hetjax.state_format",
    },
    {"hetjax.errors"},  # UserError, the base of every error a command reports in one line
]


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("hetjax", "models"):
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every project module each module imports, at any depth (function-level too)."""
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in names:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):  # a package's own __init__
                    graph[m].add(t)
    return graph


def test_imports_have_no_cycle():
    graph = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _layer(module: str) -> int:
    """The layer of the most specific entry naming ``module`` or a package above it (a
    module may sit below its package: the optimizer's state format)."""
    named = [
        (len(p), i)
        for i, layer in enumerate(LAYERS)
        for p in layer
        if module == p or module.startswith(p + ".")
    ]
    if not named:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return max(named)[1]


def test_imports_point_down_the_layers():
    graph = _imports(_modules())
    upward = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        if m not in ("hetjax", "hetjax.storage", "hetjax.optimizer")
        for t in targets
        if t != "hetjax" and _layer(t) < _layer(m)
    ]
    assert not upward, upward


def test_the_bottom_modules_import_nothing_from_the_project():
    graph = _imports(_modules())
    assert graph["hetjax.types"] <= {"hetjax.errors"}
    assert graph["hetjax.errors"] == set()
    # the memory model reads the config, the placement and the state format, all leaves
    # or one above the config
    low = {"hetjax.config", "hetjax.types", "hetjax.placement", "hetjax.state_format"}
    assert graph["hetjax.memory"] <= low
    assert graph["hetjax.memory_host"] <= low | {"hetjax.memory"}
    assert graph["hetjax.placement"] <= {"hetjax.config", "hetjax.nvme_copies"}
    assert graph["hetjax.nvme_copies"] <= {"hetjax.config"}
    assert graph["hetjax.support"] == set()
    assert graph["hetjax.state_format"] <= {"hetjax.config", "hetjax.types"}
    assert graph["models"] | graph["models.gpt"] <= {
        "hetjax.config",
        "models.attention",
        "models.staged",
        "models.gpt",
        "models.llama",
        "models.t5",
    }


LONGEST_FUNCTION = 80  # lines, decorators and docstring included (issue #55, item 5)


def test_no_function_is_longer_than_80_lines():
    """A function past 80 lines is split into named steps: in hetjax/
    and models/, bench and gpucheck included."""
    long = []
    for root in ("hetjax", "models"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    lines = node.end_lineno - first + 1
                    if lines > LONGEST_FUNCTION:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"
