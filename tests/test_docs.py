"""README.md and docs/*.md against the code: every `lmsrt ...` command shown in a code block
parses (its subcommand's options are the CLI's own), and every relative link points at a file
that exists. So the docs cannot drift from the CLI or from the tree."""
import pathlib
import re
import shlex

import click
import pytest
import torch
from click.testing import CliRunner

from lmsrt._cli import COMMANDS, main

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def code_lines(text: str):
    """The lines of the fenced code blocks of ``text``, continuation lines (``\\``) joined."""
    for block in FENCE.findall(text):
        yield from block.replace("\\\n", " ").splitlines()


SEPARATORS = (";", "&&", "||", "|", ">", ">>", "2>", "&")


def _starts_command(before) -> bool:
    """Whether a word after ``before`` (the words of its line before it) begins a command: first
    on the line, after a separator, after ``VAR=value`` words only, or after ``python -m``."""
    since = before[max((i + 1 for i, w in enumerate(before) if w in SEPARATORS), default=0):]
    return all("=" in word and not word.startswith("-") for word in since) or \
        since[-2:] == ["python", "-m"]


def lmsrt_commands(text: str):
    """Each ``lmsrt SUBCOMMAND ARGS`` in the code blocks of ``text``, as a list of words; words
    after a ``#`` comment are left out, as are other commands on the line (``;``, ``&&``, ``|``,
    ``>``). ``lmsrt`` as an argument (``--methods lmsrt``) is no command."""
    for line in code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for start, word in enumerate(words):
            if word == "lmsrt" and start + 1 < len(words) and _starts_command(words[:start]):
                command = []
                for rest in words[start + 1:]:
                    if rest in SEPARATORS:
                        break
                    command.append(rest)
                yield command


def lmsrt_options(command: click.Command, args):
    """The words of ``args`` that are ``command``'s own: up to ``--`` or the script (the first
    word that is not an option or an option's value); the script's arguments are its own."""
    takes = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for opt in param.opts + param.secondary_opts:
                takes[opt] = not (param.is_flag or param.count)
    own, words = [], list(args)
    while words:
        word = words.pop(0)
        if word == "--" or not word.startswith("-"):
            break
        own.append(word)
        if takes.get(word) and words:
            own.append(words.pop(0))
    return own


def _shown_commands():
    for page in PAGES:
        for command in lmsrt_commands(page.read_text(encoding="utf-8")):
            yield pytest.param(command, id=f"{_name(page)}: lmsrt {' '.join(command)}"[:120])


def test_the_docs_show_commands_of_each_kind():
    shown = {command[0] for command in (p.values[0] for p in _shown_commands())}
    assert {"run", "tune", "profile", "info", "build"} <= shown, shown


def bad_values(command: click.Command, own):
    """The options of ``own`` (as ``lmsrt_options`` gives them) whose values ``command`` refuses,
    each with click's message: ``--help`` stops parsing before values are checked."""
    options = {opt: param for param in command.params if isinstance(param, click.Option)
               for opt in param.opts + param.secondary_opts}
    ctx, bad, words = click.Context(command, info_name=command.name), [], list(own)
    while words:
        word = words.pop(0)
        flag, _, value = word.partition("=")
        param = options.get(flag)
        if param is None or param.is_flag or param.count:
            continue
        value = value if "=" in word else words.pop(0)
        try:
            param.process_value(ctx, (value,) if param.multiple else value)
        except click.BadParameter as e:
            bad.append(f"{flag} {value}: {e.message}")
    return bad


@pytest.mark.parametrize("command", _shown_commands())
def test_each_command_shown_parses(command):
    name, *args = command
    assert name in COMMANDS, f"lmsrt has no subcommand {name!r}: {sorted(COMMANDS)}"
    own = lmsrt_options(main.get_command(None, name), args)
    result = CliRunner().invoke(main, [name, *own, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output, (own, result.output)
    assert not bad_values(main.get_command(None, name), own)


def test_an_option_that_is_not_there_fails():
    # The check above can fail: a flag lmsrt run does not have is an error, a flag after the
    # script is the script's.
    run = main.get_command(None, "run")
    own = lmsrt_options(run, ["--lms", "1000", "--no-such", "train.py", "--epochs", "3"])
    assert own == ["--lms", "1000", "--no-such"]
    assert CliRunner().invoke(main, ["run", *own, "--help"]).exit_code == 2
    assert lmsrt_options(run, ["--gpu-limit", "12", "-m", "pkg.train", "--lr", "1"]) == \
        ["--gpu-limit", "12", "-m"]
    assert bad_values(run, ["--lms-frac", "2", "--lms=abc", "-m", "--gpu-limit", "12"]) == [
        "--lms-frac 2: 2 is not in [0, 1]; give the fraction of GPU memory used before swapping "
        "starts, or auto, e.g. --lms-frac 0.75",
        "--lms abc: 'abc' is not a number; give the size threshold in KiB (0 turns swapping off), "
        "e.g. --lms 1000"]
    tune = main.get_command(None, "tune")
    assert lmsrt_options(tune, ["--grid", "--steps", "6", "--", "train.py", "--grid"]) == \
        ["--grid", "--steps", "6"]


def test_commands_are_found_in_code_blocks_only():
    text = ("Prose `lmsrt run --nope x.py`.\n\n```bash\nLMSRT_DEVICE=sim lmsrt run --lms 1 \\\n"
            "    x.py --a  # comment --b\ncd x && lmsrt info --json > out.json\n"
            "python bench.py --methods lmsrt --compile\npython -m lmsrt build\n```\n")
    assert list(lmsrt_commands(text)) == [["run", "--lms", "1", "x.py", "--a"],
                                          ["info", "--json"], ["build"]]


def relative_links(page: pathlib.Path):
    """The relative targets of the Markdown links and images of ``page``, anchors dropped."""
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                                       # http:, mailto:, an anchor here
        yield target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_point_at_files_that_exist(page):
    missing = [target for target in relative_links(page)
               if not (page.parent / target).exists()]
    assert not missing, f"{_name(page)} links to what is not there: {missing}"


def test_readme_links_every_docs_page():
    readme = set(relative_links(ROOT / "README.md"))
    pages = {f"docs/{page.name}" for page in PAGES[1:]}
    assert pages and pages <= readme, pages - readme


def settings_table(text: str):
    """The rows of README's settings table: {setting: (flag, variable, default)}."""
    section = text[text.index("## Settings"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("setting", "---"):
            rows[cells[0]] = tuple(cells[1:4])
    return rows


def test_readme_settings_table_is_the_options_table():
    from lmsrt.options import OPTIONS, format_setting

    rows = settings_table((ROOT / "README.md").read_text(encoding="utf-8"))
    assert rows == {name: (option.flag or "", option.env, format_setting(option.default))
                    for name, option in OPTIONS.items()}


def test_readme_states_the_torch_that_pyproject_requires():
    """The floor in pyproject.toml is the one README gives a reason for."""
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"needs torch {floor} or later" in " ".join((ROOT / "README.md").read_text().split())
    assert hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")



def _words(path: str) -> str:
    return " ".join((ROOT / path).read_text(encoding="utf-8").split())


def test_run_md_explains_every_term_of_the_summary():
    from lmsrt.summary import LABELS

    run = _words("docs/run.md")
    assert not [label for label in LABELS if f"**{label}**" not in run]


def test_a_step_is_said_to_be_a_micro_batch():
    assert "A **step** is one forward and the backward after it: one micro-batch" in \
        _words("docs/run.md")
    assert "micro-batch, not an optimizer step" in _words("docs/tune.md")
    assert "A step is one forward and backward (a micro-batch), not an optimizer step" in \
        _words("README.md")


def test_readme_gives_a_quick_test_command_beside_the_full_one_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = 'python -m pytest -q -n 2 -m "not slow" tests  # quick: about 1 minute on 2 CPU cores'
    full = "python -m pytest -q -n 2 tests                # all (CI runs this): about 5 minutes"
    assert quick in readme and full in readme
    assert "\npython -m pytest -q -n 2 tests\n" in (ROOT / ".ci" / "run").read_text()


def test_byte_units_are_stated_truly():
    rows = {line.split("|")[1].strip(): line for line in
            (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")}
    assert "| KiB (1024 bytes);" in rows["`lms`"] and "(GiB, 2^30 bytes" in rows["`host_budget_gb`"]


def test_the_simulated_device_and_its_size_are_documented():
    from lmsrt.device import ENV_SIM_GB, sim_capacity
    from lmsrt.units import GiB

    assert sim_capacity({}) == GiB
    assert f"1 GiB unless `{ENV_SIM_GB}` says otherwise" in _words("docs/run.md")
    assert ENV_SIM_GB in _words("README.md")


def test_examples_leave_expandable_segments_to_lmsrt():
    told = [str(path.relative_to(ROOT)) for path in [*(ROOT / "examples").glob("*.py"),
                                                   ROOT / "docs" / "tune.md", ROOT / "README.md"]
            if "expandable_segments:True" in path.read_text(encoding="utf-8")]
    assert not told


def test_native_md_says_lmsrt_build_compiles_on_a_cpu_machine():
    assert "`lmsrt build` compiles it there too, against CPU torch" in _words("docs/native.md")
