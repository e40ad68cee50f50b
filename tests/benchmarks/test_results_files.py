"""Every results file is in the results shape, reruns from its ``command``, and is the README's figure.

Fast: nothing here runs a benchmark. A command's flags are parsed with the argparse parser of the
module it names (its ``build_parser()``; for a script without one, the parser its ``main`` builds,
caught before it parses anything)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import shlex
from pathlib import Path

import pytest

from benchmarks import render_readme
from benchmarks._result import RESULTS_DIR, Run, check_result, write_result

FILES = sorted(RESULTS_DIR.glob("*.json"))
BENCHMARKS = RESULTS_DIR.parent


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def _module_of(command: str) -> tuple[str, list[str]]:
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"] and len(argv) >= 3, f"{command!r} is not `python -m benchmarks.<module> ...`"
    return argv[2], argv[3:]


def _needs_argv(main: object) -> bool:
    params = list(inspect.signature(main).parameters.values())
    return bool(params) and params[0].default is inspect.Parameter.empty


def _parser_of(module_name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    spec = importlib.util.find_spec(module_name)
    assert spec is not None, f"no module {module_name}"
    if spec.submodule_search_locations is not None:  # a package run with -m: its __main__
        module_name += ".__main__"
    module = importlib.import_module(module_name)
    assert Path(module.__file__).resolve().is_relative_to(BENCHMARKS), f"{module_name} is not under benchmarks/"
    if hasattr(module, "build_parser"):
        return module.build_parser()

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Built(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        try:
            module.main(*([[]] if _needs_argv(module.main) else []))
        except _Built as built:
            return built.parser
    raise AssertionError(f"{module_name}.main() built no argparse parser (give it a build_parser())")


def test_there_are_results_files() -> None:
    assert len(FILES) >= 10


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_results_file_is_in_the_results_shape(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert check_result(doc) == []
    assert doc["name"] == path.stem


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_results_file_command_parses_with_its_module(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    module_name, flags = _module_of(doc["command"])
    assert module_name.startswith("benchmarks."), module_name
    parser = _parser_of(module_name, monkeypatch)
    try:
        parser.parse_args(flags)
    except SystemExit as e:
        pytest.fail(f"{path.stem}: {module_name} does not accept {flags} (exit {e.code})")


def test_readme_block_is_the_rendering_of_the_results_files() -> None:
    readme = render_readme.README.read_text(encoding="utf-8")
    assert render_readme.differences(readme, render_readme.load_results()) == [], (
        "benchmarks/README.md's figures table is stale: run python -m benchmarks.render_readme")


def test_main_readme_figures_are_the_rendering_of_the_replay_results() -> None:
    top = render_readme.TOP_README.read_text(encoding="utf-8")
    assert render_readme.MAIN_BEGIN in top and render_readme.MAIN_END in top
    assert render_readme.main_differences(top, render_readme.load_results()) == [], (
        "README.md's main command figures are stale: run python -m benchmarks.render_readme")


def test_render_check_names_the_row_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    for name, value in (("alpha", 2.0), ("beta", 30.0)):
        write_result(name, f"{name} figure", "s", [Run(value, 4.0), Run(value * 1.5, 4.0), Run(value, 5.0)],
                     "the baseline", f"python -m benchmarks.bench_{name} --repeats 3", results_dir=results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{render_readme.BEGIN}\n{render_readme.END}\n\nprose\n", encoding="utf-8")
    top = tmp_path / "TOP.md"
    top.write_text("# no main figures here\n", encoding="utf-8")
    argv = ["--readme", str(readme), "--results", str(results), "--top-readme", str(top)]
    assert render_readme.main([*argv, "--check"]) == 1
    assert "alpha: no row in the README" in capsys.readouterr().err
    assert render_readme.main(argv) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.endswith("\n\nprose\n") and "| `alpha` | alpha figure | 2 | s | the baseline | 4 | 0.5 | 3 |" in text
    assert render_readme.main([*argv, "--check"]) == 0
    write_result("beta", "beta figure", "s", [Run(31.0, 4.0)], "the baseline", "python -m benchmarks.bench_beta",
                 results_dir=results)
    (results / "gamma.json").write_text((results / "alpha.json").read_text().replace('"alpha"', '"gamma"'))
    assert render_readme.main([*argv, "--check"]) == 1
    err = capsys.readouterr().err
    assert "beta: the row differs from its results file" in err and "gamma: no row in the README" in err
    assert "alpha" not in err
    (results / "gamma.json").unlink()
    readme.write_text("no markers\n", encoding="utf-8")
    assert render_readme.main([*argv, "--check"]) == 1
    assert "needs the markers" in capsys.readouterr().err
