"""The config ``hetjax eval`` and ``hetjax generate`` run with: ``--config`` (with
``--hf``: the model read off the directory, :func:`hetjax.launch.run_config`), else the
``config.json`` the run in ``--workdir`` wrote (the config its checkpoints were trained
with, the placement ``auto`` chose included), else with ``--hf`` the library's defaults
(``offload.mode=auto``, budgets measured from this machine), else the default config;
``--config.<key>=<value>`` overrides each. Nothing is loaded here but the config."""

from __future__ import annotations

import json
from pathlib import Path

from hetjax.config import Config, ConfigError, with_renamed_keys


def saved_config(path: Path) -> Config:
    """A run's ``config.json`` as a :class:`Config`; ``ConfigError`` naming the file."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return Config().replace(**with_renamed_keys(saved))
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError too
        raise ConfigError(f"{path}: not a run's config ({e}); give --config") from None


def command_config(argv: list[str]):
    """(launch's parsed arguments, the config, where it came from) of an eval or
    generate command line's launch arguments (``--config``, ``--workdir``, ``--hf``,
    overrides)."""
    from hetjax import launch

    args, overrides = launch.parse_args(argv)
    saved = Path(args.workdir) / "config.json" if args.workdir else None
    if not args.config_given and saved is not None and saved.is_file():
        config = saved_config(saved).override(overrides)
        if args.hf:
            import dataclasses

            from hetjax.hf import model_config_from_hf

            model = model_config_from_hf(args.hf, config.model)
            config = dataclasses.replace(config, model=model)
        return args, config, f"config: {saved} (the run's)"
    config = launch.run_config(args, overrides)
    if args.config_given:
        where = f"config: {args.config}"
    elif args.hf:
        where = "config: the defaults for an imported model (offload.mode=auto)"
    else:
        where = f"config: {args.config} (the default; give --config or --workdir)"
    return args, config, where
