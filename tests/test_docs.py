"""The documentation keeps its promises: README.md and tutorials/*.md.

- every command that runs a project script uses only flags that script (and
  torchrun) accepts;
- every ```python snippet runs (unless its first line is `# not run`);
- every code block introduced by "From `FILE`:" is a verbatim quote of FILE;
- every `SCRIPT: error: ...` line shown right after a command block is printed, word for word,
  by one of its commands, which exits with status 2 (or the N of its `# exit status N`); so is
  every exception line (`RuntimeError: ...`) shown after a command said to fail that way, where
  `[...]` in a shown line stands for text that differs between machines;
- every script is linked from a lesson, the README links the tutorials, the
  index links every lesson, and every relative link points to a file;
- lesson 00's first DDP program is built from the lesson (the programs a reader
  is told to "save as `NAME.py`"), its diff is the real diff of the two, and the
  commands that run them work, twice, with torchrun on 2 CPU processes;
- the command blocks of the lessons that keep state between runs (checkpoint
  folders, metrics, rendezvous files) run twice in a row in a scratch copy of
  the repository, as a reader running them again would; every other block is
  checked to keep no such state.

The flags a script accepts come from its own argparse parser: a helper process
runs each script as `__main__` with parsing patched to hand the parser back
instead of parsing, so nothing trains and nothing is duplicated here.
The snippet and command tests are the slow part: `-k "not snippet and not twice"`
leaves them out. Of the stateful blocks, only lesson 00's program runs twice by
default (the suite's time is bounded); DOCS_RUN_TWICE=all runs every one twice.
"""
import difflib
import os
import shutil
import json
import re
import shlex
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

from conftest import FENCE, ROOT, TUTORIALS, lesson_files, links_of, subprocess_env

LESSONS = ["00-basic-theory.md", "01-gradient-accumulation.md", "02-ddp-in-detail.md",
           "03-ddp-training-tricks.md", "04-mixed-precision.md", "05-dp-and-ddp-source.md",
           "06-beyond-one-machine.md", "07-collectives.md", "08-sharded-data-parallel.md", "09-debugging.md"]
TRAINING_SCRIPTS = ["distributed.py", "distributed_mp.py", "dataparallel.py", "distributed_apex.py",
                    "distributed_gradient_accumulation.py", "distributed_fsdp.py"]
TOOLS = ["scripts/collectives.py", "scripts/compare_models.py", "scripts/benchmark.py",
         "scripts/preflight.py", "scripts/plot_metrics.py", "scripts/make_figures.py"]
TORCHRUN = "torchrun"  # key of torchrun's own parser in the option table
SNIPPET_TIMEOUT = 240


def doc_files():
    return [ROOT / "README.md", *sorted(TUTORIALS.glob("*.md"))]


def launchers():
    return sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/*.sbatch")])


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- markdown parsing ------------------------------------------------------------------------
# FENCE, links_of and lesson_files are conftest's: test_figures.py reads the lessons' links too.

SAVE_AS = re.compile(r"[Ss]ave (?:it|this) as `([\w.-]+\.py)`")
FROM_LINE = re.compile(r"^From `([^`]+)`.*:\s*$")


class Block:
    def __init__(self, path, lang, line, lines, intro):
        self.path, self.lang, self.line, self.lines, self.intro = path, lang, line, lines, intro

    @property
    def text(self):
        return "\n".join(self.lines)

    @property
    def where(self):
        return f"{rel(self.path)}:{self.line}"


@lru_cache(maxsize=None)
def blocks_of(path: Path):
    """Fenced code blocks, each with the last non-blank line of prose before it."""
    blocks, lines = [], path.read_text().splitlines()
    i, last_prose = 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                last_prose = lines[i].strip()
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append(Block(path, lang.lower(), start, body, last_prose))
        last_prose = ""
        i += 1  # the closing fence
    return blocks


def saved_programs():
    """{name: block} for the programs a lesson tells the reader to save ("save it as `NAME.py`")."""
    found = {}
    for path in doc_files():
        for block in blocks_of(path):
            m = SAVE_AS.search(block.intro)
            if m and block.lang in ("python", "py"):
                assert m.group(1) not in found, f"{block.where}: a second program called {m.group(1)}"
                found[m.group(1)] = block
    return found


# --- commands --------------------------------------------------------------------------------

def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
        return False
    except ValueError:  # "No closing quotation": the command goes on on the next line
        return True


def shell_commands(block: Block):
    """Logical command lines of a bash block: continuations and multi-line quotes joined,
    prompts and comments off."""
    commands, pending, quoted = [], "", ""
    for raw in block.lines:
        line = raw.rstrip()
        if quoted:
            line = quoted + "\n" + raw.rstrip()
            quoted = ""
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if _open_quote(line):
            quoted = line
            continue
        stripped = line.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if stripped and not stripped.startswith("#"):
            commands.append(stripped)
    if pending or quoted:
        commands.append((pending or quoted).strip())
    return commands


def segments(command: str):
    """Simple commands of a command line, split at ; && || | & (shlex, comments dropped)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    current, out, skip_next = [], [], False
    for token in lexer:
        if token and set(token) <= set(";&|<>()"):
            if "<" in token or ">" in token:
                skip_next = True  # a redirection: its target is not an argument
                continue
            if current:
                out.append(current)
            current = []
            continue
        if skip_next:
            skip_next = False
            continue
        current.append(token)
    if current:
        out.append(current)
    return out


def is_python(token: str) -> bool:
    return re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", token) is not None


def is_torchrun(token: str) -> bool:
    return re.fullmatch(r"(\S*/)?torchrun", token) is not None


def launcher_target(launcher: Path, env_assignments: dict):
    """The training script a launcher hands its extra flags to, or None."""
    if "SCRIPT" in env_assignments:
        return env_assignments["SCRIPT"]
    text = launcher.read_text()
    m = re.search(r"^SCRIPT=(?:\$\{SCRIPT:-([^}]+)\}|([\w./-]+\.py))", text, re.M)
    if m:
        return m.group(1) or m.group(2)
    exec_lines = [line for line in text.splitlines() if re.match(r"\s*(exec|srun)\b", line)]
    found = {s for line in exec_lines for s in re.findall(r"[\w./-]+\.py", line) if (ROOT / s).is_file()}
    return found.pop() if len(found) == 1 else None


def script_invocations(tokens):
    """(kind, script, args) for the project-script run in one simple command, or None.

    kind: "torchrun" (args start with torchrun's own flags), "python", or "launcher"."""
    env, i = {}, 0
    while i < len(tokens) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[i]):
        key, value = tokens[i].split("=", 1)
        env[key] = value
        i += 1
    for j in range(i, len(tokens)):
        token = tokens[j]
        rest = tokens[j + 1:]
        if is_torchrun(token):
            return "torchrun", None, rest, env
        if is_python(token):
            k = 0
            while k < len(rest) and rest[k].startswith("-") and rest[k] not in ("-m", "-c"):
                k += 1  # interpreter flags such as -u
            if k < len(rest) and rest[k] == "-m":
                if k + 1 < len(rest) and rest[k + 1] == "torch.distributed.run":
                    return "torchrun", None, rest[k + 2:], env
                return None  # pytest and other modules: not a project script
            if k < len(rest) and rest[k].endswith("torchrun_bounded.py"):  # torchrun, with torchrun's flags
                return "torchrun", None, rest[k + 1:], env
            if k < len(rest) and rest[k].endswith(".py"):
                return "python", rest[k], rest[k + 1:], env
            return None
        if token in ("bash", "sh", "sbatch") or re.fullmatch(r"\.?/?scripts/\S+\.(sh|sbatch)", token):
            target = rest[0] if token in ("bash", "sh", "sbatch") and rest else token
            rest = rest[1:] if token in ("bash", "sh", "sbatch") else rest
            if token == "sbatch":  # sbatch's own options come before the file
                while rest and target.startswith("-"):
                    target, rest = rest[0], rest[1:]
            if target.endswith((".sh", ".sbatch")):
                return "launcher", target, rest, env
            return None
    return None


def scripts_the_docs_run():
    """Every .py a documented command runs (after python, torchrun, or a `--`), plus the known ones."""
    found = {*TRAINING_SCRIPTS, *TOOLS}
    for _, kind, script, args, _ in project_commands():
        if kind == "python":
            found.add(script)
        found.update(a for a in args if a.endswith(".py") and not a.startswith("-"))
    return sorted(s for s in found if (ROOT / s).is_file())


@lru_cache(maxsize=None)
def option_table():
    """{script or "torchrun": {option string: takes a value}} from the real parsers."""
    scripts = scripts_the_docs_run()
    proc = subprocess.run([sys.executable, "-c", CAPTURE_PARSERS, TORCHRUN, *scripts], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"capturing the parsers failed:\n{proc.stdout}\n{proc.stderr}"
    table = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, entry in table.items():
        assert "options" in entry, f"no parser from {name}: {entry.get('error')}"
    return {name: entry["options"] for name, entry in table.items()}


# Runs each script as __main__ with sys.argv = [script, "--", "distributed.py"]; its first parse_known_args call
# (which parse_args makes) raises Captured with the parser instead of parsing.
CAPTURE_PARSERS = r"""
import argparse, json, runpy, sys

class Captured(BaseException):  # not an Exception: passes through the scripts' handlers
    def __init__(self, parser):
        self.parser = parser

def capture(self, args=None, namespace=None):
    raise Captured(self)

def options_of(parser):  # {option string: takes a value}, sub-commands' too (netns_hosts.py up --own-name)
    options = {}
    for action in parser._actions:
        options.update({s: action.nargs != 0 for s in action.option_strings})
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options.update(options_of(sub))
    return options

argparse.ArgumentParser.parse_known_args = capture
argparse.ArgumentParser.parse_known_intermixed_args = capture
table = {}
for name in sys.argv[1:]:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if name == "torchrun":
            sys.argv = ["torchrun"]
            runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [name, "--", "distributed.py"]  # a wrapper like fault_injection.py wants "--"
            sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(name)))
            runpy.run_path(name, run_name="__main__")
        table[name] = {"error": "it never parsed its arguments"}
    except Captured as c:
        table[name] = {"options": options_of(c.parser)}
    except BaseException as e:
        table[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
print(json.dumps(table))
"""


def check_script_flags(script: str, args, where: str):
    """Every --flag in args is an option of script; `--` hands the rest to another script."""
    if script in saved_programs():  # a lesson's own program: it takes no flags
        return [f"{where}: {script} takes no flags"] if any(a.startswith("--") for a in args) else []
    problems = []
    path = ROOT / script
    if not path.is_file():
        return [f"{where}: {script} does not exist"]
    options = option_table().get(script)
    if options is None:
        return [f"{where}: {script} is not a script whose flags this test knows"]
    for k, token in enumerate(args):
        if token == "--":  # the rest is another script's (tests/fault_injection.py ... -- distributed.py ARGS)
            rest = args[k + 1:]  # or a whole command (scripts/netns_hosts.py run HOST -- torchrun ...)
            if rest and rest[0].endswith(".py"):
                problems += check_script_flags(rest[0], rest[1:], where)
            elif rest:
                problems += check_command(rest, where)
            break
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            if name not in options:
                problems.append(f"{where}: {script} has no option {name}")
    return problems


def check_torchrun(args, where: str):
    options = option_table()[TORCHRUN]
    k = 0
    while k < len(args) and args[k].startswith("-"):
        name, has_value = args[k].split("=", 1)[0], "=" in args[k]
        if name not in options:
            return [f"{where}: torchrun has no option {name}"]
        k += 2 if options[name] and not has_value else 1
    if k >= len(args):
        return [f"{where}: torchrun without a script"]
    if args[k].endswith(".py"):
        return check_script_flags(args[k], args[k + 1:], where)  # a lesson's saved program included
    return [f"{where}: torchrun runs {args[k]}, not a .py script of this project"]


def all_command_blocks():
    return [b for path in doc_files() for b in blocks_of(path) if b.lang in ("bash", "sh", "shell", "console")]


def project_commands():
    """(where, kind, script, args, env) for every command that runs a project script."""
    found = []
    for block in all_command_blocks():
        for n, command in enumerate(shell_commands(block)):
            for tokens in segments(command):
                hit = script_invocations(tokens)
                if hit:
                    found.append((f"{block.where} (command {n + 1}: {command[:70]})", *hit))
    return found


# --- the checks ------------------------------------------------------------------------------

def test_the_lessons_and_the_index_exist():
    missing = [name for name in ["README.md", *LESSONS] if not (TUTORIALS / name).is_file()]
    assert not missing, f"missing in tutorials/: {missing}"


def check_invocation(kind, script, args, env, where: str):
    """The flags of one project-script invocation (script_invocations' answer)."""
    if kind == "torchrun":
        return check_torchrun(args, where)
    if kind == "python":
        return check_script_flags(script, args, where)
    launcher = ROOT / script.lstrip("./") if script.startswith("./") else ROOT / script
    if not launcher.is_file():
        return [f"{where}: launcher {script} does not exist"]
    target = launcher_target(launcher, env)
    flags = [a for a in args if a.startswith("--")]
    return check_script_flags(target, args, where) if flags and target else []  # extra flags go on


def check_command(tokens, where: str):
    """A command that a script runs for us (netns_hosts.py run HOST -- COMMAND): checked like a
    command line if it runs a project script (`env VAR=value` in front allowed), else left alone."""
    if tokens and tokens[0] == "env":
        tokens = tokens[1:]
    hit = script_invocations(tokens)
    return check_invocation(*hit, where) if hit else []


def test_commands_use_only_flags_their_scripts_accept():
    commands = project_commands()
    assert len(commands) >= 20, f"expected the docs to hold many runnable commands, found {len(commands)}"
    problems = []
    for where, kind, script, args, env in commands:
        problems += check_invocation(kind, script, args, env, where)
    assert not problems, "\n".join(problems)


def test_the_flag_checker_catches_a_wrong_flag():
    # The checker itself: a misspelt flag, an unknown torchrun flag and a missing script fail.
    assert check_script_flags("distributed.py", ["--batch-size", "64", "--epochs=1"], "x") == []
    assert check_script_flags("distributed.py", ["--batch-sise", "64"], "x")
    assert check_script_flags("distributed_mp.py", ["--nproc-per-node", "2", "--accum-steps", "2"], "x")
    assert check_torchrun(["--standalone", "--nproc_per_node", "2", "distributed.py", "--epochs", "1"], "x") == []
    assert check_torchrun(["--nproc_per_nodes=2", "distributed.py"], "x")
    assert check_torchrun(["--standalone", "nosuch.py"], "x")
    # A command after `--` (netns_hosts.py run HOST -- ...): checked if it runs a project script.
    assert check_script_flags("scripts/netns_hosts.py", ["run", "nodea", "--", "getent", "hosts", "nodea"], "x") == []
    assert check_script_flags("scripts/netns_hosts.py", ["run", "nodea", "--", "env", "A=1", "torchrun",
                                                         "--standalone", "distributed.py", "--epochs", "1"], "x") == []
    assert check_script_flags("scripts/netns_hosts.py", ["run", "nodea", "--", "python", "distributed.py",
                                                         "--epoch", "1"], "x")
    assert check_script_flags("scripts/netns_hosts.py", ["up", "--two-interfaces"], "x") == []
    hit = script_invocations(next(iter(segments("OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run "
                                                "--standalone --nproc_per_node=2 distributed.py --epochs 1"))))
    assert hit[0] == "torchrun" and hit[2][-3:] == ["distributed.py", "--epochs", "1"]


def quoted_blocks():
    return [b for path in doc_files() for b in blocks_of(path) if FROM_LINE.match(b.intro)]


def appears_verbatim(quote_lines, source_lines) -> bool:
    """The quote, dedented and stripped at its ends, equals a run of source lines dedented alike."""
    quote = textwrap.dedent("\n".join(quote_lines)).strip("\n").splitlines()
    quote = [line.rstrip() for line in quote]
    if not quote:
        return False
    n = len(quote)
    for start in range(len(source_lines) - n + 1):
        if source_lines[start].strip() != quote[0].strip():
            continue
        window = textwrap.dedent("\n".join(source_lines[start:start + n])).splitlines()
        if [line.rstrip() for line in window] == quote:
            return True
    return False


def test_quoted_code_is_verbatim_from_the_named_file():
    blocks = quoted_blocks()
    assert len(blocks) >= 12, f"expected the lessons to quote their scripts, found {len(blocks)} quotes"
    problems = []
    for block in blocks:
        name = FROM_LINE.match(block.intro).group(1)
        source = ROOT / name
        if not source.is_file():
            problems.append(f"{block.where}: quotes {name}, which does not exist")
        elif not appears_verbatim(block.lines, source.read_text().splitlines()):
            problems.append(f"{block.where}: this block is not verbatim in {name}")
    assert not problems, "\n".join(problems)


def test_the_quote_checker_catches_an_edit():
    source = ["def f():", "    x = 1", "    return x"]
    assert appears_verbatim(["x = 1", "return x"], source)
    assert appears_verbatim(["  def f():", "      x = 1"], source)
    assert not appears_verbatim(["x = 2", "return x"], source)
    assert not appears_verbatim(["x = 1", "", "return x"], source)


def snippets():
    out = []
    saved = set(saved_programs().values())
    for path in doc_files():
        for block in blocks_of(path):
            quoted = FROM_LINE.match(block.intro)  # a quote of a file, checked elsewhere
            not_run = block.lines and block.lines[0].strip() == "# not run"
            if block.lang in ("python", "py") and not quoted and not not_run and block not in saved:
                out.append(block)
    return out


def test_snippet_count():
    assert len(snippets()) >= 8, "the lessons should carry runnable snippets"


@pytest.mark.parametrize("block", snippets(), ids=lambda b: b.where)
def test_snippet_runs(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.text + "\n")
    try:
        # Run from a scratch folder: whatever a snippet writes stays out of the repository.
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(),
                              capture_output=True, text=True, timeout=SNIPPET_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: the snippet ran longer than {SNIPPET_TIMEOUT} s")
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_every_script_is_linked_from_a_lesson():
    linked = set()
    for lesson in lesson_files():
        for target in links_of(lesson):
            linked.add((lesson.parent / target).resolve())
    wanted = [ROOT / s for s in [*TRAINING_SCRIPTS, *TOOLS]] + launchers()
    missing = [rel(p) for p in wanted if p.resolve() not in linked]
    assert not missing, f"not linked from any lesson in tutorials/: {missing}"


def test_readme_links_the_tutorials_and_the_index_links_every_lesson():
    readme_targets = [(ROOT / t).resolve() for t in links_of(ROOT / "README.md")]
    assert any(TUTORIALS.resolve() in t.parents or t == TUTORIALS.resolve() for t in readme_targets), \
        "README.md does not link to tutorials/"
    index_targets = {(TUTORIALS / t).resolve() for t in links_of(TUTORIALS / "README.md")}
    missing = [p.name for p in lesson_files() if p.resolve() not in index_targets]
    assert not missing, f"tutorials/README.md does not link {missing}"


def test_relative_links_point_to_existing_files():
    problems = []
    for path in doc_files():
        for target in links_of(path):
            if target and not (path.parent / target).exists():
                problems.append(f"{rel(path)}: broken link {target}")
    assert not problems, "\n".join(problems)


# --- lesson 00's first DDP program -----------------------------------------------------------

FIRST_LESSON = TUTORIALS / "00-basic-theory.md"


def first_program_blocks():
    """The plain program, the DDP program, the diff block and the command block of lesson 00."""
    programs = saved_programs()
    plain, ddp = programs["train.py"], programs["train_ddp.py"]
    blocks = blocks_of(FIRST_LESSON)
    diff = next(b for b in blocks if b.lang == "diff")
    run = next(b for b in blocks if b.lang == "bash" and any("train_ddp.py" in c for c in shell_commands(b)))
    return plain, ddp, diff, run


def test_the_first_programs_diff_is_the_real_diff():
    plain, ddp, diff, _ = first_program_blocks()
    expected = difflib.unified_diff([line + "\n" for line in plain.lines], [line + "\n" for line in ddp.lines], n=1)
    expected = [line.rstrip("\n") for line in expected][2:]  # the ---/+++ header names files, not content
    assert diff.lines == expected, (f"{diff.where}: the diff is not `diff -U1 train.py train_ddp.py`:\n"
                                    + "\n".join(expected))


def run_block(commands, cwd, timeout=600):
    """Run a block's commands with bash in cwd: `python` and `torchrun` are this interpreter's."""
    bindir = cwd / ".docs-bin"
    bindir.mkdir(exist_ok=True)
    for name, target in (("python", sys.executable),
                         ("torchrun", f"{sys.executable} -m torch.distributed.run")):
        shim = bindir / name
        shim.write_text(f"#!/bin/sh\nexec {target} \"$@\"\n")
        shim.chmod(0o755)
    env = subprocess_env(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    lines = []
    for command in commands:
        # A command the lesson says fails on purpose ("# exit status N: ...") must fail that way.
        expected = re.search(r"#\s*exit status (\d+)", command)
        lines.append(f"{{ {command[:expected.start()].rstrip()}\n}} || [ $? -eq {expected.group(1)} ]"
                     if expected else command)
    script = "set -e\n" + "\n".join(lines) + "\n"
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_first_ddp_program_runs_twice_as_shown(tmp_path):
    plain, ddp, _, run = first_program_blocks()
    (tmp_path / "train.py").write_text(plain.text + "\n")
    (tmp_path / "train_ddp.py").write_text(ddp.text + "\n")
    for attempt in (1, 2):  # a reader runs it again: it must work the same
        proc = run_block(shell_commands(run), tmp_path)
        assert proc.returncode == 0, f"{run.where}, run {attempt}:\n{proc.stdout}\n{proc.stderr}"
        assert proc.stdout.count("epoch 2: last batch loss") == 2, proc.stdout  # train.py, then rank 0 only
        assert (tmp_path / "model.pt").is_file()


# --- command blocks that keep state, run twice ---------------------------------------------------

# A block keeps state between runs if it writes or removes a fixed path.
STATEFUL = re.compile(r"--checkpoint-dir|--metrics|--resume|file://|\brm\b|scripts/launch_")
# By default the suite runs twice only lesson 00's first program (above), the block a newcomer is
# likeliest to run again: each stateful block below starts 4 to 10 Python processes per run, minutes
# in all on 2 cores. DOCS_RUN_TWICE=all runs every one twice; the static check below covers what makes
# them safe to repeat (a fixed checkpoint folder is removed first or resumed).
NOT_RUN_HERE = re.compile(r"\b(sbatch|srun|scontrol)\b")  # needs a SLURM cluster


def stateful_blocks():
    out = []
    for path in lesson_files():
        for block in blocks_of(path):
            if block.lang not in ("bash", "sh", "shell") or FROM_LINE.match(block.intro):
                continue  # quotes of a launcher are not commands to run
            commands = shell_commands(block)
            if any(STATEFUL.search(c) for c in commands) and not any(NOT_RUN_HERE.search(c) for c in commands):
                out.append(block)
    return out


def scratch_copy(tmp: Path) -> Path:
    """The repository's files, linked into tmp: commands write runs/ there, not here."""
    for entry in ROOT.iterdir():
        if entry.name in (".git", "runs", "data", "checkpoints", ".pytest_cache", ".venv-floor"):
            continue  # .venv stays: the launchers run .venv/bin/python
        (tmp / entry.name).symlink_to(entry)
    return tmp


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return scratch_copy(tmp_path_factory.mktemp("tutorial-commands"))


def test_the_stateful_blocks_are_found():
    names = {(b.path.name, c) for b in stateful_blocks() for c in shell_commands(b)}
    for lesson, fragment in (("02-ddp-in-detail.md", "rm -rf runs/tutorial/straight"),
                             ("06-beyond-one-machine.md", "rm -rf runs/tutorial/preempted")):
        assert any(lesson == name and fragment in c for name, c in names), (lesson, fragment)
    assert len(stateful_blocks()) >= 5


def test_blocks_that_write_checkpoints_can_run_again():
    """A block that trains into a fixed --checkpoint-dir removes it first or continues it with --resume:
    otherwise its second run stops ("already holds a checkpoint")."""
    problems = []
    for block in stateful_blocks():
        removed = set()
        for command in shell_commands(block):
            tokens = [t for seg in segments(command) for t in seg]
            if tokens[:2] == ["rm", "-rf"]:
                removed.update(tokens[2:])
            for flag in re.findall(r"--checkpoint-dir[= ](\S+)", command):
                if flag not in removed and "--resume" not in command and "scripts/launch_" not in command:
                    problems.append(f"{block.where}: --checkpoint-dir {flag} is neither removed first nor resumed")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(os.environ.get("DOCS_RUN_TWICE") != "all", reason="run with DOCS_RUN_TWICE=all (minutes "
                    "on a small CPU)")
@pytest.mark.parametrize("block", stateful_blocks(), ids=lambda b: b.where)
def test_stateful_block_runs_twice(block, scratch):
    for attempt in (1, 2):
        proc = run_block(shell_commands(block), scratch)
        assert proc.returncode == 0, (f"{block.where}, run {attempt} of 2 exited {proc.returncode}\n"
                                      f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


# --- what a refused or failing command prints -------------------------------------------------------

ERROR_LINE = re.compile(r"^([\w./-]+\.py): error: \S.*$")
# An error as Python prints it last in a traceback: `RuntimeError: ...`, `utils.distributed.MissedCollective: ...`
# (not torchrun's own `SignalException: Process PID got signal`, which names a process id).
EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(?:\w+Error|MissedCollective): \S.*$")
EXIT_STATUS = re.compile(r"#\s*exit status (\d+)")
TEST_BED = re.compile(r"scripts/netns_hosts\.py")  # several hosts on one machine: commands that need each other


def expected_status(command: str) -> int:
    """The exit status a command is said to end with (`# exit status N`); 2, a refusal's, if unsaid."""
    m = EXIT_STATUS.search(command)
    return int(m.group(1)) if m else 2


def shown_failures():
    """(command block, output block, shown lines): a lesson's bash block followed directly by a text
    block that shows what its commands print when they fail: `SCRIPT: error: ...` lines (a refusal),
    and, where a command says how it ends (`# exit status N`), the exception lines of a traceback."""
    found = []
    for path in lesson_files():
        blocks = blocks_of(path)
        for commands, output in zip(blocks, blocks[1:]):
            if commands.lang != "bash" or output.lang != "text" or FROM_LINE.match(commands.intro):
                continue
            said = any(EXIT_STATUS.search(c) for c in shell_commands(commands))
            shown = [line.rstrip() for line in output.lines
                     if ERROR_LINE.match(line.rstrip()) or (said and EXCEPTION_LINE.match(line.rstrip()))]
            if shown:
                found.append((commands, output, shown))
    return found


def printed_as_shown(shown: str, printed: str) -> bool:
    """A shown line is the printed one word for word, where it shows `[...]` any text (a path, an address)."""
    return re.fullmatch(".*".join(re.escape(part) for part in shown.split("[...]")), printed) is not None


def test_the_shown_failures_are_found():
    shown = {(b.path.name, line) for _, b, lines in shown_failures() for line in lines}
    assert any(name == "03-ddp-training-tricks.md" and "--sync-bn needs GPUs" in line for name, line in shown), shown
    for fragment in ("MissedCollective: rank 0 waited in metrics.evaluate()", "Timed out waiting 3000ms for recv",
                     "rank 0 could not join the gloo process group"):
        assert any(name == "09-debugging.md" and fragment in line for name, line in shown), (fragment, shown)


def test_the_shown_line_matcher():
    assert printed_as_shown("RuntimeError: [...] Timed out", "RuntimeError: [/a/b.cc:78] Timed out")
    assert not printed_as_shown("RuntimeError: [...] Timed out", "RuntimeError: [/a/b.cc:78] Timed out twice")
    assert printed_as_shown("a (b) c", "a (b) c") and not printed_as_shown("a (b) c", "a (b) d")


@pytest.mark.parametrize("failure", shown_failures(), ids=lambda r: r[1].where)
def test_a_shown_failure_is_what_the_command_prints(failure, scratch):
    """Each line shown after a command block is printed, word for word (but for `[...]`), on stdout or
    stderr by one of its commands, which exits with the status it says (`# exit status N`), or 2, a
    refusal's (run on the CPU, as the lessons' outputs were). The commands run last to first and stop
    once every shown line has been printed: a block that trains first and is refused second runs only
    the refusal."""
    commands, output, shown = failure
    if any(TEST_BED.search(c) for c in shell_commands(commands)):
        pytest.skip("drives the multi-host test bed (root, network namespaces) through shell loops and jobs: "
                    "a block to run whole, which DOCS_RUN_TWICE=all does")
    missing, printed = list(shown), []
    for command in reversed(shell_commands(commands)):
        if not missing:
            break
        said = EXIT_STATUS.search(command)
        proc = run_block([command[:said.start()].rstrip() if said else command], scratch, timeout=SNIPPET_TIMEOUT)
        lines = [line.rstrip() for line in (proc.stdout + proc.stderr).splitlines()]
        found = [s for s in missing if any(printed_as_shown(s, line) for line in lines)]
        if found:
            assert proc.returncode == expected_status(command), (
                f"{commands.where}: `{command[:70]}` exited {proc.returncode}, not {expected_status(command)}\n"
                f"{proc.stderr[-4000:]}")
        missing = [s for s in missing if s not in found]
        printed += [line for line in lines if ERROR_LINE.match(line) or EXCEPTION_LINE.match(line)]
    assert not missing, (f"{output.where} shows lines that no command of {commands.where} prints:\n"
                         + "\n".join(missing) + "\nprinted:\n" + "\n".join(printed))
