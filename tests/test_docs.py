"""The documentation agrees with the code: README.md and docs/*.md name only real flags, their flag tables
show the parsers' defaults, the commands they show parse, their links lead somewhere, and the README stays
a five-minute read. Pure: nothing here starts a process."""

from __future__ import annotations

import ast
import os
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from launch.cli import build_parser
from launch.flags import AUTO_SWITCHES, PER_PEER_DEFAULTS
from tests.conftest import ROOT
from tests.test_layout import file_of

pytestmark = pytest.mark.timeout(60)

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LAUNCH, PEER = "gossip-launch", "gossip-peer"
# gossip.peer's own flag, which the launcher adds when it restarts a process (--max-restarts)
INTERNAL = {"--resume"}
# Programs whose flags are checked against the source that declares them (their parsers are built inside
# main(), or they are scripts): the flag must appear there as a quoted string.
SOURCES = {"gossip.peer": "gossip/peer.py", "launch.summary": "launch/summary.py",
           "gossip-keys": "gossip/net/security.py"}
# Flags of other tools on the docs' command lines, each looked up in that tool's manual; kept to what the
# docs use: sbatch's directives in the SLURM script, mpirun's host file. torchrun's are checked against its
# own parser (torch.distributed.run), and the set-up commands of pip, venv and pytest use no long flags.
OTHER_TOOLS = {
    "sbatch": {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time"},
    "mpirun": {"--hostfile"},
    "srun": set(), "pip": set(), "venv": set(), "pytest": set(), "sysctl": set(), "ssh": set(),
}
COMMANDS = {"gossip-launch": LAUNCH, "gossip-peer": PEER, "gossip-keys": "gossip-keys", "torchrun": "torchrun",
            "mpirun": "mpirun", "srun": "srun", "#SBATCH": "sbatch", "pip": "pip", "sysctl": "sysctl", "ssh": "ssh"}
MODULES = {"launch": LAUNCH, "launch.peer": PEER, "gossip.peer": "gossip.peer", "launch.summary": "launch.summary",
           "pytest": "pytest", "pip": "pip", "venv": "venv"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def text_of(path: Path) -> str:
    return path.read_text()


def split_code(text: str) -> tuple[list[tuple[str, str]], list[str], str]:
    """(fenced blocks as (language, body), indented blocks, the prose left when both are taken out)."""
    fenced = [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    indented, block, kept, blank = [], [], [], True
    for line in prose.splitlines():
        if line.startswith("    ") and (block or blank):  # a code block starts after a blank line
            block.append(line[4:])
            continue
        if block:
            indented.append("\n".join(block))
            block = []
        kept.append(line)
        blank = not line.strip()
    if block:
        indented.append("\n".join(block))
    return fenced, indented, "\n".join(kept)


def inline_spans(prose: str) -> list[str]:
    return re.findall(r"`([^`]+)`", prose)


def command_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined, each cut at ``&&``, ``;`` and ``|``."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [part.strip() for line in joined.splitlines() for part in re.split(r"&&|;|\|", line) if part.strip()]


def strip_comment(line: str) -> str:
    return line if line.startswith("#SBATCH") else re.sub(r"(^|\s)#.*", "", line).strip()


def owned_flags(tokens: list[str]) -> list[tuple[str | None, str]]:
    """(program, flag) for every --flag among ``tokens``: the program is the latest command or ``-m`` module
    or script named before it (None in prose that names none)."""
    found, program, i = [], None, 0
    while i < len(tokens):
        token = tokens[i]
        if token in COMMANDS:
            program = COMMANDS[token]
        elif token == "-m" and i + 1 < len(tokens):
            program = MODULES.get(tokens[i + 1], f"python -m {tokens[i + 1]}")
            i += 1
        elif re.fullmatch(r"[\w./-]+\.py", token) and "/" in token:
            program = token
        else:
            found += [(program, flag) for flag in FLAG.findall(token)]
        i += 1
    return found


@cache
def launcher_options() -> dict:
    return build_parser()._option_string_actions


@cache
def peer_options() -> dict:
    from launch.peer import build_parser as peer_parser

    return peer_parser()._option_string_actions


@cache
def torchrun_options() -> dict:
    from torch.distributed.run import get_args_parser

    return get_args_parser()._option_string_actions


def flag_is_real(program: str | None, flag: str) -> bool:
    if program is None:  # prose: a flag of one of our two commands
        return flag in launcher_options() or flag in peer_options() or flag in INTERNAL
    if program == LAUNCH:
        return flag in launcher_options()
    if program == PEER:
        return flag in peer_options()
    if program == "torchrun":
        return flag in torchrun_options()
    if program in OTHER_TOOLS:
        return flag in OTHER_TOOLS[program]
    source = SOURCES.get(program, program)
    assert (ROOT / source).is_file(), f"{program}: no such program in this repository"
    return f'"{flag}"' in (ROOT / source).read_text()


def mentions(path: Path) -> list[tuple[str | None, str, str]]:
    """(program, flag, where) for every --flag in the code of ``path``: code blocks and inline code."""
    fenced, indented, prose = split_code(text_of(path))
    found = []
    for block in [body for _, body in fenced] + indented:
        for line in command_lines(block):
            found += [(program, flag, line) for program, flag in owned_flags(line.split())]
    for span in inline_spans(prose):
        found += [(program, flag, span) for program, flag in owned_flags(span.split())]
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_flag_the_docs_name_is_a_real_flag_of_its_command(path):
    found = mentions(path)
    unknown = [(program or "gossip-launch/gossip-peer", flag, where[:80]) for program, flag, where in found
               if not flag_is_real(program, flag)]
    assert not unknown, unknown


def test_the_flag_check_knows_a_real_flag_from_a_made_up_one():
    assert owned_flags(["torchrun", "--nnodes", "2", "-m", "launch.peer", "--steps", "5", "--nodez", "3"]) == [
        ("torchrun", "--nnodes"), (PEER, "--steps"), (PEER, "--nodez")]
    assert flag_is_real("torchrun", "--nnodes") and not flag_is_real(PEER, "--nodez")
    assert not flag_is_real(None, "--rdzv-endpoint") and not flag_is_real("bench/modes.py", "--no-such-flag")
    assert flag_is_real("bench/async_adam.py", "--fresh") and flag_is_real("sbatch", "--ntasks-per-node")
    assert all(flag_is_real("gossip.peer", flag) for flag in INTERNAL)


# ----- commands -------------------------------------------------------------------------------------------


def shown_commands(path: Path) -> list[tuple[str, list[str], str]]:
    """(program, argv, line) for every gossip-launch or gossip-peer command in the code blocks of ``path``
    (also after torchrun, srun or mpirun). Inline code names flags in passing and is not a command."""
    fenced, indented, _ = split_code(text_of(path))
    lines = [strip_comment(line) for block in [b for lang, b in fenced if lang in ("", "bash", "sh", "shell")]
             + indented for line in command_lines(block) if not line.startswith("#")]
    found = []
    for line in lines:
        words = line.split()
        if not ({LAUNCH, PEER} & set(words) or any(words[i:i + 2] in (["-m", "launch"], ["-m", "launch.peer"])
                                                    for i in range(len(words)))):
            continue
        tokens = shlex.split(line)
        for i, token in enumerate(tokens):
            if token in (LAUNCH, PEER):
                found.append((token, tokens[i + 1:], line))
                break
            if token == "-m" and tokens[i + 1:i + 2] in (["launch"], ["launch.peer"]):
                found.append((MODULES[tokens[i + 1]], tokens[i + 2:], line))
                break
    return found


def check_command(program: str, argv: list[str]) -> None:
    """Parse ``argv`` as ``program`` does and build the run it describes; no socket, no process."""
    from launch.flags import config_from_args
    from launch.peer import build_parser as peer_parser
    from launch.peer import provisional_config

    parser = build_parser() if program == LAUNCH else peer_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{program} {' '.join(argv)}: refused by the parser (exit {exc.code})") from None
    if program == LAUNCH and not (args.hosts or args.hostfile):
        config_from_args(args)
    elif program == PEER:
        provisional_config(args, args.world_size or None)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_the_commands_the_docs_show_parse(path):
    commands = shown_commands(path)
    for program, argv, line in commands:
        if "--help" not in argv:
            check_command(program, argv)
    if path == README:
        assert len(commands) >= 6, commands  # the set-up command, the runs, the host list
        assert any(argv == [] for _, argv, _ in commands)  # the set-up command itself


def test_the_torchrun_commands_parse_with_torchruns_parser():
    from torch.distributed.run import get_args_parser

    shown = []
    for path in DOCS:
        fenced, indented, _ = split_code(text_of(path))
        shown += [line for block in [body for _, body in fenced] + indented for line in command_lines(block)
                  if line.startswith("torchrun ")]
    assert len(shown) >= 2, shown
    for line in shown:
        args = get_args_parser().parse_args(shlex.split(strip_comment(line))[1:])
        assert args.training_script, line


def test_a_command_with_a_wrong_flag_or_value_is_caught():
    with pytest.raises(AssertionError, match="refused by the parser"):
        check_command(LAUNCH, ["--nodez", "3"])
    from gossip.errors import ConfigError

    with pytest.raises(ConfigError):
        check_command(LAUNCH, ["--schedule", "time"])
    commands = shown_commands(ROOT / "docs" / "many-hosts.md")
    assert {program for program, _, _ in commands} == {LAUNCH, PEER}
    assert any(line.startswith("torchrun") for _, _, line in commands)


# ----- the flag tables ------------------------------------------------------------------------------------


def doc_tables(path: Path) -> list[list[list[str]]]:
    """Every table of ``path`` as rows of cells (the header row first, the --- row left out)."""
    tables, rows = [], []
    for line in text_of(path).splitlines() + [""]:
        if line.startswith("|"):
            if not re.fullmatch(r"[|\s:-]+", line):
                rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        elif rows:
            tables, rows = tables + [rows], []
    return tables


def doc_says(text: str, name: str, flag: str, default) -> bool:
    """Does a table's default ``text`` say ``default``? Switches read on/off or the flag's own name, empty
    lists and strings none/off, numbers compare as numbers."""
    text = text.strip().lower()
    if name == "out":
        return default == "" and text.startswith("runs/")
    if isinstance(default, bool):
        return text in (("on", "true", flag[2:]) if default else ("off", "false"))
    if default is None and name in AUTO_SWITCHES:  # an on/off flag whose default the config resolves
        return text == "auto"
    if default in ((), ""):
        return text in ("none", "off", PER_PEER_DEFAULTS.get(name, "none"))
    if isinstance(default, tuple):  # a list flag: its values as the flag takes them
        return text == ",".join(map(str, default))
    if isinstance(default, (int, float)):
        try:
            return float(text) == float(default)
        except ValueError:
            return False
    return text == str(default).lower()


def test_the_flag_tables_show_the_parsers_defaults():
    """Every "flag | default" table of the README and docs/, and every "`--flag` (default)" in a table cell."""
    actions = {**peer_options(), **launcher_options()}
    checked = 0
    for path in DOCS:
        for table in doc_tables(path):
            for row in table[1:] if table[0][:2] == ["flag", "default"] else []:
                flags = re.findall(r"`(--[a-z][a-z0-9-]*)", row[0])
                flags = [f for f in flags if not (f.startswith("--no-") and "--" + f[5:] in flags)]
                defaults = [part for part in row[1].split(", ")] if row[1] else []
                assert not defaults or len(defaults) == len(flags), (path.name, row[:2])
                for flag, text in zip(flags, defaults):
                    action = actions[flag]
                    assert doc_says(text, action.dest, flag, action.default), (path.name, flag, text, action.default)
                    checked += 1
            for row in table[1:]:  # "`--local-steps` (10)": a default in passing
                for flag, text in re.findall(r"`(--[a-z][a-z0-9-]*)[^`]*` \(([0-9.]+)\)", " | ".join(row)):
                    action = actions[flag]
                    assert doc_says(text, action.dest, flag, action.default), (path.name, flag, text, action.default)
                    checked += 1
    assert checked >= 30


# ----- links and the README's shape -----------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = FENCE.sub("", text_of(path))
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(path):
    prose = FENCE.sub("", text_of(path))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), (path.name, target)
        if anchor:
            assert anchor in anchors(linked), (path.name, target, sorted(anchors(linked)))


def test_slugs_are_githubs():
    assert slug("Heterogeneous links (`--link-mbit`, `--link-latency-ms`)") == \
        "heterogeneous-links---link-mbit---link-latency-ms"
    assert slug("charlm: every mode at its defaults (`bench/charlm_modes.py`)") == \
        "charlm-every-mode-at-its-defaults-benchcharlm_modespy"


def test_the_readme_is_a_five_minute_read_that_links_every_page():
    text = text_of(README)
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    assert any("gossip.attach(" in line for line in lines[:60])
    assert any(line.strip().startswith("torchrun ") for line in lines[:70])
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in text, page.name


def test_the_readme_keeps_the_set_up_commands_ci_runs():
    lines = [line.strip() for line in text_of(README).splitlines()]
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e . && "
            "python -m launch") in lines
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e \".[test]\" && "
            "python -m pytest") in lines
    assert '`python -m pytest -m "not slow"`' in text_of(README)


# ----- names in backticks ---------------------------------------------------------------------------------

CODE_DIRS = ("gossip", "launch", "topologies", "bench", "tests", "examples")
NOT_THE_REPOSITORY = {".git", ".venv", ".venv-ci", ".whl", ".hypothesis", ".pytest_cache", ".ruff_cache",
                      "__pycache__", "runs"}
EXTENSION = re.compile(r"\.(py|md|json|jsonl|txt|pt|npz|log|png|toml|sh|cfg|yaml|csv)$")
PATH = re.compile(r"[a-z_.][\w.<>-]*(/[\w.<>-]+)*/?")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
CALL = re.compile(r"([A-Za-z_][\w.]*)\((.*)\)", re.DOTALL)
KEYWORD = re.compile(r"([A-Za-z_]\w*)=(.+)", re.DOTALL)
# Named in backticks, but not files of this repository: the NoLoCo authors' optimizer (jkolehm/noloco).
ELSEWHERE = {"sparse_optimizer_c.py"}


@dataclass
class Code:
    """What the Python files under CODE_DIRS define and use, read with ``ast`` (nothing is imported)."""

    names: set[str] = field(default_factory=set)  # defined, assigned, imported, used as attribute or keyword
    strings: list[str] = field(default_factory=list)  # string constants; an f-string with {} for its values
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)  # (members, bases)
    defined: dict[str, set[str]] = field(default_factory=dict)  # file -> what it defines (at any depth)
    files: set[str] = field(default_factory=set)  # every file and folder of the repository


def target_names(node: ast.AST) -> list[str]:
    """The names a definition or assignment ``node`` binds (``self.x = ...`` binds x)."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    found = []
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, ast.Name):
                found.append(part.id)
            elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                found.append(part.attr)
    return found


@cache
def code() -> Code:
    found = Code()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_THE_REPOSITORY and not d.endswith(".egg-info")]
        here = Path(folder).relative_to(ROOT)
        found.files |= {str(here / name) for name in dirs + files} - {"."}
    this = str(Path(__file__).relative_to(ROOT))  # (whose strings name what does not exist, on purpose)
    for rel in sorted(f for f in found.files if f.endswith(".py") and f.split("/")[0] in CODE_DIRS and f != this):
        tree = ast.parse((ROOT / rel).read_text(), rel)
        defined = found.defined.setdefault(rel, set())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            bound = target_names(node)
            defined.update(bound)
            found.names.update(bound)
            if isinstance(node, ast.ClassDef):
                members = {name for part in node.body for name in target_names(part)}
                members |= {name for part in ast.walk(node) for name in target_names(part)
                            if isinstance(part, (ast.Assign, ast.AnnAssign, ast.AugAssign))}
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                found.classes.setdefault(node.name, []).append((members, bases))
            elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
                found.names.add(node.arg)
            elif isinstance(node, ast.Attribute):
                found.names.add(node.attr)
            elif isinstance(node, ast.alias):  # a module re-exports what it imports
                found.names.update(node.name.split("."))
                defined.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found.strings.append(node.value)
                if " " not in node.value:  # a name, a key, a path: "/proc/sys/net/core/wmem_max" names wmem_max
                    found.names.update(re.split(r"[/:=]", node.value))
            elif isinstance(node, ast.JoinedStr):
                found.strings.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        found.names.add(Path(rel).stem)
    return found


def members(cls: str, seen: frozenset = frozenset()) -> set[str]:
    """Every member of our classes named ``cls``: methods, class attributes, ``self.x``, and those of their
    bases that are classes of ours."""
    found: set[str] = set()
    for own, bases in code().classes.get(cls, []):
        found |= own
        for base in bases:
            if base in code().classes and base not in seen:
                found |= members(base, seen | {cls})
    return found


def find_path(token: str) -> list[str] | None:
    """The repository's files or folders ``token`` names, whole or by their last parts (``averagers/base.py``),
    ``<name>`` standing for any part; else [] for a file the code writes (its name is in a string of the
    code); else None."""
    written = ".+".join(map(re.escape, re.split(r"<[^>]*>", token.rstrip("/"))))
    if files := [f for f in sorted(code().files) if re.fullmatch(f"(.*/)?{written}", f)]:
        return files
    return [] if any(re.search(written, s) for s in code().strings) else None


def module_file(dotted: str) -> str | None:
    """The repository path of module ``dotted`` (``test_layout.file_of``), or None."""
    file = file_of(dotted)
    return str(file.relative_to(ROOT)) if file is not None else None


def defined_in(rel: str, name: str) -> bool:
    """Is ``name`` (``Class.member`` allowed) defined in file or folder ``rel``? A package's ``__init__``
    that exports lazily names its exports as strings."""
    first, *rest = name.split(".")
    files = [f for f in code().defined if f == rel or f.startswith(rel.rstrip("/") + "/")]
    here = any(first in code().defined[f] for f in files)
    if not here and rel.endswith("__init__.py"):
        here = f'"{first}"' in (ROOT / rel).read_text()
    return here and all(part in members(first) or part in code().names for part in rest)


def missing_name(name: str) -> str | None:
    """Why the dotted or plain identifier ``name`` is not in the code, or None when it is."""
    parts = name.split(".")
    if parts[0] in CODE_DIRS:
        for cut in range(len(parts), 0, -1):
            if rel := module_file(".".join(parts[:cut])):
                rest = ".".join(parts[cut:])
                return None if not rest or defined_in(rel, rest) else f"{rest} is not defined in {rel}"
        return f"no module {name}"
    if parts[0] in code().classes:
        absent = [part for part in parts[1:] if part not in members(parts[0]) and part not in code().names]
        if parts[1:2] and parts[1] not in members(parts[0]):
            absent = absent or [parts[1]]
        return f"class {parts[0]} has no {absent[0]}" if absent else None
    absent = [part for part in parts if part not in code().names]
    return f"{absent[0]} is not in the code" if absent else None


def looks_like_code(name: str) -> bool:
    """A plain word may be a value or prose (``ring``, ``mean``); a name with an upper-case letter first, an
    underscore or a dot is code."""
    return name[0].isupper() or "_" in name or "." in name


def missing(span: str) -> list[str]:
    """What the backticked ``span`` names that does not exist. A path must exist (or be written by the code);
    "path name ..." names what that file defines; a code-like identifier, a call ``name(...)`` or a keyword
    ``name=value`` must be in the code; a command's repository paths and ``-m`` modules must exist. Flags
    (``--x``) are checked by the flag tests above; math, values and prose are not names."""
    span = " ".join(span.split())
    words = span.split(" ")
    if span.startswith(("-", ".")) or "://" in span:
        return []
    if span.startswith('"') and span.endswith('"'):
        return [] if any(span[1:-1] in s for s in code().strings) else [f"no string {span} in the code"]
    first = words[0]
    if PATH.fullmatch(first) and ("/" in first or EXTENSION.search(first)):
        if first in ELSEWHERE:
            return []
        if (files := find_path(first)) is None:
            return [f"no file {first}"]
        names = [w for w in re.split(r"[\s,]+|->", " ".join(words[1:])) if IDENTIFIER.fullmatch(w)]
        return [f"{name} is not defined in {' or '.join(files)}" for name in names
                if not any(defined_in(rel, name) for rel in files)]
    if call := CALL.fullmatch(span):
        return [problem] if (problem := missing_name(call.group(1))) else []
    if keyword := KEYWORD.fullmatch(span):
        value = keyword.group(2)
        return [p for p in (missing_name(keyword.group(1)), *(missing(value) if CALL.fullmatch(value) else []))
                if p]
    if len(words) > 1:  # a command or a formula: its repository paths and modules
        found = [f"no file {w}" for w in words if "/" in w and PATH.fullmatch(w) and w.split("/")[0] in
                 {f.split("/")[0] for f in code().files} and find_path(w) is None]
        modules = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1].split(".")[0]
                   in CODE_DIRS]
        return found + [f"no module {m}" for m in modules if not module_file(m)]
    name = span.removesuffix("()")
    if IDENTIFIER.fullmatch(name) and (looks_like_code(name) or name != span):
        return [problem] if (problem := missing_name(name)) else []
    return []


def backticked(path: Path) -> list[tuple[int, str]]:
    """(line, span) for every inline code span of ``path``'s prose (code blocks are commands, checked above)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text_of(path))
    lines, block, blank = [], False, True
    for line in text.splitlines():
        block = line.startswith("    ") and (block or blank)
        lines.append("" if block else line)
        blank = not line.strip()
    prose = "\n".join(lines)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"`([^`]+)`", prose)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_path_and_name_the_docs_show_in_backticks_exists(path):
    problems = [f"{path.relative_to(ROOT)}:{line}: `{' '.join(span.split())}`: {problem}"
                for line, span in backticked(path) for problem in missing(span)]
    assert not problems, "\n".join(problems)


def test_the_name_check_knows_a_real_name_from_a_stale_one():
    assert not missing("gossip/peer.py main") and not missing("Transport") and not missing("gossip.errors.ConfigError")
    assert not missing("peer-<rank>.jsonl") and not missing("averagers/base.py") and not missing("close()")
    assert not missing("python bench/modes.py") and not missing("lazy_snapshot=False") and not missing("ring")
    assert missing("gossip/peer.py no_such_function") == ["no_such_function is not defined in gossip/peer.py"]
    assert missing("gossip/no_such_file.py") == ["no file gossip/no_such_file.py"]
    assert missing("FlatParams.no_such_method") == ["class FlatParams has no no_such_method"]
    assert missing("NoSuchClass") and missing("no_such_helper()") and missing("python bench/no_such.py")
    assert missing("gossip.errors.NoSuchError") and missing("python -m launch.no_such")
