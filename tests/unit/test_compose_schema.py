"""compose/: valid against the compose-spec schema, and consistent with the image and the environment file.

No container engine runs here, so this checks what `docker compose up` relies on without one: the file's
structure (the vendored compose-spec schema, tests/vendor/compose-spec/README.md), that the worker's checkpoint
volume is mounted where the image prepares it for user `dcs`, Flower's auth setting, the build context's
.dockerignore, the Dockerfile's base-image argument, and that every variable it reads is in .env.example.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose" / "docker-compose.yml"
DOCKERFILE = REPO / "compose" / "Dockerfile"
SCHEMA = REPO / "tests" / "vendor" / "compose-spec" / "compose-spec.json"
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?P<rest>[^}]*)\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


@pytest.fixture(scope="module")
def validator() -> Any:
    return jsonschema_rs.validator_for(json.loads(SCHEMA.read_text()))


def errors(validator: Any, doc: dict[str, Any]) -> list[str]:
    return [f"{list(e.instance_path)}: {e.message}" for e in validator.iter_errors(doc)]


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.MULTILINE))


def default_of(expression: str) -> str:
    """The value `${NAME:-default}` takes when NAME is unset (compose's interpolation)."""
    match = INTERPOLATION.fullmatch(expression)
    assert match and match["rest"].startswith(":-"), f"{expression!r} is not ${{NAME:-default}}"
    return match["rest"][2:]


def test_compose_file_is_valid_against_the_compose_spec_schema(compose: dict[str, Any], validator: Any) -> None:
    assert errors(validator, compose) == []


def test_the_schema_check_rejects_a_broken_file(compose: dict[str, Any], validator: Any) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["volumes"][0]["bind"]["create_host_path"] = "no"
    broken["services"]["flower"]["ports"] = "127.0.0.1:5555:5555"
    assert len(errors(validator, broken)) >= 2


def test_worker_mounts_the_checkpoint_dir_where_the_image_prepares_it_for_dcs(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    mount = next(v for v in worker["volumes"] if isinstance(v, dict) and v["target"] != "/dev/shm")
    assert mount["type"] == "bind" and mount["source"] == mount["target"]  # tasks carry absolute host paths
    assert mount["bind"]["create_host_path"] is False  # never a root-owned directory the worker cannot write
    assert worker["environment"]["DCS_CHECKPOINT_DIR"] == mount["target"]
    build = worker["build"]
    assert build["args"]["DCS_CHECKPOINT_DIR"] == mount["target"]  # the image prepares the mounted path...
    assert default_of(mount["target"]) == dockerfile_args()["DCS_CHECKPOINT_DIR"]  # ...with the same default
    text = DOCKERFILE.read_text()
    assert re.search(r'chown dcs:dcs "\$\{DCS_CHECKPOINT_DIR\}"', text)
    assert re.search(r'useradd .*--uid "\$\{DCS_UID\}"', text) and "USER dcs" in text
    assert {"DCS_UID", "DCS_GID"} <= set(build["args"])


def test_dockerfile_takes_its_base_image_as_a_build_arg(compose: dict[str, Any]) -> None:
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=") and lines[1] == "FROM ${BASE_IMAGE}"
    for name in ("coordinator", "worker", "flower"):
        build = compose["services"][name]["build"]
        assert build["dockerfile"] == "compose/Dockerfile" and "BASE_IMAGE" in build["args"]


def test_flower_uses_the_dcs_app_and_requires_basic_auth(compose: dict[str, Any]) -> None:
    flower = compose["services"]["flower"]
    assert flower["command"][:3] == ["celery", "-A", "workers.celery"]
    auth = flower["environment"]["FLOWER_BASIC_AUTH"]
    assert auth.startswith("${DCS_FLOWER_BASIC_AUTH:?")  # compose refuses to start without it
    assert "FLOWER_UNAUTHENTICATED_API" not in flower["environment"]
    assert flower["environment"]["DCS_REDIS_URL"] == "redis://redis:6379/0"


def test_every_published_port_is_on_loopback(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"


def test_dockerignore_keeps_the_build_context_small_and_secret_free() -> None:
    patterns = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", ".sglang", ".env", "bench/results", "**/__pycache__", ".mypy_cache"} <= patterns


def test_every_interpolation_has_a_default_or_is_required() -> None:
    """`${NAME:-}` (an empty default) reaches the containers literally under podman-compose 1.0.3 (Debian 12):
    a token of "${DCS_AUTH_TOKEN:-}". Optional values are passed through by name instead (`NAME:` with no value)."""
    for match in INTERPOLATION.finditer(COMPOSE.read_text()):
        rest = match["rest"]
        assert (rest.startswith(":-") and len(rest) > 2) or rest.startswith(":?"), match[0]


def test_every_variable_compose_reads_is_documented_in_env_example() -> None:
    used = {m["name"] for m in INTERPOLATION.finditer(COMPOSE.read_text())}
    documented = set(re.findall(r"^#?\s*(DCS_[A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.MULTILINE))
    assert used - documented == set()
