"""`dcs config`: every setting, its environment variable, default and effective value.

Secrets are masked: the token (a SecretStr) and the credentials of every URL (`DCS_REDIS_URL`'s password).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import SecretStr

from dcs_tasks.cli.readers import read_by
from dcs_tasks.config import MASK, DCSConfig, mask_url_credentials


def register(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser("config", help="show the effective DCS settings")
    parser.add_argument("--markdown", action="store_true", help="print a reference table (docs/configuration.md)")
    parser.set_defaults(func=run)


def _shown(value: Any) -> str:
    """The value as printed: secrets as `***`, URL credentials masked."""
    if isinstance(value, SecretStr):
        return MASK
    if value is None:
        return "-"
    if hasattr(value, "value"):
        text = str(value.value)
    elif isinstance(value, dict | list):
        text = json.dumps(value)
    else:
        text = str(value)
    return mask_url_credentials(text)


def rows(config: DCSConfig) -> list[tuple[str, str, str, str, str]]:
    """(field, env var, type, default, effective value) for every setting."""
    out = []
    for name, field in DCSConfig.model_fields.items():
        annotation = getattr(field.annotation, "__name__", None) or str(field.annotation)
        annotation = (
            annotation.replace("typing.", "").replace("pydantic.types.SecretStr", "secret").replace("pathlib.", "")
        )
        default = field.get_default(call_default_factory=True)
        out.append((name, f"DCS_{name.upper()}", annotation, _shown(default), _shown(getattr(config, name))))
    return out


def run(args: argparse.Namespace) -> int:
    config = DCSConfig()  # invalid settings: `dcs` prints one line each, without the values (dcs_tasks.cli.main)
    if args.markdown:
        print("| setting | environment | read by | type | default | description |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, env, kind, default, _ in rows(config):
            doc = " ".join((DCSConfig.model_fields[name].description or "").split()).replace("|", "\\|")
            print(f"| `{name}` | `{env}` | {read_by(name)} | {kind.replace('|', 'or')} | `{default}` | {doc} |")
        return 0
    width = max(len(env) for _, env, *_ in rows(config))
    for _, env, _, default, value in rows(config):
        marker = "" if value == default else "   (default " + default + ")"
        print(f"{env:<{width}}  {value}{marker}")
    return 0
