"""`dsv4 make-tiny` shows progress on stderr while it draws and writes (a Flash-shaped
checkpoint takes minutes on a CPU and used to print nothing until the end); the library
function stays quiet unless asked."""

from __future__ import annotations

from dsv4.commands.cli import main
from dsv4.config.model import tiny_config
from dsv4.model.tiny import write_checkpoint


def test_make_tiny_prints_progress_on_stderr(tmp_path, capsys) -> None:
    assert main(["make-tiny", str(tmp_path / "t"), "--linear-dtype", "bf16"]) == 0
    captured = capsys.readouterr()
    assert "drawing weights" in captured.err and "writing shards" in captured.err
    assert "100%" in captured.err  # the bars ran to the end
    assert captured.out.startswith("wrote tiny checkpoint to")  # stdout keeps its one line


def test_write_checkpoint_is_quiet_by_default(tmp_path, capsys) -> None:
    write_checkpoint(tmp_path, tiny_config(), with_tokenizer=False)
    assert capsys.readouterr().err == ""
