"""Where settings come from: dataclass defaults, then a YAML config file, then command-line
flags; a flag wins over the file, the file over the default.

A config file describes a deployment: top-level keys are shared by every role (model, device,
dtype, trust_remote_code) and a section per role (`encode:`, `prefill:`, `decode:`, `serve:`)
holds that role's settings, which may also override the shared ones. Every key in the file is
checked, whichever role reads it, so a typo fails loudly and names the key.

A setting that stands for a vLLM flag takes that flag too (`vllm`), so a `vllm serve` command
line starts `epd serve`; a list takes vLLM's JSON form ('["*"]') as well as words.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from epd.config.roles import ROLES, ModelOptions
from epd.config.vllm import VllmFlag

T = TypeVar("T")
SHARED = tuple(f.name for f in dataclasses.fields(ModelOptions))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def coerce(hint: Any, value: Any, key: str) -> Any:
    """A file value as the field's type; ValueError naming `key` if it is not one."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(i, str) for i in items):
            return list_items(items, key)
        raise ValueError(f"{key} must be a list of strings, got {value!r}")
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if type(value) is not hint:
        raise ValueError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def list_items(values: Iterable[str], key: str) -> tuple[str, ...]:
    """A list setting's items: each value is words apart at spaces, or a JSON list of strings
    (vLLM's form: `--allowed-origins '["*"]'` is the origin *, not one named `["*"]`)."""
    items: list[str] = []
    for value in values:
        if not value.lstrip().startswith("["):
            items += value.split()
            continue
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if not (isinstance(parsed, list) and all(isinstance(i, str) for i in parsed)):
            raise ValueError(f"{key}: {value!r} is not a JSON list of strings")
        items += parsed
    return tuple(items)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Load and check a whole config file; errors name the file and the key."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a mapping of settings")
    for key, value in raw.items():
        if key in ROLES:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: {key} must be a mapping of {key} settings")
            _check_keys(value, ROLES[key], f"{path}: {key}.")
        elif key in SHARED:
            coerce(_hints(ModelOptions)[key], value, f"{path}: {key}")
        else:
            known = ", ".join([*SHARED, *ROLES])
            raise ValueError(f"{path}: unknown setting {key!r} (top-level keys: {known})")
    return raw


def _check_keys(section: dict[str, Any], cls: type, where: str) -> None:
    hints = _hints(cls)
    for key, value in section.items():
        if key not in hints:
            raise ValueError(f"{where}{key} is not a setting of this role")
        coerce(hints[key], value, f"{where}{key}")


def role_values(raw: dict[str, Any], role: str) -> dict[str, Any]:
    """The values a file gives one role: shared keys, then its own section."""
    hints = _hints(ROLES[role])
    values = {k: v for k, v in raw.items() if k in SHARED} | raw.get(role, {})
    return {k: coerce(hints[k], v, k) for k, v in values.items()}


def build(cls: type[T], values: dict[str, Any]) -> T:
    """A role's config from merged values; a missing required setting is named."""
    for name, f in _fields(cls).items():
        if f.default is dataclasses.MISSING and name not in values:
            first = " (or give it first: epd serve MODEL)" if name == "model" else ""
            raise ValueError(
                f"{name} is required: pass --{name.replace('_', '-')}{first} or set it in --config"
            )
    return cls(**values)


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    config_file: bool = True,
    only: typing.Collection[str] | None = None,
    note: str = "",
) -> None:
    """One flag per field (or per field in `only`), and its vLLM flag if it has one; unset
    flags stay out of the namespace so the file can fill them."""
    if config_file:
        parser.add_argument("--config", help="YAML config file; flags given here win over it")
    hints = _hints(cls)
    for name, f in _fields(cls).items():
        if only is not None and name not in only:
            continue
        hint, kwargs = hints[name], dict[str, Any](default=argparse.SUPPRESS, dest=name)
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is tuple:
            kwargs |= {"nargs": "+", "type": typing.get_args(hint)[0]}
        else:
            kwargs["type"] = hint
        flag = f"--{name.replace('_', '-')}"
        vllm: VllmFlag | None = f.metadata.get("vllm")
        # A vLLM flag that writes its value as epd does is another name of epd's own; one of
        # the same name reads vLLM's forms too (`--max-model-len 32k`).
        aliases = [vllm.name] if vllm and not vllm.parse and vllm.name != flag else []
        if vllm is not None and vllm.parse is not None and vllm.name == flag:
            kwargs["type"] = vllm.parse
        parser.add_argument(flag, *aliases, help=help_text(f, note), **kwargs)
        if vllm is not None and vllm.parse is not None and vllm.name != flag:
            parser.add_argument(
                vllm.name,
                dest=name,
                type=vllm.parse,
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=f"{flag} in vLLM's form: {vllm.form}",
            )


def help_text(f: dataclasses.Field[Any], note: str = "") -> str:
    """A field's help, and in brackets the roles it goes to, its default and its vLLM flag."""
    text, vllm = f.metadata["help"], f.metadata.get("vllm")
    if f.default is dataclasses.MISSING:
        said = ["required"]
    else:  # a help that names its default in words says it better than the value
        said = [] if "(default:" in text else [f"default: {f.default}"]
    said += [f"vLLM: {vllm.name}"] if vllm else []
    said_all = note + "; ".join(said)
    return f"{text} ({said_all.removesuffix('; ')})" if said_all else text


# Settings `epd serve` decides for its children: the loopback addresses that join them.
SERVE_OWNS = frozenset(
    {
        *("bind", "advertise", "encoders", "decoders", "prefills", "health_host", "health_port"),
        *("peer_metrics", "prefill_urls", "kv_events_bind"),
    }
)


def child_settings() -> dict[str, list[str]]:
    """The children's settings that `epd serve` passes on as its own flags, with the roles that
    have each: everything a single-node user may set but the addresses serve owns."""
    own = set(_fields(ROLES["serve"])) | SERVE_OWNS
    roles: dict[str, list[str]] = {}
    for role in ("encode", "prefill", "decode", "route"):
        for name in _fields(ROLES[role]):
            if name not in own:
                roles.setdefault(name, []).append(role)
    return roles


def add_child_flags(parser: argparse.ArgumentParser) -> None:
    """`epd serve`'s flags for its children's settings, each applied to every role that has it."""
    for name, roles in child_settings().items():
        add_flags(parser, ROLES[roles[0]], False, only={name}, note=f"{', '.join(roles)}; ")


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of `cls` given as flags; a checkpoint given first (`epd serve MODEL`, as
    vLLM's) is the model, and an error if --model names another."""
    fields = _fields(cls)
    given = {
        k: list_items(v, k) if isinstance(v, list) else v
        for k, v in vars(args).items()
        if k in fields
    }
    if "disable_log_requests" in fields and "enable_log_requests" in vars(args):
        given["disable_log_requests"] = not args.enable_log_requests  # vLLM's newer switch
    first = vars(args).get("model_path")
    if first is not None and "model" in fields and given.setdefault("model", first) != first:
        raise ValueError(f"two models: {first} first, and --model {given['model']}")
    return given


def resolve(cls: type[T], role: str, args: argparse.Namespace) -> T:
    """defaults < config file < flags."""
    file = role_values(read_config_file(args.config), role) if args.config else {}
    return build(cls, file | flag_values(args, cls))


SECRETS = {"api_key": "EPD_API_KEY"}  # passed to children in the environment, not in argv


def to_flags(config: Any) -> list[str]:
    """The command line that reproduces `config` exactly (used by `epd serve` for its children),
    secrets left out: anyone on the machine can read a command line (see `secret_env`)."""
    argv = []
    for f in dataclasses.fields(config):
        if f.name in SECRETS:
            continue
        value, flag = getattr(config, f.name), f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            argv += [flag, *value] if value else []  # empty: the default (no values)
        else:
            argv += [flag, str(value)]
    return argv


def secret_env(config: Any) -> dict[str, str]:
    """The environment that carries `config`'s secrets to a child."""
    return {env: value for name, env in SECRETS.items() if (value := getattr(config, name, ""))}
