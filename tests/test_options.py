"""The option table (`lmsrt.options`) and every place derived from it; `lms_frac="auto"` accepted
wherever a setting is given; torchrun's options taken from torchrun's parser."""
import ast
import dataclasses
import json
import pathlib
import re

import pytest
from click.testing import CliRunner
from processes import clean_env, write

import lmsrt
from lmsrt import units
from lmsrt._cli import main
from lmsrt._cli import run as run_cli
from lmsrt.config import ENV_VARS, LMSConfig
from lmsrt.options import AUTO, OPTIONS, env_value, format_setting, spelled
from lmsrt.profiler import render

# A value other than the default for each setting, as Python takes it.
OTHER = {"lms": 64.0, "lms_frac": 0.5, "prefetch_mb": 16.0, "host_budget_gb": 2.0,
         "recompute": True, "optimizer_state": "host", "pin_ahead": False, "device": "sim"}


def test_every_setting_has_another_value_in_this_test():
    # A new setting must be added here too, so the checks below cover it.
    assert set(OTHER) == set(OPTIONS)


def test_every_setting_is_a_config_field_with_the_tables_default():
    fields = {f.name: f.default for f in dataclasses.fields(LMSConfig)}
    assert fields == {name: option.default for name, option in OPTIONS.items()}
    assert all(f"{name}:" in LMSConfig.__doc__ and f"{name}:" in lmsrt.LMS.__doc__
               for name in OPTIONS)


def test_every_setting_is_read_from_its_environment_variable():
    assert ENV_VARS == {option.env: name for name, option in OPTIONS.items()}
    environ = {OPTIONS[name].env: env_value(value) for name, value in OTHER.items()}
    assert LMSConfig.from_env(environ).as_dict() == OTHER


def test_every_setting_is_an_lms_keyword_and_in_its_stats():
    lms = lmsrt.LMS(**OTHER)
    assert lms.stats()["config"] == OTHER
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch'; its settings "
                                        "are lms, lms_frac, prefetch_mb"):
        lmsrt.LMS(prefetch=1)


def test_every_setting_with_a_flag_is_an_option_of_lmsrt_run():
    params = {p.name: p for p in run_cli.command.params}
    for name, option in OPTIONS.items():
        if option.flag is None:
            assert name not in params
            continue
        assert params[name].opts == [option.flag]
        assert option.env in params[name].help


def test_lmsrt_run_hands_every_setting_to_lms(tmp_path, monkeypatch):
    script = write(tmp_path / "s.py", "")
    flags = [word for name, option in OPTIONS.items() if option.flag
             for word in (option.flag, format_setting(OTHER[name]))]
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(main, ["run", "--stats", str(stats), *flags, script],
                                env=clean_env())
    assert result.exit_code == 0, result.output
    assert json.loads(stats.read_text())["config"] == OTHER          # device: LMSRT_DEVICE=sim
    # Under torchrun they travel in the variables.
    environ = torchrun_argv(monkeypatch, "--nproc-per-node", "1", *flags, script)[1]
    for name, option in OPTIONS.items():
        if option.flag:
            assert environ[option.env] == env_value(OTHER[name])


class _Exec(Exception):
    pass


def torchrun_argv(monkeypatch, *args):
    """The argv lmsrt run would exec torchrun with, and the environment it would give it."""
    def execv(executable, argv):
        raise _Exec(argv)

    monkeypatch.setattr(run_cli.os, "environ", clean_env())
    monkeypatch.setattr(run_cli.os, "execv", execv)
    with pytest.raises(_Exec) as info:
        run_cli.command.main(list(args), standalone_mode=False)
    return info.value.args[0], run_cli.os.environ


def test_spelled():
    assert spelled("lms_frac") == "--lms-frac, LMSRT_LMS_FRAC"
    assert spelled("device") == "LMSRT_DEVICE"
    assert spelled("lms_frac", 0.5) == "--lms-frac 0.5, LMSRT_LMS_FRAC=0.5"
    assert spelled("device", "sim") == "LMSRT_DEVICE=sim"


def _message_strings(path: pathlib.Path):
    """The string constants of a module that are not docstrings, with their lines."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs]


def test_messages_spell_settings_through_the_table():
    """A message that names a setting's flag or variable takes it from the table (``spelled``,
    ``OPTIONS[name].flag``/``.env``), so that renaming one cannot leave a message behind. The
    click commands' help and usage examples (lmsrt/_cli/) are exempt."""
    ways = [way for option in OPTIONS.values() for way in (option.flag, option.env) if way]
    found = []
    for path in sorted(pathlib.Path(lmsrt.__file__).parent.rglob("*.py")):
        if path.name == "options.py" or "_cli" in path.parts:
            continue
        for line, text in _message_strings(path):
            found += [f"{path.name}:{line}: {way}" for way in ways
                      if re.search(re.escape(way) + r"(?![-\w])", text)]
    assert not found, found


def test_format_bytes_has_one_home():
    assert render.format_bytes is units.format_bytes
    assert units.format_bytes(3 * units.GiB // 2) == "1.50 GiB"


# -- lms_frac="auto" ------------------------------------------------------------------------------

def test_auto_is_accepted_wherever_a_setting_is_given():
    assert LMSConfig(lms_frac=AUTO).lms_frac == AUTO
    assert LMSConfig.from_env({"LMSRT_LMS_FRAC": "auto"}).lms_frac == AUTO
    lms = lmsrt.LMS(lms_frac="auto", device="sim")
    assert lms.enabled and lms.stats()["config"]["lms_frac"] == "auto"
    assert "lms_frac=auto" in lms.summary()
    with pytest.raises(TypeError, match="pass either config or lms_frac"):
        lmsrt.LMS(lms_frac="auto", config=LMSConfig())


@pytest.mark.parametrize("value", ["Auto", "half", "0.5", ""])
def test_other_strings_say_what_may_be_given(value):
    with pytest.raises(TypeError) as info:
        LMSConfig(lms_frac=value)
    assert (f"lms_frac must be a number (in [0, 1]) or 'auto', got str {value!r}; give e.g. "
            "lms_frac=0.75 or lms_frac='auto'") in str(info.value)


def test_other_strings_in_the_environment_and_flags_say_what_may_be_given(tmp_path):
    with pytest.raises(ValueError, match=r"LMSRT_LMS_FRAC='half' is not a number or auto; set it "
                                         r"to e.g. LMSRT_LMS_FRAC=0.75 or LMSRT_LMS_FRAC=auto"):
        LMSConfig.from_env({"LMSRT_LMS_FRAC": "half"})
    script = write(tmp_path / "s.py", "")
    result = CliRunner().invoke(main, ["run", "--lms-frac", "Auto", script], env=clean_env())
    assert result.exit_code == 2
    assert ("'Auto' is not a number or auto; give the fraction of GPU memory used before "
            "swapping starts, or auto, e.g. --lms-frac 0.75") in result.output


def test_lmsrt_run_with_auto(tmp_path):
    script = write(tmp_path / "mlp.py", "import torch\nm = torch.nn.Linear(64, 64)\n"
                   "for _ in range(3):\n    m(torch.randn(32, 64)).square().mean().backward()\n")
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(main, ["run", "--lms", "1", "--lms-frac", "auto", "--stats",
                                       str(stats), script], env=clean_env())
    assert result.exit_code == 0, result.output
    assert json.loads(stats.read_text())["config"]["lms_frac"] == "auto"


# -- torchrun's options ---------------------------------------------------------------------------

def test_torchrun_options_come_from_torchruns_parser():
    from torch.distributed.run import get_args_parser

    taken = {p.opts[0] for p in run_cli.command.params if p.name.startswith("torchrun_")}
    for action in get_args_parser()._actions:
        spellings = [s for s in action.option_strings if s.startswith("--")]
        if not spellings:
            continue                               # the script and its arguments
        name = spellings[0][2:].replace("_", "-")
        assert (f"--{name}" in taken) == (name not in run_cli._NOT_TAKEN), name


def test_torchrun_options_are_passed_on_as_torchrun_spells_them(monkeypatch, tmp_path):
    script = write(tmp_path / "s.py", "")
    argv, _ = torchrun_argv(monkeypatch, "--standalone", "--nproc_per_node", "2",
                            "--start-method", "fork", "-r", "3", script)
    assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[-1] == script
    assert {"--standalone", "--nproc-per-node=2", "--start-method=fork",
            "--redirects=3"} <= set(argv)
