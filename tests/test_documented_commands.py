"""Every documented command of an example or benchmark script takes the flags it shows, and the short ones run.

The fenced code blocks of README.md and the guides in docs/ (docs/results/ records past runs) are searched for
commands that call `examples/*.py` or `benchmarks/*.py` (with `python`, `accelerate launch` or `torchrun`); each flag
after the script's path must be one its parser knows. The one-process commands on the embedded LLM with data the
repository ships run for 2 steps (`--max_steps 2`, evaluation on a few sentences), as a user would run them from a
clone.
"""

from __future__ import annotations

import argparse
import codecs
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?:^|\s)((?:examples|benchmarks)/[\w/]+\.py)(?=\s|$)")
EMBEDDED_LLM = '"$(hf-zo embedded-llm)"'


def fenced_blocks(text: str, languages=("bash", "sh", "shell", "console", "")) -> list[str]:
    """The bodies of `text`'s fenced code blocks in one of `languages`."""
    blocks, body, language = [], None, None
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence and body is None:
            body, language = [], fence.group(1)
        elif fence:
            if language in languages:
                blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def fenced_commands(path: Path) -> list[str]:
    """The commands of `path`'s fenced code blocks that run a script of examples/ or benchmarks/, one line each."""
    commands = []
    for block in fenced_blocks(path.read_text()):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            if line and not line.startswith("#") and SCRIPT.search(line):
                commands.append(line)
    return commands


COMMANDS = [(path.relative_to(ROOT).as_posix(), command) for path in DOCUMENTS for command in fenced_commands(path)]


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def script_parser(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `script` builds: the one its `main()` reaches (stopped there, before any work)."""
    name = "documented_" + re.sub(r"\W", "_", script)
    spec = importlib.util.spec_from_file_location(name, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str((ROOT / script).parent))  # as `python script` puts the script's folder first
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    if hasattr(module, "make_parser"):  # TRL's convention (examples/sft.py)
        return module.make_parser()

    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(_Parsed) as parsed:
        module.main()
    return parsed.value.parser


def ansi_c_quoted(match: re.Match) -> str:
    """Bash's `$'...'` (escapes such as `\\n` decoded) as a string shlex reads."""
    return shlex.quote(codecs.decode(match.group(1), "unicode_escape"))


def script_and_flags(command: str) -> tuple[str, list[str]]:
    command = re.sub(r"\$'((?:[^'\\]|\\.)*)'", ansi_c_quoted, command.replace(EMBEDDED_LLM, "EMBEDDED_LLM"))
    tokens = shlex.split(command)
    (index,) = [i for i, token in enumerate(tokens) if SCRIPT.fullmatch(" " + token)]
    return tokens[index], tokens[index + 1 :]


def test_the_documents_show_commands_of_both_scripts():
    scripts = {script_and_flags(command)[0] for _, command in COMMANDS}
    assert {"examples/train.py", "examples/sft.py"} <= scripts


@pytest.mark.parametrize("script", sorted({script_and_flags(c)[0] for _, c in COMMANDS}))
def test_every_flag_of_a_documented_command_is_one_its_script_takes(script, monkeypatch):
    known = {option for action in script_parser(script, monkeypatch)._actions for option in action.option_strings}
    unknown = {
        (document, flag.split("=", 1)[0])
        for document, command in COMMANDS
        if script_and_flags(command)[0] == script
        for flag in script_and_flags(command)[1]
        if flag.startswith("--") and flag.split("=", 1)[0] not in known
    }
    assert not unknown, f"flags {script} does not take: {sorted(unknown)}"


def test_no_documented_command_reaches_outside_the_repository():
    """Commands run from the repository root, so a path starting with `../` names what a clone does not hold."""
    documents = [*DOCUMENTS, *sorted((ROOT / "docs" / "results").glob("*.md")), ROOT / "examples" / "README.md"]
    for path in documents:
        for block in fenced_blocks(path.read_text()):
            assert not re.search(r"(^|[\s='\"])\.\./", block), f"{path.relative_to(ROOT)}: {block[:200]}"


def runnable(command: str) -> bool:
    """A one-process command on the embedded LLM whose data files the repository holds. Launches of several
    processes are tests/test_launch.py's, quantized bases (slow bitsandbytes kernels on a CPU)
    tests/test_quantized.py's.
    """
    script, flags = script_and_flags(command)
    if not command.startswith("python ") or any(flag.startswith("--load_in_") for flag in flags):
        return False
    files = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag in ("--train_file", "--validation_file")]
    return (
        script.startswith("examples/")
        and EMBEDDED_LLM in command
        and files
        and all((ROOT / f).is_file() for f in files)
    )


SHORT = [(document, command) for document, command in COMMANDS if runnable(command)]


def shortened(flags: list[str], output_dir: Path, llm: str) -> list[str]:
    """`flags` with 2 steps, 8 evaluated examples and `output_dir`, the embedded LLM's folder filled in."""
    argv, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag in ("--max_steps", "--output_dir", "--num_eval"):
            skip = True
            continue
        argv.append(llm if flag == "EMBEDDED_LLM" else flag)
    return [*argv, "--max_steps", "2", "--output_dir", str(output_dir)]


@pytest.mark.parametrize(("document", "command"), SHORT, ids=[f"{d}:{i}" for i, (d, _) in enumerate(SHORT)])
def test_a_short_documented_command_runs_from_the_clone(document, command, tmp_path, monkeypatch):
    from hf_zo.models import embedded_llm_path

    sys.path.insert(0, str(Path(__file__).parent))
    from launch_worker import run_example

    monkeypatch.chdir(ROOT)  # the commands' paths are relative to the repository root
    script, flags = script_and_flags(command)
    argv = shortened(flags, tmp_path / "out", embedded_llm_path())
    if script == "examples/train.py" and "--validation_file" in argv:
        argv += ["--num_eval", "8"]
    trainer, _ = run_example(Path(script).stem, argv)
    assert trainer.state.global_step == 2


def readme_quick_start() -> str:
    """The Python block under README.md's "Quick start" heading."""
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return fenced_blocks(section, languages=("python",))[0]


def test_the_readme_is_short_undated_and_its_quick_start_fits_in_15_lines():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert len(readme_quick_start().strip().splitlines()) <= 15


def test_the_readme_quick_start_runs_as_written(tmp_path, monkeypatch):
    code = readme_quick_start()
    assert "max_steps=20" in code
    monkeypatch.chdir(tmp_path)  # its output_dir lands here
    namespace = {}
    exec(compile(code.replace("max_steps=20", "max_steps=2"), "README.md", "exec"), namespace)
    lora_b = [p for n, p in namespace["model"].named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # LoRA's B starts at zero: ZO moved it
