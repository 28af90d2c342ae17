"""`--model tiny`: the deterministic tiny checkpoint that `dsv4 up` and the tests serve.

It is written once into a cache directory, named by its seed and its `--layers` (compress ratios),
and every process of a cluster then loads the same bytes. `dsv4.model.tiny` imports torch, so it
is imported inside the functions: importing this module (as `dsv4 up` does) loads no torch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dsv4.errors import ConfigError, UsageError


def tiny_ratios(layers: str) -> tuple[int, ...]:
    """`--layers` (compress ratios, e.g. "0,4,128,4") as the tiny model takes them;
    `UsageError` naming the flag otherwise."""
    from dsv4.model.tiny import shape_config

    try:
        ratios = tuple(int(r) for r in layers.split(","))
        shape_config("tiny", "fp8", "fp4").with_overrides(
            num_hidden_layers=len(ratios), compress_ratios=ratios
        )
    except ValueError:
        raise UsageError(f"--layers {layers}: give compress ratios such as 0,4,128,4") from None
    except ConfigError as exc:
        raise UsageError(f"--layers {layers}: {exc.fix}") from None
    return ratios


def ensure_tiny_checkpoint(cache_dir: Path, layers: str, seed: int = 0) -> Path:
    """The tiny checkpoint for `layers` (compress ratios, e.g. "0,4,128,4"), written once."""
    ratios = tiny_ratios(layers) if layers else ()
    name = f"tiny-seed{seed}" + (f"-layers{'_'.join(map(str, ratios))}" if ratios else "")
    out = cache_dir / name
    if (out / "config.json").exists():
        return out
    from dsv4.model.tiny import shape_config, write_checkpoint

    cfg = shape_config("tiny", "fp8", "fp4")
    if ratios:
        cfg = cfg.with_overrides(num_hidden_layers=len(ratios), compress_ratios=ratios)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    write_checkpoint(staging, cfg, seed=seed)
    try:
        staging.rename(out)  # atomic: a concurrent writer's copy wins, ours is dropped
    except OSError:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return out
