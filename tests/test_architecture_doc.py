"""docs/architecture.md, held to the code: every expected value below is read from the code
or its configuration (setup.py, pyproject.toml, the kinds table, the contracts' classes, the
plugin manager, the hook specifications), never written here, so the page fails these tests
as soon as it drifts:

- the layout block names every package folder of the source trees and every module at the
  top of core/, and every folder or file it names exists;
- the layers are the import-linter configuration's, and every one of its contracts is named;
- the page counts as many contracts as the kinds table has, names each contract, its module,
  its methods (marking the abstract ones), its row of the kinds table and its built-in parts,
  and every ABC defined in servelab.contracts;
- every `servelab.x.y` path written on the page resolves: a module found by the import
  system, or a name bound at the top of one (read from its source, not run), or a member of
  a class defined there;
- every file path in backticks exists;
- every hook the page names is specified, and every event hook is in its events table;
- every section of the page that a docstring points to exists as a heading.

No engine runs: the test reads files and imports only what the test session has imported
already (the contracts and the plugin manager).
"""

from __future__ import annotations

import abc
import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import servelab.contracts
from servelab.contracts import hookspecs
from servelab.contracts.kinds import KINDS
from servelab.registry import plugin_manager

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
INDENT = 2  # the layout block's indent per folder level


# -- reading the page


@cache
def page() -> str:
    return DOC.read_text()


@cache
def headings() -> list[tuple[int, str, int]]:
    """`(level, title, line index)` of every markdown heading outside fenced code."""
    found, fenced = [], False
    for i, line in enumerate(page().splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.+?)\s*$", line)):
            found.append((len(m.group(1)), m.group(2), i))
    return found


def section(title_start: str) -> str:
    """The text under the first heading that starts with `title_start`, up to the next
    heading of the same or a higher level."""
    lines = page().splitlines()
    for n, (level, title, at) in enumerate(headings()):
        if title.startswith(title_start):
            end = next((i for lv, _, i in headings()[n + 1 :] if lv <= level), len(lines))
            return "\n".join(lines[at + 1 : end])
    raise AssertionError(f"docs/architecture.md has no heading starting {title_start!r}")


def flat(text: str) -> str:
    """`text` with every run of whitespace as one space (prose wraps anywhere)."""
    return " ".join(text.split())


def layout_block() -> list[str]:
    """The lines of the first fenced block of the Layout section."""
    text = section("Layout")
    assert "```" in text, "the Layout section has no fenced layout block"
    return text.split("```")[1].strip("\n").splitlines()


# a folder line: `<indent>name/` (several siblings: `a/ b/ c/`), then two spaces, `->` or the end
FOLDERS = re.compile(r"^( *)((?:[\w.-]+/ )*[\w.-]+/)(?= {2}|$| ->)")
# a file line: `<indent>a.py, b.py`, then two spaces or the end
FILES = re.compile(r"^( *)((?:[\w.-]+\.py, )*[\w.-]+\.py)(?= {2}|$)")


def layout_entries() -> tuple[set[str], set[str]]:
    """`(folders, files)` the layout block names, as paths from the repository root. Indent
    gives the level (INDENT spaces each); a line whose first token is no folder or file
    (a wrapped description) names nothing."""
    folders: set[str] = set()
    files: set[str] = set()
    parents: list[str] = []  # parents[level]: the folder last named at that level
    for number, line in enumerate(layout_block(), 1):
        if m := FOLDERS.match(line):
            names, kind = m.group(2).split(), folders
        elif m := FILES.match(line):
            names, kind = m.group(2).split(", "), files
        else:
            continue
        indent = len(m.group(1))
        level = indent // INDENT
        assert indent % INDENT == 0 and level <= len(parents), (
            f"layout block line {number} is indented {indent} spaces under "
            f"{'/'.join(parents) or 'nothing'}: {line!r}"
        )
        paths = ["/".join([*parents[:level], n.rstrip("/")]) for n in names]
        kind.update(paths)
        if kind is folders:
            parents[level:] = [paths[-1].rsplit("/", 1)[-1]]
    return folders, files


@cache
def source_roots() -> dict[str, str]:
    """setup.py's ROOTS as `{folder: import name}`: the folders that become `servelab`."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets
        ):
            return {folder: name for name, folder in ast.literal_eval(node.value).items()}
    raise AssertionError("setup.py defines no ROOTS")


def package_folders() -> set[str]:
    """Every folder of the source trees that holds .py files (no __pycache__), the roots too."""
    found = set()
    for root in source_roots():
        for path in (REPO / root).rglob("*.py"):
            rel = path.parent.relative_to(REPO)
            if not any(p == "__pycache__" or p.startswith(".") for p in rel.parts):
                found.add(rel.as_posix())
    return found


# -- (a) the layout


def test_every_package_folder_is_in_the_layout():
    folders, _ = layout_entries()
    missing = sorted(package_folders() - folders)
    assert not missing, f"package folders the layout block of docs/architecture.md omits: {missing}"


def test_every_module_at_the_top_of_core_is_in_the_layout():
    """The top-level modules are the ones the `layers` rule places, each by name."""
    core = next(folder for folder, name in source_roots().items() if name == "servelab")
    _, files = layout_entries()
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / core).glob("*.py")}
    assert modules <= files, f"modules the layout block omits: {sorted(modules - files)}"


def test_every_folder_and_file_the_layout_names_exists():
    folders, files = layout_entries()
    assert folders, "the layout block names no folder"
    gone = sorted(p for p in folders if not (REPO / p).is_dir())
    gone += sorted(p for p in files if not (REPO / p).is_file())
    assert not gone, f"the layout block of docs/architecture.md names what does not exist: {gone}"


# -- the layers


@cache
def importlinter() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def test_the_layers_are_the_import_linter_configuration():
    (layers,) = [c for c in importlinter()["contracts"] if c["type"] == "layers"]
    chain = " > ".join(layers["layers"])
    assert f"`{chain}`" in flat(section("Layers")), (
        f"the Layers section does not state the layers as pyproject.toml does: `{chain}`"
    )
    first_cells = [
        re.split(r"(?<!\\)\|", ln)[1]
        for ln in section("Layers").splitlines()
        if ln.startswith("| `")
    ]
    for entry in layers["layers"]:
        for layer in entry.split(" | "):
            assert any(f"`{layer}`" in cell for cell in first_cells), (
                f"the layers table has no row for {layer!r}"
            )


def test_every_import_linter_contract_is_named():
    text = section("Layers")
    missing = [c["id"] for c in importlinter()["contracts"] if f"`{c['id']}`" not in text]
    assert not missing, f"import-linter contracts the Layers section does not name: {missing}"


# -- (b) the contracts


def contract_abcs() -> dict[str, type]:
    """`{name: class}` of every ABC defined in a module of servelab.contracts (a
    contract may have every method defaulted, as `SchedulingPolicy` does)."""
    found = {}
    for info in pkgutil.iter_modules(servelab.contracts.__path__, "servelab.contracts."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == module.__name__
                and abc.ABC in obj.__bases__
            ):
                found[name] = obj
    return found


def test_the_contract_abcs_are_the_kinds_table():
    """What the page counts: the kinds table, which every enumeration of the kinds reads."""
    contracts = {kind.contract.__name__: kind.contract for kind in KINDS.values()}
    assert contracts == contract_abcs(), (
        "the ABCs defined in servelab.contracts differ from the kinds' contracts "
        f"(KINDS: {sorted(contracts)}; ABCs: {sorted(contract_abcs())})"
    )


def test_the_page_counts_the_contracts():
    text = flat(page())
    stated = re.findall(r"\b(\w+) (?:contracts|ABCs)\b", text)
    counts = [
        NUMBER_WORDS.index(w.lower()) if w.lower() in NUMBER_WORDS else int(w)
        for w in stated
        if w.lower() in NUMBER_WORDS or w.isdigit()
    ]
    assert counts, "docs/architecture.md states no number of contracts"
    assert set(counts) == {len(KINDS)}, (
        f"docs/architecture.md counts {sorted(set(counts))} contracts; the kinds table "
        f"(servelab.contracts.kinds.KINDS) has {len(KINDS)}"
    )
    assert f"## The {NUMBER_WORDS[len(KINDS)]} contracts" in page()


def public_members(cls: type) -> dict[str, bool]:
    """`{name: abstract}` of the methods and properties `cls` itself defines."""
    kinds = (staticmethod, classmethod, property)
    return {
        name: name in cls.__abstractmethods__
        for name, member in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, kinds))
    }


def test_each_contract_is_described_from_its_code():
    for cls in {*contract_abcs().values(), *(k.contract for k in KINDS.values())}:
        text = section(f"{cls.__name__} (`{cls.__module__}`)")
        listed = {}
        for line in text.splitlines():
            if m := re.match(r"- `(\w+)", line):
                listed[m.group(1)] = "abstract" in line
        assert listed == public_members(cls), (
            f"{cls.__name__}'s methods on the page (name: marked abstract) {listed} differ "
            f"from the class's {public_members(cls)}"
        )


def test_each_kind_has_its_row_and_its_built_ins():
    table = section(f"The {NUMBER_WORDS[len(KINDS)]} contracts")
    for name, kind in KINDS.items():
        rows = [ln for ln in table.splitlines() if ln.startswith(f"| {name} |")]
        assert len(rows) == 1, f"the contracts table has {len(rows)} rows for kind {name!r}"
        row = rows[0]
        context = [f"`{c}`" for c in sorted(kind.context)] or ["none"]
        for cell in (
            f"`{kind.contract.__name__}`",
            f"`{kind.hook}`",
            f"`{kind.default}`",
            *context,
        ):
            assert cell in row, f"the {name} row lacks {cell}: {row}"
        built_ins = [
            part
            for part, info in plugin_manager.registered(name).items()
            if info.origin == plugin_manager.BUILTIN
        ]
        described = section(f"{kind.contract.__name__} (")
        missing = [part for part in built_ins if f"`{part}`" not in described]
        assert not missing, f"built-in {name} parts the page does not describe: {missing}"


# -- (c) module paths and file paths


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names bound at the top of a module (in if/try blocks too), with their node; `__all__`'s
    names too (a module-level `__getattr__` serves them)."""
    names: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names[leaf.id] = node
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    for item in ast.literal_eval(node.value):
                        names.setdefault(item, node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return names


def _class_members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, ast.Assign):
            members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
    return members


def resolves(dotted: str, depth: int = 0) -> bool:
    """Whether `dotted` is a module the import system finds, or a name bound at the top of
    one, or a member of a class defined there (an imported name is followed to its source)."""
    parts = dotted.split(".")
    module, spec, used = "", None, 0
    # the longest prefix that is a module, found package by package: a name is looked up
    # only in a package, so no module but a package's __init__ runs
    for i in range(1, len(parts) + 1):
        try:
            found = importlib.util.find_spec(".".join(parts[:i]))
        except (ImportError, ValueError):
            found = None
        if found is None:
            break
        module, spec, used = ".".join(parts[:i]), found, i
        if found.submodule_search_locations is None:
            break
    if spec is None:
        return False
    rest = parts[used:]
    if not rest:
        return True
    if spec.origin is None or not spec.origin.endswith(".py") or depth > 5:
        return False
    names = _top_level(ast.parse(Path(spec.origin).read_text()))
    node = names.get(rest[0])
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom):  # follow the import to where the name is defined
        base = node.module or ""
        if node.level:
            package = module if spec.submodule_search_locations else module.rsplit(".", 1)[0]
            package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            base = ".".join(filter(None, [package, node.module]))
        original = next(a.name for a in node.names if (a.asname or a.name) == rest[0])
        return resolves(".".join([base, original, *rest[1:]]), depth + 1)
    if len(rest) == 1:
        return True
    return len(rest) == 2 and isinstance(node, ast.ClassDef) and rest[1] in _class_members(node)


def test_every_module_path_on_the_page_resolves():
    paths = sorted(set(re.findall(r"\bservelab(?:\.\w+)+", page())))
    assert paths, "docs/architecture.md names no servelab module"
    broken = [p for p in paths if not resolves(p)]
    assert not broken, f"module paths on docs/architecture.md that do not resolve: {broken}"


def test_the_resolver_can_fail():
    assert resolves("servelab.step.plan.StepPlan")
    assert resolves("servelab.scheduling.SchedulerCore")  # imported into the package
    assert resolves("servelab.engine.engine.Engine.step")
    assert resolves("servelab.LLM")  # served by the root's __getattr__, listed in __all__
    for gone in (
        "servelab.step.plans",
        "servelab.step.plan.StepPlans",
        "servelab.engine.engine.Engine.stepp",
        "servelab.scheduling.SchedulerCores",
    ):
        assert not resolves(gone), gone


def test_every_file_path_on_the_page_exists():
    """Backticked paths: from the repository root, from a source folder (`engine/loop.py`
    is core's), or for a bare file name, anywhere in the source trees."""
    code = re.findall(r"`([^`\n]+)`", page())
    paths = {
        c.rstrip("/")
        for c in code
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", c)
        and ("/" in c or re.search(r"\.(py|md|toml|yaml|json)$", c))
    }
    roots = [REPO, *(REPO / root for root in source_roots())]
    missing = []
    for path in sorted(paths):
        if "/" in path:
            found = any((root / path).exists() for root in roots)
        else:
            found = (
                any(any((REPO / r).rglob(path)) for r in source_roots()) or (REPO / path).exists()
            )
        if not found:
            missing.append(path)
    assert not missing, f"paths on docs/architecture.md that do not exist: {missing}"


# -- the hooks


def test_every_hook_named_is_specified_and_every_event_is_described():
    specified = {n for n in vars(hookspecs) if n.startswith("servelab_")}
    named = set(re.findall(r"\bservelab_[a-z_]*[a-z]\b", page()))
    assert named <= specified, f"hooks on the page that are not specified: {named - specified}"
    assert specified <= named, f"hooks the page does not name: {specified - named}"
    events = section("Plugins and events")
    for hook in plugin_manager.EVENT_HOOKS:
        assert re.search(rf"^\| `{hook}` \|", events, re.M), f"no row for event {hook}"


# -- (d) sections docstrings point to

SECTION_POINTERS = (
    # `architecture.md#one-step-as-data-flows`
    re.compile(r"architecture\.md#(?P<anchor>[\w-]+)"),
    # `docs/architecture.md, section "One step"` (or the title in single or typographic quotes)
    re.compile(r"architecture\.md,?\s+(?:section\s+)?[\"'“](?P<title>[^\"'”]+)[\"'”]"),
    # `One step, as data flows (see docs/architecture.md):` at the start of a line
    re.compile(
        r"^[\s#\"']*(?P<title>[^\s(#\"'][^()]*?)\s*\(see (?:the )?(?:docs/)?architecture\.md\)"
    ),
)


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def section_pointers(text: str) -> list[tuple[int, str, str]]:
    """`(line, "anchor" or "title", value)` of each pointer to a section of the page in `text`;
    a pointer to the whole page (none of the forms above) names no section."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if "architecture.md" not in line:
            continue
        for form in SECTION_POINTERS:
            if m := form.search(line):
                key = "anchor" if "anchor" in m.groupdict() else "title"
                found.append((number, key, m.group(key)))
                break
    return found


def test_the_pointer_forms_are_read():
    text = (
        "One step, as data flows (see docs/architecture.md):\n"
        "    # Layers (see architecture.md)\n"
        'see docs/architecture.md, section "The six contracts"\n'
        "[layout](docs/architecture.md#layout)\n"
        "the whole page: docs/architecture.md\n"
    )
    assert section_pointers(text) == [
        (1, "title", "One step, as data flows"),
        (2, "title", "Layers"),
        (3, "title", "The six contracts"),
        (4, "anchor", "layout"),
    ]


def test_every_section_a_docstring_points_to_exists():
    titles = {t.strip().lower() for _, t, _ in headings()}
    anchors = {slug(t) for _, t, _ in headings()}
    sources = [p for root in source_roots() for p in (REPO / root).rglob("*.py")]
    sources += [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    dangling = []
    for path in sources:
        if "__pycache__" in path.parts or path == DOC:
            continue
        for line, key, value in section_pointers(path.read_text()):
            known = anchors if key == "anchor" else titles
            if (slug(value) if key == "anchor" else value.strip().lower()) not in known:
                dangling.append(f"{path.relative_to(REPO)}:{line} -> {value!r}")
    assert not dangling, (
        f"pointers to sections docs/architecture.md lacks: {dangling}; "
        f"its headings: {[t for _, t, _ in headings()]}"
    )
