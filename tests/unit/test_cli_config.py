"""`glm5 <command> --config FILE`: flag values from a file, with clear errors for bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5_cli.main import main, parse_args


def test_file_values_become_defaults_and_flags_win(tmp_path: Path) -> None:
    f = tmp_path / "engine.yaml"
    f.write_text("max-model-len: 2048\ndynamic-sparsity: true\nkv-cache-bytes: 64MiB\n")
    args = parse_args(["worker", "--config", str(f)])
    assert (args.max_model_len, args.dynamic_sparsity, args.kv_cache_bytes) == (2048, True, "64MiB")
    assert parse_args(["worker", "--config", str(f), "--max-model-len", "512"]).max_model_len == 512


@pytest.mark.parametrize(
    "content,message",
    [
        ("max-modl-len: 2048\n", "unknown setting 'max-modl-len'"),
        ("max-model-len: lots\n", "'max-model-len'"),
        ("dynamic-sparsity: yes please\n", "takes true or false"),
        ("device: tpu\n", "must be one of"),
        ("- a list\n", "must hold a mapping"),
        ("a: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_files_exit_2_with_the_reason(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "engine.yaml"
    f.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["worker", "--config", str(f)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["worker", "--config", str(tmp_path / "nope.yaml")])
    assert exc.value.code == 2 and "cannot read config file" in capsys.readouterr().err
