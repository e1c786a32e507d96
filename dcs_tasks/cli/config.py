"""`dcs config`: every setting, its environment variable, default and effective value.

Secrets are masked: the token (a SecretStr) and the credentials of every URL (`DCS_REDIS_URL`'s password).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import SecretStr

from dcs_tasks.cli.readers import read_by
from dcs_tasks.config import AREAS, MASK, SETTINGS, DCSConfig, Setting, mask_url_credentials


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


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None) or str(annotation)
    return name.replace("typing.", "").replace("pydantic.types.SecretStr", "secret").replace("pathlib.", "")


def rows(config: DCSConfig) -> list[tuple[Setting, str, str, str]]:
    """(setting, type, default, effective value) for every setting, area by area."""
    out = []
    for setting in SETTINGS.values():
        default = setting.info.get_default(call_default_factory=True)
        out.append((setting, _type_name(setting.info.annotation), _shown(default), _shown(config.value(setting.flat))))
    return out


def markdown(config: DCSConfig) -> list[str]:
    """docs/configuration.md's reference: one table per area of `DCSConfig`, headed by the area's attribute."""
    lines: list[str] = []
    for area, model in AREAS.items():
        lines += [
            "",
            f"## `{area}`",
            "",
            f"`DCSConfig.{area}` ({model.__name__}): {' '.join((model.__doc__ or '').split())}",
            "",
        ]
        lines.append("| setting | environment | read by | type | default | description |")
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for setting, kind, default, _ in rows(config):
            if setting.area != area:
                continue
            doc = " ".join(setting.description.split()).replace("|", "\\|")
            lines.append(
                f"| `{area}.{setting.field}` | `{setting.env}` | {read_by(setting.flat)} | {kind.replace('|', 'or')} "
                f"| `{default}` | {doc} |"
            )
    return lines[1:]


def run(args: argparse.Namespace) -> int:
    config = DCSConfig()  # invalid settings: `dcs` prints one line each, without the values (dcs_tasks.cli.main)
    if args.markdown:
        print("\n".join(markdown(config)))
        return 0
    width = max(len(setting.env) for setting, *_ in rows(config))
    for setting, _, default, value in rows(config):
        marker = "" if value == default else "   (default " + default + ")"
        print(f"{setting.env:<{width}}  {value}{marker}")
    return 0
