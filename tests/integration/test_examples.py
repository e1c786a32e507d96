"""The README's quickstart and the scripts in examples/, run as the README tells a user to run them: `dcs up
--receivers 2` (with the memory tier on), its `.dcs-run/dcs.env` sourced, then `python examples/<script>.py`. One
stack serves the module's tests; the quickstart's second shell is the README's own lines, run by bash in a
directory laid out like the checkout (`.venv`, `examples`, `.dcs-run`). The S3 example runs in
tests/storage/test_example_s3.py (it needs the S3 server's fixtures).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.preloaded_script import run_script
from tests.helpers.procs import REPO
from tests.helpers.waiting import read_until
from tests.integration.local_support import clean_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
UP_TIMEOUT = 150.0
EXAMPLE_TIMEOUT = 180.0


@dataclass
class Stack:
    env: dict[str, str]  # a shell's environment once it sourced the stack's dcs.env
    home: Path  # a directory like the checkout: .venv and examples (links), .dcs-run (the stack's workdir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A running `dcs up --receivers 2`, started as the quickstart starts it, with the memory tier on."""
    home = tmp_path_factory.mktemp("examples")
    for name in (".venv", "examples"):
        (home / name).symlink_to(REPO / name)
    workdir = home / ".dcs-run"
    runtime = Path(f"/dev/shm/dcs-test-examples-{uuid.uuid4().hex[:8]}")  # not the user's own runtime directory
    runtime.mkdir(mode=0o700)
    settings = {"DCS_RUNTIME_DIR": str(runtime), "DCS_MEMORY_TIER_BYTES": str(256 << 20)}
    settings["DCS_STORAGE_EVERY_STEPS"] = "10"
    up = [sys.executable, "-m", "dcs_tasks.cli.main", "up", "--workdir", str(workdir), "--receivers", "2"]
    proc = subprocess.Popen(
        [*up, "--no-flower"],
        env=clean_env(**settings),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        read_until(proc, "Ctrl-C stops everything.", UP_TIMEOUT)
        sourced = dict(shlex.split(line)[0].split("=", 1) for line in (workdir / "dcs.env").read_text().splitlines())
        yield Stack(clean_env(**sourced), home)
    finally:
        if proc.poll() is None:  # Ctrl-C, as a user stops it
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(runtime, ignore_errors=True)


def run_example(env: dict[str, str], script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python examples/SCRIPT ARGS` as a user runs it, forked from the forkserver that already imported torch and
    DCS (tests/helpers/preloaded_script.py): the same script, argv, environment and exit status, seconds sooner."""
    workdir = Path(tempfile.mkdtemp(prefix=f"example-{Path(script).stem}-"))
    try:
        done = run_script(REPO / "examples" / script, *args, workdir=workdir, env=env, timeout=EXAMPLE_TIMEOUT)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done


def test_the_trainer_example_saves_and_a_second_run_resumes(stack: Stack) -> None:
    first = run_example(stack.env, "trainer.py", "--run", "example-trainer", "--steps", "250")
    assert "committed steps: [0, 100, 200]" in first.stdout, first.stdout
    second = run_example(stack.env, "trainer.py", "--run", "example-trainer", "--steps", "320")
    assert "resumed from step 200" in second.stdout, second.stdout
    assert "trained steps 201-319; committed steps: [0, 100, 200, 300]" in second.stdout, second.stdout


def test_the_memory_tier_example_restores_from_memory(stack: Stack) -> None:
    done = run_example(stack.env, "memory_tier.py", "--run", "example-memory", "--steps", "12")
    assert "restored step 11 from memory" in done.stdout and "bit-exact: True" in done.stdout, done.stdout


def test_the_weight_push_example_reaches_both_receivers_bit_exact(stack: Stack) -> None:
    done = run_example(stack.env, "weight_push.py")
    for rank in (0, 1):
        assert f"receiver {rank}: weight version 1, bit-exact: True" in done.stdout, done.stdout


def test_the_dcp_example_saves_with_dcp_and_loads_bit_exact(stack: Stack) -> None:
    done = run_example(stack.env, "dcp_save.py", "--run", "example-dcp", "--steps", "30")
    assert "committed steps: [10, 20, 30]" in done.stdout, done.stdout
    assert "loaded step 30 with dcp.load, bit-exact: True" in done.stdout, done.stdout


def test_the_lightning_example_saves_and_a_second_run_resumes_from_last(stack: Stack, tmp_path: Path) -> None:
    markers = ("--run", "example-lightning", "--dir", str(tmp_path / "lightning-markers"))
    first = run_example(stack.env, "lightning_trainer.py", *markers, "--steps", "30")
    assert "trained to step 30; committed steps: [10, 20, 30]" in first.stdout, first.stdout
    second = run_example(stack.env, "lightning_trainer.py", *markers, "--steps", "50")
    assert "resumed from step 30" in second.stdout, second.stdout
    assert "trained to step 50; committed steps: [10, 20, 30, 40, 50]" in second.stdout, second.stdout


def test_the_hf_trainer_example_saves_and_a_second_run_resumes(stack: Stack) -> None:
    first = run_example(stack.env, "hf_trainer.py", "--run", "example-hf", "--steps", "30")
    assert "trained to step 30; committed steps: [10, 20, 30]" in first.stdout, first.stdout
    second = run_example(stack.env, "hf_trainer.py", "--run", "example-hf", "--steps", "50")
    assert "resumed from step 30" in second.stdout, second.stdout
    assert "trained to step 50; committed steps: [10, 20, 30, 40, 50]" in second.stdout, second.stdout


def quickstart_second_shell() -> str:
    """The README quickstart's second bash block: what a user types once `dcs up` runs."""
    section = (REPO / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the README's quickstart lost its two shells"
    return blocks[1]


def test_the_readme_quickstart_trains_resumes_lists_and_pushes(stack: Stack) -> None:
    shell = clean_env(PATH=os.environ.get("PATH", "/usr/bin:/bin"))  # no DCS_* until the quickstart sources them
    script = "set -e\n" + quickstart_second_shell()
    done = subprocess.run(
        ["bash", "-c", script], env=shell, cwd=stack.home, capture_output=True, text=True, timeout=3 * EXAMPLE_TIMEOUT
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert "committed steps: [0, 100, 200]" in out and "resumed from step 200" in out, out
    listed = [line.split()[0] for line in out.splitlines() if re.match(r"^\s*\d+\s", line)]
    assert listed[-4:] == ["0", "100", "200", "300"] and "<- latest" in out, out
    assert "receiver 0: weight version" in out and out.count("bit-exact: True") >= 2, out


def test_the_verl_example_pushes_through_verls_own_registry(stack: Stack) -> None:
    from tests.verl_lib import pythonpath

    done = run_example(pythonpath(stack.env), "verl_backend.py")  # verl 0.9.1 from .verl/ (make verl-lib)
    assert "verl's registry gave dcs_tasks.integrations.verl.DCSCheckpointEngine" in done.stdout, done.stdout
    for version in (1, 2):
        assert f"rollout worker: weight version {version}, bit-exact: True" in done.stdout, done.stdout
