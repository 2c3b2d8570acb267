"""The command line as a user meets it: a bad argument or path is one line and exit status 2,
never a traceback, a "found bug" or a silently empty run; results never overwrite committed docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkv import __version__
from toolkv.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    assert words in err and "Traceback" not in err, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert (
        capsys.readouterr().out.strip() == f"toolkv {__version__} (sglang plugin for sglang 0.5.16, 0.5.23)"
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["demo", "--sessions", "-1"], "argument --sessions: '-1': expected an integer >= 1"),
        (["demo", "--turns", "0"], "argument --turns: '0': expected an integer >= 1"),
        (["demo", "--abandon", "1.5"], "argument --abandon: '1.5': expected a finite number from 0 to 1"),
        (["demo", "--plot", "/nonexistent-dir/occupancy.png"], "no directory '/nonexistent-dir'"),
        (["demo", "--plot", "occupancy.txt"], "expected a file ending in .png or .svg or .pdf"),
        (["fuzz", "--mutants", "--only", "NoSuchMutant"], "unknown mutant(s) ['NoSuchMutant']"),
        (["fuzz", "--device", "tpu"], "argument --device: 'tpu': expected cpu or cuda[:N]"),
        (["fuzz", "--examples", "0"], "argument --examples: '0': expected an integer >= 1"),
        (["bench", "overhead", "--sizes", "10,-3"], "expected a comma list, each an integer >= 1"),
    ],
)
def test_bad_arguments_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    _fails(capsys, argv, words)


def test_plot_path_under_a_file_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "file.txt"
    f.write_text("")
    _fails(capsys, ["demo", "--plot", str(f / "x.png")], "no directory")


def test_missing_trace_file_is_a_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["trace-check", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"toolkv trace-check: error: No such file or directory: {missing}"


def test_bench_writes_under_results_not_docs() -> None:
    from toolkv.tools.bench import output_path
    from toolkv.tools.cli import build_parser

    parser = build_parser()
    for what in ("overhead", "transfer"):
        args = parser.parse_args(["bench", what])
        assert output_path(args) == Path("results") / "bench" / f"{what}.json"
    assert "/results/" in (ROOT / ".gitignore").read_text().splitlines()
    args = parser.parse_args(["bench", "overhead", "--out", str(ROOT / "docs" / "bench" / "overhead.json")])
    assert output_path(args) == ROOT / "docs" / "bench" / "overhead.json"  # replacing them is explicit


def test_fuzz_defaults_pass_the_argument_check() -> None:
    from toolkv.tools.cli import CHECKS, build_parser

    assert CHECKS["fuzz"](build_parser().parse_args(["fuzz"])) is None
    assert CHECKS["fuzz"](build_parser().parse_args(["fuzz", "--mutants", "--only", "NoTtl"])) is None
