"""The architecture rules hold: the import-linter contracts of pyproject.toml
(docs/architecture.md#import-rules), lazy imports included, so `make test` fails when an
import breaks one. `make lint` runs the same contracts (`lint-imports`)."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold(monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)  # the root packages are found from the working directory
    code = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report
