"""A process that set SIGPIPE's default action (as `dcs ckpt` does, and trainer scripts piping their output may)
must not die when the host agent it talks to is gone (its worker killed): the link's writes get EPIPE, the node
falls back to beating itself. Before, the first renewal after the agent died killed such a process silently."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import asyncio, signal, socket, sys
    from pathlib import Path
    from dcs_tasks.hostagent import AgentUnusable, _Link

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    path = Path(sys.argv[1])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    async def main() -> None:
        link = await _Link.open(path, timeout=2.0)
        conn, _ = server.accept()
        conn.close()  # the agent is gone (kill -9 of its worker closes its sockets)
        server.close()
        for _ in range(3):  # the first write may still land in the socket buffer; later ones get EPIPE
            try:
                await link.ask(b'{"op": "renew"}\\n', timeout=1.0)
            except AgentUnusable as exc:
                print("unusable:", exc, flush=True)
        link.close()

    asyncio.run(main())
    print("alive", flush=True)
    """
)


def test_a_gone_agent_is_an_error_not_a_sigpipe(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "agent.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)  # -13 was SIGPIPE
    assert done.stdout.count("unusable:") == 3 and done.stdout.rstrip().endswith("alive"), done.stdout
