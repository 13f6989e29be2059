"""Parsing of the GRPO job's config: ``parse_job_args(argv) -> (JobArguments, GptOssGRPOConfig)``.

``TrlParser((JobArguments, GptOssGRPOConfig))`` on ``--config x.yaml`` plus ``--field value`` overrides, then
``check_job`` (``grpo_checks``): every error is a ``SystemExit`` that names the key and what to change, raised
before any model loads.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields

from trl_gptoss.scripts.grpo_arguments import JobArguments
from trl_gptoss.scripts.grpo_checks import check_job


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    if "--config" not in argv:
        return None, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("error: --config needs a path to a YAML file (e.g. examples/configs/retool_cpu_demo.yaml)")
    return argv[i + 1], argv


def _known_fields(dataclass_types) -> list[str]:
    return [f.name for t in dataclass_types for f in fields(t)]


def _unknown_field_message(error: str, known: list[str]) -> str:
    """Add 'did you mean' hints to TRL's/argparse's unknown-argument errors."""
    hints = []
    for token in error.replace("[", " ").replace("]", " ").replace(",", " ").replace("'", " ").split():
        if token.startswith("--"):
            close = difflib.get_close_matches(token[2:], known, n=3)
            if close:
                hints.append(f"{token[2:]!r} -> did you mean {', '.join(close)}?")
    hint = ("\n  " + "\n  ".join(hints)) if hints else ""
    return (
        f"{error}{hint}\nFix the field name in the YAML/command line (fields: JobArguments in "
        "trl_gptoss/scripts/grpo_arguments.py and GptOssGRPOConfig; `--help` lists them)."
    )


# Items a config value may expand to (aliases counted each time they are used): real configs hold a few dozen;
# a YAML alias bomb of a few lines expands to hundreds of millions, which every later check and message would walk.
MOST_ITEMS = 10_000
# Characters an error message may have: a value it echoes is cut well before this; the rest is a safety net.
MOST_MESSAGE_CHARS = 8_000


def _unique_key_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently).
        Keys merged in with ``<<: *anchor`` may be overridden, as YAML intends."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                lines: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = lines.setdefault(key, key_node.start_mark.line + 1)
                    except TypeError:  # an unhashable key: the parent's construct_mapping says so
                        continue
                    if first != key_node.start_mark.line + 1:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"{key!r} is given twice (lines {first} and {key_node.start_mark.line + 1}), and only the "
                            "last would count; keep one",
                            key_node.start_mark,
                        )
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _expands_beyond(value, most: int) -> bool:
    """Whether ``value`` holds more than ``most`` items, counting a list or mapping each time it is reached
    (a recursive value never ends, so it is over any bound)."""
    stack, seen = [value], 0
    while stack:
        seen += 1
        if seen > most:
            return True
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def bounded(message: str, most: int = MOST_MESSAGE_CHARS) -> str:
    """``message`` cut to ``most`` characters, saying how many were left out."""
    if len(message) <= most:
        return message
    return f"{message[:most]}... ({len(message) - most} more characters left out)"


def read_config(path: str) -> dict:
    """The YAML mapping at ``path``; ``SystemExit`` naming the file, the line and what is wrong -- invalid YAML, a
    key given twice, a value that expands to more than ``MOST_ITEMS`` items (a YAML alias bomb)."""
    import yaml

    if not os.path.isfile(path):
        raise SystemExit(
            f"error: config file {path!r} does not exist; give a YAML path such as "
            "examples/configs/retool_cpu_demo.yaml (relative to the directory you run from)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.load(f, Loader=_unique_key_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(exc, "problem", None) or exc
        raise SystemExit(f"error: {where}: not valid YAML ({problem}); fix the syntax at that line") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: config file {path!r} cannot be read ({exc})") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise SystemExit(
            f"error: {path}: the config must be a YAML mapping of `field: value` lines, got a {type(config).__name__}"
        )
    if too_large := [key for key, value in config.items() if _expands_beyond(value, MOST_ITEMS)]:
        raise SystemExit(
            f"error: {path}: {bounded(', '.join(map(str, too_large)), 200)}: expands to more than {MOST_ITEMS} "
            "items (YAML aliases repeating one another, or a value that contains itself); write the value out"
        )
    if not isinstance(config.get("env", {}), dict):
        raise SystemExit(f"error: {path}: env: give a mapping of environment variables (`env: {{NAME: value}}`)")
    return config


def parse_job_args(argv: list[str] | None, *, check: bool = True):
    """``(JobArguments, GptOssGRPOConfig)`` from ``--config x.yaml`` and ``--field value`` overrides.

    Every error is a ``SystemExit`` naming the key: invalid YAML or a key given twice, a value of the wrong type,
    an unknown field (with the closest known names), a value ``GptOssGRPOConfig`` refuses, and -- unless
    ``check=False`` -- what ``check_job`` refuses (job fields, combinations, paths and the vLLM install on this
    machine). A message is at most ``MOST_MESSAGE_CHARS`` long, whatever value it echoes.
    """
    try:
        return _parse_job_args(argv, check)
    except SystemExit as exc:
        if isinstance(exc.code, str) and len(exc.code) > MOST_MESSAGE_CHARS:
            raise SystemExit(bounded(exc.code)) from None
        raise


def _parse_job_args(argv: list[str] | None, check: bool):
    import sys

    from trl import TrlParser

    from trl_gptoss.scripts.config_values import field_types, value_problems
    from trl_gptoss.trainer import GptOssGRPOConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = _split_config(argv)
    types = (JobArguments, GptOssGRPOConfig)
    if config_path is not None:
        config = read_config(config_path)
        config.pop("env", None)
        if problems := value_problems(config, field_types(types)):
            raise SystemExit(f"error: {config_path}: wrong value types:\n  - " + "\n  - ".join(problems))
    parser = TrlParser(types)
    try:
        job, training = parser.parse_args_and_config(argv)
    except ValueError as exc:
        if "Unknown arguments" in str(exc):
            raise SystemExit("error: " + _unknown_field_message(str(exc), _known_fields(types))) from None
        raise SystemExit(f"error: invalid training configuration: {exc}") from None
    except (TypeError, AttributeError, KeyError) as exc:  # a __post_init__ tripping over a value
        raise SystemExit(f"error: invalid training configuration ({type(exc).__name__}: {exc})") from None
    if check:
        check_job(job, training)
    return job, training
